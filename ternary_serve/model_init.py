"""Compose's model-init: bring the configured model into place if a source is given (fetch it, or
convert a checkpoint directory), then verify it with the configured engine's checks and make sure
the server's user can read it."""

from __future__ import annotations

import stat
from pathlib import Path

from ternary_serve.convert import convert
from ternary_serve.credentials import SERVICE_UID
from ternary_serve.fetch import obtain, parser, run_reporting
from ternary_serve.versions import configured_engine_repo
from ternary_serve.weights import WeightsError, engine_family, verify


def require_server_can_read(path: Path) -> None:
    """model-init runs as root; the server does not, so it needs the world-read bits."""
    if not path.stat().st_mode & stat.S_IROTH or not path.parent.stat().st_mode & stat.S_IXOTH:
        raise WeightsError(
            f"{path} is not readable by uid {SERVICE_UID} (the server's user): "
            "chmod a+r the file and a+rx its directory"
        )


def main(argv: list[str] | None = None) -> int:
    ap = parser("ternary-serve model-init", __doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="the model file the server will load")
    ap.add_argument(
        "--source",
        default="",
        help="what to fetch (name, URL, hf://, file) or convert (a checkpoint directory)",
    )
    ap.add_argument("--type", default="Q2_0", help="what a checkpoint source is converted to")
    args = ap.parse_args(argv)
    args.sha256 = args.sha256 or None  # Compose passes unset variables as empty strings
    engine = engine_family(args.engine_repo or configured_engine_repo(args.env_file))

    def init() -> None:
        if args.source and Path(args.source).is_dir():
            convert(Path(args.source), args.target, args.type, args.backend)
        elif args.source:
            obtain(args.source, args.target, args)
        summary = verify(args.target, args.backend, engine=engine)
        require_server_can_read(args.target)
        print(
            f"model-init: {args.target} ready: {summary['architecture']}, "
            f"{', '.join(summary['tensor_types'])} ({engine} engine)"
        )

    return run_reporting(init, args.source or str(args.target), "model-init")
