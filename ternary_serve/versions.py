"""Reads versions.env, the project's one file of pins."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VERSIONS_FILE = PROJECT_ROOT / "versions.env"


def load_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse KEY=value lines; comments and blank lines are skipped."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{path}:{number}: expected KEY=value, got {raw!r}")
        pins[key] = value
    return pins
