"""Reads versions.env, the project's one file of pins."""

from __future__ import annotations

from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VERSIONS_FILE = PROJECT_ROOT / "versions.env"
# Written by `ternary-serve config`: the stack as configured on this host.
ENV_FILE = PROJECT_ROOT / ".env"


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


def configured_engine_repo(env_file: Path = ENV_FILE) -> str:
    """The engine the stack is configured for: .env's if written, else the pinned default."""
    configured = load_versions(env_file) if env_file.is_file() else {}
    return configured.get("ENGINE_REPO") or load_versions()["ENGINE_REPO"]
