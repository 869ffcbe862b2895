"""The smoke client fails on servers that answer garbage.

The servers here are deliberately broken stand-ins on loopback; the passing case against the real
llama-server is in test_stack.py.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ternary_serve import smoke

GOOD_HEALTH = (200, "application/json", b'{"status":"ok"}')
GOOD_MODELS = (200, "application/json", b'{"object":"list","data":[{"id":"tiny"}]}')


def sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def token(text: str, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}


GOOD_CHAT = (200, "text/event-stream", sse(token("Hi"), token(" there", "stop")))


def serve(routes: dict[str, tuple[int, str, bytes]]):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self):
            status, ctype, body = routes.get(self.path, (404, "text/plain", b"no route"))
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._reply()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._reply()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def server_with():
    started = []

    def start(**overrides):
        routes = {
            "/health": GOOD_HEALTH,
            "/v1/models": GOOD_MODELS,
            "/v1/chat/completions": GOOD_CHAT,
        }
        routes.update({f"/{k.replace('__', '/')}": v for k, v in overrides.items()})
        server = serve(routes)
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()


def test_well_formed_server_passes(server_with):
    report = smoke.run(server_with(), max_tokens=8, ignore_eos=False, timeout=5)
    assert [t["prompt"] for t in report["round_trips"]] == list(smoke.PROMPTS)
    assert all(t["completion_tokens"] == 2 for t in report["round_trips"])


@pytest.mark.parametrize(
    "route, reply, message",
    [
        ("health", (503, "application/json", b'{"error":"loading"}'), "server is not ready"),
        ("health", (200, "text/html", b"<html>ok</html>"), "not JSON"),
        ("v1__models", (200, "application/json", b'{"data": []}'), "no models listed"),
        ("v1__chat__completions", (500, "text/plain", b"boom"), "HTTP 500"),
        ("v1__chat__completions", (200, "text/event-stream", b"hello world\n"), "'data:' lines"),
        ("v1__chat__completions", (200, "text/event-stream", b"data: {not json\n\n"), "not JSON"),
        (
            "v1__chat__completions",
            (200, "text/event-stream", sse(token("a"), done=False)),
            "without \\[DONE\\]",
        ),
        (
            "v1__chat__completions",
            (200, "text/event-stream", sse({"object": "chunk"})),
            "without choices",
        ),
        ("v1__chat__completions", (200, "text/event-stream", sse(token("", "stop"))), "no tokens"),
        (
            "v1__chat__completions",
            (200, "text/event-stream", sse(token("x", "error"))),
            "finish_reason",
        ),
    ],
)
def test_garbage_answers_fail_with_a_named_check(server_with, route, reply, message):
    url = server_with(**{route: reply})
    with pytest.raises(smoke.SmokeFailure, match=message):
        smoke.run(url, max_tokens=8, ignore_eos=False, timeout=5)


def test_unreachable_server_fails_and_cli_exits_1(capsys):
    assert smoke.main(["--url", "http://127.0.0.1:9", "--timeout", "2"]) == 1
    assert "cannot reach" in capsys.readouterr().err
