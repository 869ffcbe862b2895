"""The smoke client fails on servers that answer garbage.

The servers here are deliberately broken stand-ins on loopback; the passing case against the real
llama-server is in test_stack.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import standin_server

from ternary_serve import smoke, weights
from ternary_serve.catalog import load_catalog
from ternary_serve.weights import SYNTHETIC_MARKER

# gguf-py's own metadata editor, installed with it in the venv.
GGUF_NEW_METADATA = str(Path(sys.executable).with_name("gguf-new-metadata"))

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


# --- the quality gate --------------------------------------------------------------------------


@pytest.fixture
def standin():
    started = []

    def start(mode: str) -> str:
        server = standin_server.serve(mode)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in started:
        server.shutdown()


CHAT_GATE = load_catalog().quality_gates["chat"]


def test_gate_passes_a_model_that_answers_right(standin):
    report = smoke.run(standin("right"), 8, False, 5, (CHAT_GATE, "test"))
    assert [a["name"] for a in report["quality"]["answers"]] == [q.name for q in CHAT_GATE]
    assert "quality[capital-zh]: ok" in smoke.format_report(report)


@pytest.mark.parametrize("mode", ["wrong", "gibberish"])
def test_gate_fails_fluent_wrong_answers_and_gibberish(standin, mode):
    """Both stream tokens perfectly well: only the answers tell them apart from a working model."""
    url = standin(mode)
    smoke.run(url, 8, False, 5)  # the stream checks alone pass
    with pytest.raises(smoke.SmokeFailure, match="quality\\[capital-en\\]: expected 'Paris'"):
        smoke.run(url, 8, False, 5, (CHAT_GATE, "test"))


def test_gate_is_chosen_from_the_model(tiny_model, tmp_path):
    catalog = load_catalog()
    questions, why = smoke.choose_gate("auto", tiny_model, catalog)
    assert questions == () and "synthetic model" in why

    unmarked = tmp_path / "unmarked.gguf"
    subprocess.run(
        [GGUF_NEW_METADATA, "--force", "--remove-metadata", SYNTHETIC_MARKER, tiny_model, unmarked],
        check=True,
        capture_output=True,
    )
    assert smoke.choose_gate("auto", unmarked, catalog) == (CHAT_GATE, "default (chat)")
    manifest = weights.manifest_path(unmarked)
    manifest.write_text(json.dumps({"catalog_name": "bonsai-2-27b-pq2_0"}))
    assert (
        smoke.choose_gate("auto", unmarked, catalog)[1] == "catalog entry bonsai-2-27b-pq2_0 (chat)"
    )
    assert smoke.choose_gate("none", unmarked, catalog) == ((), "QUALITY_GATE=none")
    with pytest.raises(smoke.SmokeFailure, match="quality gate 'strict' is not defined"):
        smoke.choose_gate("strict", unmarked, catalog)


def test_cli_says_when_the_gate_is_skipped(standin, tiny_model, capsys):
    assert smoke.main(["--url", standin("gibberish"), "--model", str(tiny_model)]) == 0
    assert "quality: skipped: synthetic model" in capsys.readouterr().out
