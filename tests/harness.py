"""Helpers for tests that run the real stack: a Compose project per test, configured by
`ternary-serve config` into its own directory, on images built once per session."""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import requests

from ternary_serve import client, config, envfile
from ternary_serve.versions import PROJECT_ROOT

STAND_IN_IMAGE = "local/debian:bookworm-test"
BUILD_TIMEOUT = 3600
# The checkout's commit as the session starts: every stack of the session runs the images built for
# it, though the suite itself writes files into the checkout (docs/chaos.md).
SESSION_REVISION = config.project_revision()


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
        return client.published_url(self.env)

    def api(self) -> requests.Session:
        """An HTTP session as the API's clients have one: the key, the gateway's certificate."""
        return client.Endpoint.of(self.env).session()

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

    def env_now(self) -> dict[str, str]:
        """.env as it is now (a deploy rewrites the planned limits)."""
        return envfile.read(self.workdir / ".env")

    def release(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """`ternary-serve release ...` on this stack, as `make deploy` runs it."""
        return subprocess.run(
            [sys.executable, "-m", "ternary_serve.cli", "release", "--env-file",
             str(self.workdir / ".env"), "--state-dir", str(self.workdir), *args],
            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def container(self, service: str) -> str:
        """The running container of a service (its id)."""
        ids = self.compose("ps", "-q", service).stdout.split()
        assert ids, f"no {service} container in {self.name}"
        return ids[0]

    def status_for_declared_body(self, length: int, path: str = "/v1/chat/completions") -> int:
        """The gateway's answer to a POST whose headers declare a body of `length` bytes, read
        before any of the body is sent (HTTP libraries that are still sending when the answer
        comes report a broken connection instead of the status)."""
        context = ssl.create_default_context(cafile=self.env["GATEWAY_TLS_FILE"])
        port = int(self.env["PUBLISH_PORT"])
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=30), server_hostname="localhost"
        ) as conn:
            conn.sendall(
                f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n".encode()
            )
            return int(conn.recv(4096).split(b" ", 2)[1])

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


def remove_replaced_images(project: str) -> None:
    """Images a rebuild of this Compose project left without a tag (`make build` does the same)."""
    label = f"label=com.docker.compose.project={project}"
    subprocess.run(
        ["docker", "image", "prune", "-f", "--filter", label], capture_output=True, check=True
    )


@contextlib.contextmanager
def deployed(workdir: Path, model: Path, name: str, **settings: str):
    """A stack configured with these settings and deployed by the release CLI; torn down after."""
    stack = configure(workdir, model, name, **settings)
    done = stack.release("deploy")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    try:
        yield stack
    finally:
        stack.down()


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
        "GATEWAY_BASE_IMAGE": STAND_IN_IMAGE,
        "REVISION": SESSION_REVISION,
    }
    env, _ = config.configure({**defaults, **settings}, workdir / ".env", workdir, replace=True)
    return Stack(workdir, name, env)
