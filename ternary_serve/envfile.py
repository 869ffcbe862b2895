"""KEY=value files: the one reader and writer for versions.env, settings.env, .env and the server's
env file.

Plain lines only: no quotes, no `export`, no expansion (Compose, Make and Ansible read the same
files, and those are the lines all of them agree on). Comments and blank lines are skipped.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def parse(text: str, source: str = "<text>") -> dict[str, str]:
    pairs: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{source}:{number}: expected KEY=value, got {raw!r}")
        pairs[key] = value
    return pairs


def read(path: Path) -> dict[str, str]:
    return parse(path.read_text(), str(path))


def render(pairs: dict[str, str], header: str = "") -> str:
    for key, value in pairs.items():
        if not key.isidentifier() or "\n" in str(value):
            raise ValueError(f"cannot write {key}={value!r} as one KEY=value line")
    return header + "".join(f"{key}={value}\n" for key, value in pairs.items())


def write_atomic(path: Path, text: str, mode: int = 0o600, group: int | None = None) -> bool:
    """Replace path with text in one rename, with this mode (and group); returns False (and
    leaves it alone) if unchanged."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        if group is not None:
            os.fchown(fd, -1, group)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def write(path: Path, pairs: dict[str, str], header: str = "") -> bool:
    return write_atomic(path, render(pairs, header))
