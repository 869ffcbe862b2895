"""Liveness probe for llama-server: the server image's HEALTHCHECK (docker/Dockerfile).

llama-server's /health says ok as long as its HTTP threads run and the model is loaded, also when
the GPU underneath is gone (after `systemctl daemon-reload` a container can lose its device access:
"Failed to initialize NVML: Unknown Error") and every request fails or hangs. This probe checks
that the server still decodes. Standard library only: the server image has no pip packages; it is
copied into it as this one file and run with the image's python3 (3.10 on Ubuntu 22.04).

One check, each step bounded by its own deadline and all of them by BUDGET_S:
1. GPU device nodes (/dev/nvidiactl, /dev/nvidia<N>), where the container has them, must open:
   a container that lost its device access gets EPERM here, as CUDA and NVML do.
2. GET /health. No answer in time: a strike. 503 (loading) or nothing listening: unhealthy, not a
   strike (not a hang), as before. 200: on to decode.
3. GET /metrics (with the API key; the server answers it from its main loop). No answer in time
   while /health answers: a strike (the loop is stuck).
4. Requests in flight (requests_processing + requests_deferred > 0): the llama_decode() counter
   (n_decode_total, which advances for prompt batches and generated tokens alike, per call, while
   tokens_predicted_total only moves when a request ends) must have moved within STALL_S, else
   a strike; a check sooner than that after its last move is healthy and leaves the count as it
   is. No completion is sent then: it would queue behind busy slots.
5. Idle: a 1-token completion (POST /v1/completions) must answer 200 within COMPLETION_TIMEOUT_S.
   An error (5xx, e.g. llama.cpp's "Compute error.") or no answer is a strike, unless /metrics,
   read again, shows the probe queued behind requests that arrived meanwhile while the decode
   counter advanced (then the server is decoding). A 4xx (the probe's request or key refused) is
   unhealthy but not a strike, and so is no answer where /metrics is off (a hang cannot be told
   from a full server then; the template turns it on).

STRIKES_TO_KILL strikes in a row: the probe kills the server (`kill -KILL -1`: every process of the
container but PID 1, tini, which then exits), so the container exits and its restart policy starts
it again (restart policies act on exits only, not on health). Any check that is not a strike
resets the count. The state between checks lives in /tmp (a tmpfs: the root is read-only).

Exit 0 healthy, 1 unhealthy, with one line on stdout saying why (`docker inspect` keeps the last
five); the kill's line also goes to the server's log (`make logs`).
"""

from __future__ import annotations

import errno
import glob
import http.client
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field

