"""Helpers for tests that run the real stack: a Compose project per test, configured by
`ternary-serve config` into its own directory, on images built once per session."""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ternary_serve import config
from ternary_serve.versions import PROJECT_ROOT

STAND_IN_IMAGE = "local/debian:bookworm-test"
BUILD_TIMEOUT = 3600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Stack:
    """One Compose project, configured by `ternary-serve config` into its own directory."""

    workdir: Path
    name: str
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['PUBLISH_PORT']}"

    def compose_cmd(self, *args: str) -> list[str]:
        return [
            "docker",
            "compose",
            "--env-file",
            str(self.workdir / ".env"),
            "-p",
            self.name,
            *args,
        ]

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.compose_cmd(*args),
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", timeout=120)


def readable_by_containers(model: Path) -> None:
    """pytest's temp dirs are private (0700); the containers run as uid 10001."""
    for directory in (model.parent, *model.parent.parents):
        if directory == Path(directory.anchor) or directory.stat().st_mode & 0o005 == 0o005:
            continue
        directory.chmod(directory.stat().st_mode | 0o005)
    if model.exists():
        model.chmod(0o644)


def configure(workdir: Path, model: Path, name: str, **settings: str) -> Stack:
    """`ternary-serve config` with the test defaults below, over any settings given by name."""
    workdir.mkdir(parents=True, exist_ok=True)
    readable_by_containers(model)
    defaults = {
        "BACKEND": "cpu",
        "ENGINE_SOURCE": "local",
        "PROJECT_NAME": name,
        "MODEL_DIR": str(model.parent),
        "MODEL_FILE": model.name,
        "PUBLISH_PORT": str(free_port()),
        "BUILD_BASE_IMAGE": STAND_IN_IMAGE,
        "RUNTIME_BASE_IMAGE": STAND_IN_IMAGE,
        "SMOKE_BASE_IMAGE": STAND_IN_IMAGE,
    }
    env, _ = config.configure({**defaults, **settings}, workdir / ".env", workdir, replace=True)
    return Stack(workdir, name, env)
