"""Files written whole or not at all: a crash or a full disk mid-write leaves the old file, never
a cut one (a temporary file beside it, fsynced, then renamed over it)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


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
        place(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def write_json(path: Path, data, mode: int = 0o644, **dumps) -> bool:
    """data as indented JSON at path, atomically (json.dumps options: sort_keys, ensure_ascii)."""
    return write_atomic(path, json.dumps(data, indent=2, **dumps) + "\n", mode)


def place(partial: Path, target: Path) -> None:
    """Rename into place and make the rename durable (the directory's entry fsynced too)."""
    os.replace(partial, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