HOST = "127.0.0.1"
STATE_FILE = "/tmp/ternary-serve-liveness.json"
# The HEALTHCHECK's --timeout is 10 s (Compose: `timeout: 10s`): all steps fit in BUDGET_S.
BUDGET_S = 9.0
HEALTH_TIMEOUT_S = 3.0
METRICS_TIMEOUT_S = 3.0
# A 1-token completion of a one-word prompt: 0.01-0.3 s on the 2-core CI machine's CPU with the
# tiny test model, a few tokens of prompt and one of output on the GPU.
COMPLETION_TIMEOUT_S = 5.0
# Requests in flight and no llama_decode() call for this long: decode has stopped. One decode call
# is one batch (BATCH tokens of prompt at most, or one token per busy slot), far less than this on
# the GPU. Under the 10 s interval consecutive checks are always further apart than this.
STALL_S = 8.0
STRIKES_TO_KILL = 3
NVIDIA_DEVICES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*")
PROBE_BODY = {"prompt": "ok", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
METRIC = re.compile(r"^llamacpp:(\w+)\s+(\S+)\s*$", re.MULTILINE)


@dataclass
class Reply:
    """An HTTP answer, or why there was none: status None and `error`; `timed_out` when the
    server took the connection (or not) and did not answer in time."""

    status: int | None
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    error: str = ""
    timed_out: bool = False

    def message(self) -> str:
        """The server's own error message (llama.cpp: {"error": {"message": ...}}), short."""
        try:
            error = json.loads(self.body).get("error")
            text = error.get("message") if isinstance(error, dict) else error
        except (ValueError, AttributeError):
            text = self.body.decode(errors="replace")
        return " ".join(str(text or "").split())[:160]


@dataclass
class Verdict:
    healthy: bool
    reason: str
    strike: bool = False  # counts toward the kill
    judged: bool = True  # False: neither a strike nor a reset (busy, stall window not yet over)


class Server:
    """llama-server on loopback, every request bounded by the check's deadline."""

    def __init__(self, port: int, key: str | None, deadline: float):
        self.port, self.key, self.deadline = port, key, deadline

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def request(self, method: str, path: str, timeout: float, body: dict | None = None) -> Reply:
        timeout = min(timeout, self.left())
        if timeout <= 0.2:
            return Reply(None, error="no time left in the check", timed_out=True)
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.key and path != "/health":
            headers["Authorization"] = f"Bearer {self.key}"
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, json.dumps(body) if body is not None else None, headers)
            resp = conn.getresponse()
            return Reply(resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()})
        except TimeoutError:
            return Reply(None, error=f"no answer in {timeout:.0f} s", timed_out=True)
        except ConnectionRefusedError:
            return Reply(None, error=f"nothing listens on port {self.port}")
        except (OSError, http.client.HTTPException) as exc:
            return Reply(None, error=f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()


def lost_devices(patterns=NVIDIA_DEVICES) -> str | None:
    """The first NVIDIA device node present that cannot be opened, and why (None: all open)."""
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    continue
                return f"{path}: {exc.strerror}"
    return None


def parse_metrics(text: str) -> dict[str, float]:
    return {name: float(value) for name, value in METRIC.findall(text)}


def read_metrics(server: Server) -> tuple[dict[str, float] | None, Reply]:
    reply = server.request("GET", "/metrics", METRICS_TIMEOUT_S)
    if reply.status != 200:
        return None, reply
    values = parse_metrics(reply.body.decode(errors="replace"))
    return (values if "n_decode_total" in values else None), reply


def in_flight(metrics: dict[str, float]) -> int:
    return int(metrics.get("requests_processing", 0) + metrics.get("requests_deferred", 0))


def check(server: Server, state: dict, now: float, devices=NVIDIA_DEVICES) -> Verdict:
    """One liveness check. `state` (from the previous check) is updated in place."""
    lost = lost_devices(devices)
    if lost:
        return Verdict(
            False,
            f"GPU lost: {lost} (the container's device access is gone, as after `systemctl "
            "daemon-reload`; a new container gets it back)",
            strike=True,
        )
    health = server.request("GET", "/health", HEALTH_TIMEOUT_S)
    if health.status is None:
        return Verdict(False, f"GET /health: {health.error}", strike=health.timed_out)
    if health.status != 200:
        return Verdict(False, f"GET /health: HTTP {health.status} {health.message()}")

    metrics, reply = read_metrics(server)
    if reply.timed_out:
        return Verdict(
            False,
            f"decode stalled: GET /metrics (answered by the server's main loop) got {reply.error} "
            "while /health answers",
            strike=True,
        )
    if metrics is not None:
        started = reply.headers.get("process-start-time-unix", "")
        decodes = metrics["n_decode_total"]
        if decodes != state.get("n_decode") or started != state.get("started"):
            state.update(n_decode=decodes, started=started, progress_at=now)
        busy = in_flight(metrics)
        if busy:
            quiet = now - state["progress_at"]
            if quiet < STALL_S:
                advancing = (
                    "decode advancing" if quiet == 0 else f"no decode call for {quiet:.0f} s"
                )
                return Verdict(True, f"busy ({busy} in flight), {advancing}", judged=quiet == 0)
            return Verdict(
                False,
                f"decode stalled: {busy} in flight and no llama_decode() call for {quiet:.0f} s",
                strike=True,
            )

    started_at = time.monotonic()
    probe = server.request("POST", "/v1/completions", COMPLETION_TIMEOUT_S, PROBE_BODY)
    took = time.monotonic() - started_at
    if probe.status == 200:
        try:
            json.loads(probe.body)["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            return Verdict(
                False,
                f"decode failed: a 1-token completion answered 200 without a choice: "
                f"{probe.body[:120]!r}",
                strike=True,
            )
        return Verdict(True, f"idle, a 1-token completion answered in {took:.2f} s")
    if probe.status is not None and 400 <= probe.status < 500:
        return Verdict(
            False,
            f"decode not checked: the probe's completion was refused: HTTP {probe.status} "
            f"{probe.message()}",
        )
    if probe.status is not None:
        return Verdict(
            False,
            f'decode failed: a 1-token completion: HTTP {probe.status} "{probe.message()}"',
            strike=True,
        )
    # No answer: queued behind requests that came meanwhile (decode moves), or decode stopped.
    if metrics is None:
        return Verdict(
            False,
            f"a 1-token completion got {probe.error}; without /metrics a hang cannot be told "
            "from a full server",
        )
    again, _ = read_metrics(server)
    if again and in_flight(again) and again["n_decode_total"] != metrics["n_decode_total"]:
        return Verdict(
            True,
            f"the probe queued behind requests that came meanwhile ({in_flight(again)} in "
            "flight); decode advancing",
        )
    return Verdict(
        False,
        f"decode stalled: a 1-token completion got {probe.error} on an idle server",
        strike=True,
    )


def api_key() -> str | None:
    """The key llama-server was given (its first one), from the same file or variable."""
    path = os.environ.get("LLAMA_ARG_API_KEY_FILE")
    if path:
        try:
            with open(path) as fh:
                for line in fh:
                    if line.strip() and not line.startswith("#"):
                        return line.strip()
        except OSError:
            return None
    keys = os.environ.get("LLAMA_ARG_API_KEY", "")
    return keys.split(",")[0].strip() or None


def load_state(path: str) -> dict:
    try:
        with open(path) as fh:
            state = json.load(fh)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def save_state(path: str, state: dict) -> None:
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(state, fh)
    os.replace(tmp, path)


def kill_server(reason: str) -> None:
    """Every process of the container but PID 1 (tini) and this one: the server exits, so does
    tini, so does the container; its restart policy starts it again."""
    try:  # the server's log (tini's stderr), where `docker logs` shows why it restarted
        fd = os.open("/proc/1/fd/2", os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, f"liveness: {reason}\n".encode())
        finally:
            os.close(fd)
    except OSError:
        pass
    os.kill(-1, signal.SIGKILL)


def main(state_file: str = STATE_FILE) -> int:
    def overran(*_):
        print(f"unhealthy: the check overran its {BUDGET_S:.0f} s budget", flush=True)
        os._exit(1)

    signal.signal(signal.SIGALRM, overran)
    signal.setitimer(signal.ITIMER_REAL, BUDGET_S + 0.5)
    now = time.time()
    # The rendered llama-server.env sets it; unset, llama-server listens on its own default.
    port = int(os.environ.get("LLAMA_ARG_PORT", "8080"))
    state = load_state(state_file)
    server = Server(port, api_key(), time.monotonic() + BUDGET_S)
    verdict = check(server, state, now)
    strikes = int(state.get("strikes", 0))
    if verdict.strike:
        strikes += 1
    elif verdict.judged:
        strikes = 0
    state["strikes"] = strikes
    if verdict.healthy:
        line = f"ok: {verdict.reason}"
    elif verdict.strike:
        line = f"unhealthy (failed check {strikes} of {STRIKES_TO_KILL}): {verdict.reason}"
    else:
        line = f"unhealthy: {verdict.reason}"
    kill = strikes >= STRIKES_TO_KILL
    if kill:
        line += "; killing llama-server for a restart"
        state = {}  # a /tmp that outlives the container (no tmpfs) starts the new server afresh
    try:
        save_state(state_file, state)
    except OSError as exc:
        line += f" (state not kept: {exc.strerror}; strikes are not counted)"
    signal.setitimer(signal.ITIMER_REAL, 0)
    print(line, flush=True)
    if kill:
        kill_server(line)
    return 0 if verdict.healthy else 1


if __name__ == "__main__":
    sys.exit(main())
