"""Docker down or out of reach: every command an operator runs (what `make releases|deploy|
rollback|rotate-key|images-bundle|bench|config` call) ends in one line that names the fix, never a
traceback. Each runs as the operator runs it, the CLI in a process of its own, against a
DOCKER_HOST that is missing, refuses, or denies permission: the real daemon is never asked."""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from harness import Stack, configure

from ternary_serve.versions import PROJECT_ROOT

START = "sudo systemctl start docker"
# Root passes any file mode: without these capabilities it meets the socket's mode as a user does.
AS_A_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
             "--inh-caps=-dac_override,-dac_read_search"]  # fmt: skip


@pytest.fixture
def stack(tmp_path) -> Stack:
    """A configured stack (no model in place yet, nothing built) with a release history: b live,
    a before it."""
    (tmp_path / "models").mkdir()
    stack = configure(
        tmp_path / "stack", tmp_path / "models" / "absent.gguf", "ts-docker-down",
        ENGINE_SOURCE=None,  # builds nothing: needs no engine source
    )  # fmt: skip
    state = tmp_path / "stack" / "state"
    state.mkdir()
    records = [{"tag": "a", "status": "live"}, {"tag": "b", "status": "live"}]
    (state / "releases.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return stack


def cli(stack: Stack, docker_host: str, *args: str, prefix: tuple[str, ...] = ()):
    """The CLI as the Makefile runs it, with DOCKER_HOST set; its exit code and what it said."""
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "ternary_serve.cli", *args],
        cwd=PROJECT_ROOT,
        env={**os.environ, "DOCKER_HOST": docker_host},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def release(stack: Stack, *args: str) -> list[str]:
    env_file = stack.workdir / ".env"
    return ["release", "--env-file", str(env_file), "--state-dir", str(stack.workdir / "state"),
            *args]  # fmt: skip


def assert_one_line(code: int, said: str, *expected: str) -> str:
    assert code != 0, said
    assert "Traceback" not in said and len(said.splitlines()) == 1, said
    for text in expected:
        assert text in said, said
    return said


COMMANDS = {
    "releases": lambda s, tmp: release(s, "list"),
    "deploy": lambda s, tmp: release(s, "deploy"),
    "deploy TAG": lambda s, tmp: release(s, "deploy", "a"),
    "rollback": lambda s, tmp: release(s, "rollback"),
    "rotate-key": lambda s, tmp: release(s, "rotate-key"),
    "images-bundle": lambda s, tmp: release(s, "bundle", "--out", str(tmp / "bundle.tar")),
    "bench": lambda s, tmp: ["bench", "--env-file", str(s.workdir / ".env"), "--out", str(tmp)],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_with_no_docker_every_command_says_start_it(stack, tmp_path, command):
    missing = f"unix://{tmp_path}/docker.sock"
    key = Path(stack.env["API_KEY_FILE"])
    before = key.read_text(), stack.env_now()
    code, said = cli(stack, missing, *COMMANDS[command](stack, tmp_path))
    assert_one_line(code, said, f"no socket at {missing} (DOCKER_HOST)", START)
    # Nothing changed: not the API key (rotate-key), not the tag in .env (deploy, rollback).
    assert (key.read_text(), stack.env_now()) == before


def test_a_socket_nobody_listens_on_is_docker_not_running(stack, tmp_path):
    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))  # the file stays, with no listener: what a crashed daemon leaves
    code, said = cli(stack, f"unix://{path}", *release(stack, "deploy"))
    assert_one_line(code, said, "Docker is not running: nothing listens at", START)


def test_a_socket_the_user_may_not_open_says_join_the_docker_group(stack, tmp_path):
    prefix: tuple[str, ...] = ()
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("root passes any socket's mode, and setpriv is not here to drop that")
        prefix = tuple(AS_A_USER)
    path = tmp_path / "docker.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        sock.listen()
        path.chmod(0o000)  # as /var/run/docker.sock is to a user outside the docker group
        for args in (release(stack, "list"), release(stack, "deploy")):
            code, said = cli(stack, f"unix://{path}", *args, prefix=prefix)
            assert_one_line(code, said, "permission denied on Docker's socket", "docker group")


def test_config_with_the_port_held_and_no_docker_says_start_it(stack, tmp_path):
    """Only Docker can say whether this stack's own container holds the port."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        code, said = cli(
            stack, f"unix://{tmp_path}/docker.sock", "config",
            "--env-file", str(stack.workdir / ".env"), "--state-dir", str(stack.workdir),
            f"PUBLISH_PORT={port}",
        )  # fmt: skip
    assert_one_line(code, said, f"PUBLISH_PORT={port}: 127.0.0.1:{port} is in use", START)


class OneShotDaemon(socketserver.UnixStreamServer):
    """Answers the SDK as Docker would for `requests` requests (the API version, then each image
    asked for exists), then is gone: a daemon that stops between a deploy's first look and its
    first `docker compose`."""

    def __init__(self, path: Path, requests: int):
        super().__init__(str(path), DaemonRequest)
        self.path = path
        self.thread = threading.Thread(target=self.serve, args=(requests,), daemon=True)
        self.thread.start()

    def serve(self, requests: int) -> None:
        for _ in range(requests):
            self.handle_request()
        self.server_close()
        self.path.unlink()


class DaemonRequest(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = {"ApiVersion": "1.45"} if self.path == "/version" else {"Id": "sha256:" + "0" * 64}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def address_string(self) -> str:
        return "docker.sock"

    def log_message(self, *args) -> None:
        pass


@pytest.mark.skipif(not shutil.which("docker"), reason="needs the docker CLI (not the daemon)")
def test_docker_gone_before_the_model_check_is_not_reported_as_the_models_fault(stack, tmp_path):
    """The deploy finds the images, then `docker compose run model-init` cannot reach the daemon:
    the line says Docker's fix, and the history records no refusal of the model."""
    path = tmp_path / "docker.sock"
    daemon = OneShotDaemon(path, requests=5)  # the API version and the release's four images
    code, said = cli(stack, f"unix://{path}", *release(stack, "deploy", "c"))
    daemon.thread.join(timeout=10)
    assert not daemon.thread.is_alive(), "the deploy did not look for its images first"
    assert_one_line(code, said, "Docker is not running: no socket at", START)
    history = (stack.workdir / "state" / "releases.jsonl").read_text()
    assert "refused" not in history and '"c"' not in history, history
