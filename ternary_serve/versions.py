"""Reads versions.env, the project's one file of pins."""

from __future__ import annotations

from pathlib import Path

from ternary_serve import envfile

PROJECT_ROOT = Path(__file__).resolve().parent.parent
VERSIONS_FILE = PROJECT_ROOT / "versions.env"
# Written by `ternary-serve config`: the stack as configured on this host.
ENV_FILE = PROJECT_ROOT / ".env"


def load_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    return envfile.read(path)


def configured_engine_repo(env_file: Path = ENV_FILE) -> str:
    """The engine the stack is configured for: .env's if written, else the pinned default."""
    configured = envfile.read(env_file) if env_file.is_file() else {}
    return configured.get("ENGINE_REPO") or load_versions()["ENGINE_REPO"]
