"""Stand-in for llama-server serving a real chat model: the OpenAI-compatible routes the smoke test
uses (/health, /v1/models, /v1/chat/completions streamed and not), the 1-token /v1/completions and
the /metrics the liveness probe (ternary_serve/liveness.py) reads, answering from a fixed table.

It exists because no real model that can answer questions runs here (Bonsai 2 needs a GPU and the
PrismML engine). `right` answers the quality gate's questions as a working model would; `wrong`
answers them fluently and wrongly; `gibberish` streams well-formed nonsense, as mainline llama.cpp
does on Bonsai 2's fork-packed file. Everything about a real model's answers stays unproven here.

It also stands in for a server whose GPU is gone while /health still says ok, since no GPU can be
lost here: `hang` takes every completion and never answers it (a decode stuck on a dead device:
the request stays in flight in /metrics, the llama_decode() counter stops); `fail` answers every
completion as llama-server does when llama_decode() fails (HTTP 500 "Compute error."). Both answer
/health 200 and /metrics throughout, as llama-server's HTTP threads do.

Usage: python3 standin_server.py right|wrong|gibberish|hang|fail [PORT]
       (PORT default: $LLAMA_ARG_PORT; the decode rate its timings report:
       $STANDIN_DECODE_PER_SECOND, default 200)
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWERS = {
    "right": {"France": "Paris.", "中国": "北京", "12 + 30": "42"},
    "wrong": {"France": "The capital of France is Lyon.", "中国": "上海", "12 + 30": "41"},
    "gibberish": {},
}
# llama-server's answer when llama_decode() fails (tools/server/server-context.cpp, update_slots).
COMPUTE_ERROR = {"error": {"code": 500, "message": "Compute error.", "type": "server_error"}}
GIBBERISH = "ilion verschill ((__ 的的 Parade cholesterol,,, Turbo"
SMALL_TALK = "Hello! I am a stand-in model answering from a table."


def answer(mode: str, prompt: str) -> str:
    if mode == "gibberish":
        return GIBBERISH
    for key, text in ANSWERS[mode].items():
        if key in prompt:
            return text
    return SMALL_TALK


class Handler(BaseHTTPRequestHandler):
    mode = "right"
    lock = threading.Lock()
    counters = {"in_flight": 0, "n_decode": 0, "predicted": 0}

    def count(self, **changes: int) -> None:
        with self.lock:
            for name, change in changes.items():
                self.counters[name] += change

    def metrics(self) -> str:
        with self.lock:
            c = dict(self.counters)
        return (
            f"llamacpp:tokens_predicted_total {c['predicted']}\n"
            f"llamacpp:n_decode_total {c['n_decode']}\n"
            f"llamacpp:requests_processing {c['in_flight']}\n"
            "llamacpp:requests_deferred 0\n"
        )

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.send_json(200, {"status": "ok"})
        elif self.path == "/v1/models":
            self.send_json(200, {"object": "list", "data": [{"id": f"standin-{self.mode}"}]})
        elif self.path == "/metrics":
            data = self.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_json(404, {"error": "no such route"})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self.send_json(404, {"error": "no such route"})
            return
        if self.mode == "hang":
            self.count(in_flight=1)  # never answered, never leaves: the loop is stuck
            while True:
                time.sleep(60)
        if self.mode == "fail":
            self.send_json(500, COMPUTE_ERROR)
            return
        self.count(n_decode=2, predicted=1)
        if self.path == "/v1/completions":
            self.send_json(
                200,
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                },
            )
            return
        text = answer(self.mode, request["messages"][-1]["content"])
        pieces = text.split(" ")
        pieces = [p + " " for p in pieces[:-1]] + pieces[-1:]
        usage = {"prompt_tokens": 8, "completion_tokens": len(pieces), "total_tokens": 8}
        if not request.get("stream"):
            self.send_json(
                200,
                {
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                },
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, piece in enumerate(pieces):
            finish = "stop" if i == len(pieces) - 1 else None
            delta = {
                "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]
            }
            self.wfile.write(f"data: {json.dumps(delta, ensure_ascii=False)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.005)
        rate = float(os.environ.get("STANDIN_DECODE_PER_SECOND", "200"))
        final = {"choices": [], "usage": usage, "timings": {"predicted_per_second": rate}}
        self.wfile.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args):
        pass


def serve(mode: str, port: int = 0, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """A server in this mode; `hang` requests are never answered, so its close does not wait for
    its request threads."""
    counters = {"in_flight": 0, "n_decode": 0, "predicted": 0}
    handler = type("ModeHandler", (Handler,), {"mode": mode, "counters": counters})
    server = ThreadingHTTPServer((host, port), handler)
    server.block_on_close = False
    return server


if __name__ == "__main__":
    port = int(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("LLAMA_ARG_PORT", "8080"))
    serve(sys.argv[1], port, "0.0.0.0").serve_forever()
