"""Fetch model weights into MODEL_DIR: resumable, checksummed, verified, placed atomically.

Sources: a Hugging Face repo file (huggingface_hub; HF_TOKEN optional), an http(s) URL, or a local
path. The download goes to `<name>.partial` beside the target and resumes from there; only a file
whose SHA-256 matches the pin and that passes the GGUF checks is renamed into place, so a half or
wrong file never sits at the final path. A manifest (`<name>.manifest.json`) records what was
placed; a rerun that finds the target matching its manifest and pin does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import requests
import urllib3
import yaml

from ternary_serve.versions import PROJECT_ROOT, load_versions
from ternary_serve.weights import WeightsError, verify

CHUNK = 8 * 2**20
PROGRESS_EVERY_S = 5.0
# Room left free on the disk beyond the file itself (logs, the server's temporary files).
DISK_MARGIN = 2 * 2**30


class Progress:
    """Prints bytes done, percent and rate to stderr at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, name: str, total: int | None, done: int = 0):
        self.name, self.total, self.done = name, total, done
        self.started = self.last = time.monotonic()
        self.start_bytes = done

    def update(self, n: int, final: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if not final and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = (self.done - self.start_bytes) / max(now - self.started, 1e-6) / 2**20
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        total = f"/{self.total / 2**30:.2f}" if self.total else ""
        print(
            f"fetch: {self.name}: {self.done / 2**30:.2f}{total} GiB{share} {rate:.0f} MiB/s",
            file=sys.stderr,
            flush=True,
        )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + DISK_MARGIN:
        raise WeightsError(
            f"{directory} has {free / 2**30:.1f} GiB free, the download needs "
            f"{(needed + DISK_MARGIN) / 2**30:.1f} GiB: free space there or set MODEL_DIR elsewhere"
        )


def download_url(url: str, partial: Path, expected_size: int | None, timeout: float) -> None:
    """Download url into partial, resuming from its current length (HTTP Range)."""
    have = partial.stat().st_size if partial.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with requests.get(url, headers=headers, stream=True, timeout=timeout) as resp:
        if resp.status_code == 416 and have:  # nothing left to fetch: the partial is complete
            return
        if resp.status_code not in (200, 206):
            raise WeightsError(f"{url} answered HTTP {resp.status_code}: check the URL or token")
        if resp.status_code == 200 and have:
            print("fetch: the server does not resume; starting over", file=sys.stderr)
            have = 0
        length = resp.headers.get("Content-Length")
        total = have + int(length) if length else expected_size
        check_disk(partial.parent, (total or 0) - have)
        progress = Progress(partial.name.removesuffix(".partial"), total, have)
        with partial.open("ab" if have else "wb") as out:
            try:
                # read1 hands over what has arrived, so a broken connection loses nothing written.
                while chunk := resp.raw.read1(CHUNK):
                    out.write(chunk)
                    progress.update(len(chunk))
            except urllib3.exceptions.HTTPError as exc:
                raise requests.ConnectionError(f"connection lost: {exc}") from exc
            finally:
                out.flush()
                os.fsync(out.fileno())
        progress.update(0, final=True)
        if total is not None and partial.stat().st_size != total:
            raise WeightsError(
                f"download of {url} stopped at {partial.stat().st_size} of {total} bytes: "
                "run the same command again to resume"
            )


@contextlib.contextmanager
def hub_errors(what: str):
    """huggingface_hub raises its HTTP client's own errors; the operator gets one line."""
    try:
        yield
    except WeightsError:
        raise
    except Exception as exc:  # noqa: BLE001 - every Hub or transport failure is reported alike
        raise WeightsError(
            f"Hugging Face Hub, {what}: {type(exc).__name__}: {exc}: check the network and "
            "HF_TOKEN, or fetch from an https:// URL or a local path"
        ) from exc


def download_hf(repo: str, filename: str, revision: str | None, partial: Path) -> None:
    """Fetch through huggingface_hub (resumable, cached), then copy into partial."""
    from huggingface_hub import hf_hub_download

    token = os.environ.get("HF_TOKEN")
    with hub_errors(f"downloading {repo}/{filename}"):
        cached = Path(
            hf_hub_download(repo_id=repo, filename=filename, revision=revision, token=token)
        )
    check_disk(partial.parent, cached.stat().st_size)
    shutil.copyfile(cached, partial)


def place(partial: Path, target: Path) -> None:
    os.replace(partial, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest_path(target: Path) -> Path:
    return target.with_name(target.name + ".manifest.json")


def write_manifest(
    target: Path, source: str, sha256: str, summary: dict, seconds: float, pinned: bool = True
) -> dict:
    manifest = {
        "source": source,
        "path": str(target),
        "sha256": sha256,
        "bytes": target.stat().st_size,
        "sha256_pinned": pinned,
        "architecture": summary["architecture"],
        "tensor_types": summary["tensor_types"],
        "backend_checked": summary["backend"],
        "seconds": round(seconds, 1),
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    manifest_file = manifest_path(target)
    tmp = manifest_file.with_name(manifest_file.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    place(tmp, manifest_file)
    return manifest


def fetch(
    source: str,
    target: Path,
    sha256: str | None,
    backend: str = "cuda",
    expected_size: int | None = None,
    revision: str | None = None,
    timeout: float = 60,
) -> dict:
    """Bring source to target; returns the manifest. Raises WeightsError, target untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest_file = manifest_path(target)
    placed_by_hand = target.is_file() and not manifest_file.is_file()
    if placed_by_hand and sha256 and sha256_of(target) == sha256.lower():
        print(f"fetch: {target} is already in place (matches the pin); recording a manifest")
        return write_manifest(target, source, sha256.lower(), verify(target, backend), 0.0)
    if target.is_file() and manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if (
            manifest.get("sha256") == (sha256 or manifest.get("sha256"))
            and manifest.get("bytes") == target.stat().st_size
        ):
            print(f"fetch: {target} is already in place (manifest matches); nothing to do")
            return manifest
    started = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    if source.startswith(("http://", "https://")):
        download_url(source, partial, expected_size, timeout)
    elif source.startswith("hf://"):
        repo, _, filename = source.removeprefix("hf://").rpartition("/")
        if not repo or not filename:
            raise WeightsError(f"{source}: write Hugging Face sources as hf://OWNER/REPO/FILE")
        download_hf(repo, filename, revision, partial)
    else:
        local = Path(source)
        if not local.is_file():
            raise WeightsError(f"{source} is neither a URL, an hf:// source nor a file")
        check_disk(partial.parent, local.stat().st_size)
        shutil.copyfile(local, partial)

    actual = sha256_of(partial)
    if sha256 and actual != sha256.lower():
        partial.unlink()
        raise WeightsError(
            f"checksum mismatch for {source}: expected {sha256}, got {actual}: the download is "
            "corrupt or the pin is wrong; run again to download afresh"
        )
    try:
        summary = verify(partial, backend)
    except WeightsError:
        partial.unlink()
        raise
    place(partial, target)
    write_manifest(target, source, actual, summary, time.monotonic() - started, bool(sha256))
    print(
        f"fetch: {target} in place: sha256 {actual}"
        + ("" if sha256 else " (not pinned: record it to pin this file)")
    )
    return json.loads(manifest_file.read_text())


# --- the catalog: models picked by name ----------------------------------------------------------

# The images carry the catalog elsewhere and say where in TERNARY_SERVE_CATALOG.
CATALOG_FILE = Path(os.environ.get("TERNARY_SERVE_CATALOG", PROJECT_ROOT / "models.yaml"))
# First-fetch pins live beside the models they pin, shared by `make model` and model-init.
LOCK_NAME = "models.lock.json"
ENGINES = ("prismml", "mainline")


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    source: str
    engine: str
    packing: str | None = None
    size_bytes: int | None = None
    sha256: str | None = None


def load_catalog(path: Path = CATALOG_FILE) -> dict[str, CatalogEntry]:
    """models.yaml's entries by name; none where there is no catalog (inside the images)."""
    entries: dict[str, CatalogEntry] = {}
    if not path.is_file():
        return entries
    for name, spec in (yaml.safe_load(path.read_text()) or {}).get("models", {}).items():
        if spec.get("engine") not in ENGINES:
            raise WeightsError(f"{path}: {name}: engine must be one of {', '.join(ENGINES)}")
        size = spec.get("size_gib")
        entries[name] = CatalogEntry(
            name=name,
            source=spec["source"],
            engine=spec["engine"],
            packing=spec.get("packing"),
            size_bytes=int(size * 2**30) if size else None,
            sha256=spec.get("sha256"),
        )
    return entries


def pick_file(files: list[str], packing: str) -> str:
    """The one GGUF in a repo's file list named with packing (PQ2_0 never matches PTQ1_0)."""
    pattern = re.compile(rf"(^|[-_.]){re.escape(packing)}($|[-_.])", re.IGNORECASE)
    matches = [
        f
        for f in files
        if f.endswith(".gguf") and "mmproj" not in f.lower() and pattern.search(Path(f).stem)
    ]
    if len(matches) != 1:
        found = ", ".join(matches) or "none"
        raise WeightsError(
            f"expected one {packing} GGUF in the repo, found {found}: name the file "
            "in models.yaml as hf://OWNER/REPO/FILE"
        )
    return matches[0]


def resolve_source(entry: CatalogEntry, revision: str | None) -> str:
    if entry.packing is None:
        return entry.source
    from huggingface_hub import HfApi

    repo = entry.source.removeprefix("hf://")
    with hub_errors(f"listing {repo}"):
        files = HfApi().list_repo_files(repo, revision=revision, token=os.environ.get("HF_TOKEN"))
    return f"hf://{repo}/{pick_file(files, entry.packing)}"


def check_engine(entry: CatalogEntry, engine_repo: str) -> None:
    if entry.engine == "prismml" and "prismml" not in engine_repo.lower():
        raise WeightsError(
            f"{entry.name} needs the PrismML engine, but the configured engine is "
            f"{engine_repo}: use ENGINE_REPO from versions.env (ENGINE_SOURCE=git)"
        )


def read_lock(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def pin_in_lock(path: Path, name: str, manifest: dict) -> None:
    lock = read_lock(path)
    lock[name] = {
        "source": manifest["source"],
        "sha256": manifest["sha256"],
        "bytes": manifest["bytes"],
        "pinned_at": manifest["fetched_at"],
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
    place(tmp, path)


def configured_engine_repo(env_file: Path) -> str:
    """The engine the stack is configured for: .env if written, else the pinned default."""
    if env_file.is_file():
        for line in env_file.read_text().splitlines():
            if line.startswith("ENGINE_REPO="):
                return line.split("=", 1)[1]
    return load_versions()["ENGINE_REPO"]


def fetch_by_name(
    name: str,
    target: Path,
    backend: str,
    catalog: dict[str, CatalogEntry],
    lock_file: Path,
    engine_repo: str,
    sha256: str | None = None,
    revision: str | None = None,
) -> dict:
    """Fetch a catalog model; a first verified fetch of an unpinned model pins it in the lock."""
    entry = catalog[name]
    check_engine(entry, engine_repo)
    locked = read_lock(lock_file).get(name, {})
    pin = sha256 or entry.sha256 or locked.get("sha256")
    source = locked.get("source") if locked and not entry.sha256 else None
    manifest = fetch(
        source or resolve_source(entry, revision), target, pin, backend, entry.size_bytes, revision
    )
    if not pin:
        pin_in_lock(lock_file, name, manifest)
        print(f"fetch: pinned {name} in {lock_file.name}: sha256 {manifest['sha256']}")
    return manifest


def obtain(source: str, target: Path, args: argparse.Namespace) -> dict:
    """Fetch source (a catalog name or a location) to target, as the command line asked."""
    catalog = load_catalog(args.catalog)
    if source in catalog:
        engine = args.engine_repo or configured_engine_repo(args.env_file)
        lock = args.lock or target.parent / LOCK_NAME
        return fetch_by_name(
            source, target, args.backend, catalog, lock, engine, args.sha256, args.revision
        )
    return fetch(source, target, args.sha256, args.backend, args.size, args.revision)


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--sha256", help="expected SHA-256 (strongly recommended)")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", type=int, help="expected size in bytes, for the disk-space check")
    ap.add_argument("--revision", help="Hugging Face revision (commit) to pin")
    ap.add_argument("--catalog", type=Path, default=CATALOG_FILE)
    ap.add_argument(
        "--lock", type=Path, help=f"first-fetch pins (default: {LOCK_NAME} beside the target)"
    )
    ap.add_argument("--engine-repo", help="the engine the stack runs (default: from --env-file)")
    ap.add_argument(
        "--env-file",
        type=Path,
        default=PROJECT_ROOT / ".env",
        help="the stack's config, for the engine check",
    )
    return ap


def run_reporting(action, source: str) -> int:
    try:
        action()
    except WeightsError as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    except requests.RequestException as exc:
        print(
            f"fetch: {source}: {exc}: the partial download is kept; run again to resume",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = parser("ternary-serve fetch", __doc__.splitlines()[0])
    ap.add_argument(
        "source", help="a models.yaml name, an https:// URL, hf://OWNER/REPO/FILE, or a local path"
    )
    ap.add_argument("target", type=Path, help="where the GGUF goes, e.g. models/model.gguf")
    args = ap.parse_args(argv)
    return run_reporting(lambda: obtain(args.source, args.target, args), args.source)


SERVER_UID = 10001  # the llama-server image's user


def require_server_can_read(path: Path) -> None:
    """model-init runs as root; the server does not, so it needs the world-read bits."""
    if not path.stat().st_mode & stat.S_IROTH or not path.parent.stat().st_mode & stat.S_IXOTH:
        raise WeightsError(
            f"{path} is not readable by uid {SERVER_UID} (the server's user): "
            "chmod a+r the file and a+rx its directory"
        )


def init_main(argv: list[str] | None = None) -> int:
    """Compose's model-init: bring the configured model into place if a source is given (fetch it,
    or convert a checkpoint directory), then verify it."""
    ap = parser("ternary-serve model-init", init_main.__doc__.splitlines()[0])
    ap.add_argument("target", type=Path, help="the model file the server will load")
    ap.add_argument(
        "--source",
        default="",
        help="what to fetch (name, URL, hf://, file) or convert (a checkpoint directory)",
    )
    ap.add_argument("--type", default="Q2_0", help="what a checkpoint source is converted to")
    args = ap.parse_args(argv)
    args.sha256 = args.sha256 or None  # Compose passes unset variables as empty strings

    def init() -> None:
        if args.source and Path(args.source).is_dir():
            from ternary_serve.convert import convert

            convert(Path(args.source), args.target, args.type, args.backend)
        elif args.source:
            obtain(args.source, args.target, args)
        summary = verify(args.target, args.backend)
        require_server_can_read(args.target)
        print(
            f"model-init: {args.target} ready: {summary['architecture']}, "
            f"{', '.join(summary['tensor_types'])}"
        )

    return run_reporting(init, args.source or str(args.target))
