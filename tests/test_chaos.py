"""Chaos and load through the gateway: what breaks, whether the stack comes back without an
operator, and how long that takes. Each scenario records its figures; the module writes them to
docs/chaos.md and docs/results/chaos.json (scenario, requests, failures, recovery, data lost).

The real stack (CPU variant, tiny synthetic model, GATEWAY=on) on the real dockerd; all traffic on
loopback and the project's own network, every loop bounded in count and time. Stand-ins: the base
images, and a CPU where the GPU would be: a GPU that stops answering is stood in for by a stopped
(SIGSTOP) server, which the healthcheck sees the same way (no answer to /health).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import harness
import openai
import pytest
from harness import deployed, readable_by_containers

from ternary_serve import bench, probe, synthetic
from ternary_serve.client import Endpoint
from ternary_serve.fetch import main as fetch_main
from ternary_serve.versions import PROJECT_ROOT

pytestmark = pytest.mark.docker

FIGURES: list[dict] = []
# A hung server is killed after 3 unanswered health checks 10 s apart (docker/Dockerfile), then
# restarted and loaded again: the bound this suite holds the stack to.
HUNG_BOUND_S = 90
RECOVERY_BOUND_S = 60
SMALL_DISK_MIB = 2100


def record(scenario: str, requests_made: int, failures: int, recovery_s, data_lost: str, **more):
    FIGURES.append(
        {
            "scenario": scenario,
            "requests": requests_made,
            "failures": failures,
            "recovery_s": None if recovery_s is None else round(recovery_s, 1),
            "data_lost": data_lost,
            **more,
        }
    )


@pytest.fixture(scope="module")
def models_on_a_small_disk(tmp_path_factory):
    """MODEL_DIR on its own filesystem, so that a fetch can fill it: a tmpfs just over the fetch's
    2 GiB free-space margin (RAM is used only for what is written, and freed after)."""
    directory = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(  # fmt: skip
        [
            "mount",
            "-t",
            "tmpfs",
            "-o",
            f"size={SMALL_DISK_MIB}m,mode=0755",
            "tmpfs",
            str(directory),
        ],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs for the disk-full scenario: {mounted.stderr}")
    model = synthetic.write_model(directory / "tiny-ternary.gguf", "tiny", seed=0)
    readable_by_containers(model)
    yield model
    subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@pytest.fixture(scope="module")
def stack(built, models_on_a_small_disk, tmp_path_factory):
    with deployed(
        tmp_path_factory.mktemp("chaos"),
        models_on_a_small_disk,
        "ts-chaos",
        GATEWAY="on",
        # The per-client limits are test_endpoint's; here all 32 clients share one address.
        CLIENT_RATE="100000",
        CLIENT_CONNECTIONS="1000",
        # The bounded queue is test_serving's; here 28 of the 32 clients wait for a slot.
        QUEUE_LENGTH="64",
        QUEUE_WAIT_S="120",
        SLOTS="4",
        # Per slot: long enough that a stream of nearly all of it outlasts a kill at its start.
        CONTEXT="2048",
    ) as stack:
        yield stack
    write_figures()


def write_figures() -> None:
    if not FIGURES:
        return
    rows = [
        {
            "scenario": f["scenario"],
            "requests": f["requests"],
            "failures": f["failures"],
            "recovery": "-" if f["recovery_s"] is None else f"{f['recovery_s']} s",
            "data lost": f["data_lost"],
        }
        for f in FIGURES
    ]
    harness.write_figures(
        "chaos",
        "Chaos and load: figures",
        "Written by `tests/test_chaos.py` (part of `make test`) on the CPU stack with the tiny\n"
        "synthetic model, traffic through the gateway (HAProxy, TLS, API key). Recovery is the\n"
        "time from the fault (for dockerd: from the first failed request) to the first successful\n"
        "chat completion through the gateway, with no operator action. What each scenario does\n"
        "and what it holds the stack to is in the test.",
        ["scenario", "requests", "failures", "recovery", "data lost"],
        rows,
        FIGURES,
    )


def client(stack, **options) -> openai.OpenAI:
    return Endpoint.of(stack.env_now()).openai(max_retries=0, **options)


def stream(api: openai.OpenAI, tokens: int = 8) -> dict:
    """One streamed chat completion: its finish reason and token count."""
    finish, usage = None, None
    for chunk in api.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Count to ten."}],
        max_tokens=tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
        usage = chunk.usage or usage
    if finish is None or usage is None:
        raise RuntimeError("the stream ended without a finish reason and usage")
    return {"finish": finish, "tokens": usage.completion_tokens}


def answers(stack) -> bool:
    try:
        stream(client(stack, timeout=10), tokens=2)
        return True
    except (openai.OpenAIError, RuntimeError):
        return False


def wait_answering(stack, since: float, bound: float) -> float:
    """Seconds from `since` until a chat completion through the gateway succeeds again."""
    while time.monotonic() - since < bound:
        if answers(stack):
            return time.monotonic() - since
        time.sleep(0.5)
    pytest.fail(f"the stack did not answer again within {bound} s, without an operator")


def server_pid(stack) -> int:
    """llama-server's process id on this host (under tini in its container)."""
    top = subprocess.run(
        ["docker", "top", stack.container("llama-server"), "-eo", "pid,comm"],
        capture_output=True,
        text=True,
    ).stdout
    pids = [int(line.split()[0]) for line in top.splitlines()[1:] if "llama-server" in line]
    assert pids, top
    return pids[0]


def test_32_clients_x_5_streaming_requests_through_the_gateway(stack):
    """The benchmark's own load generator (the openai client, streaming; tokens from the server's
    usage), at 32 clients x 5 requests: eight clients a slot, so the gateway and the server queue
    them. (More requests per client prove nothing more and cost the run minutes.)"""
    api = Endpoint.of(stack.env_now())
    model = probe.served_model(api)
    row = bench.sweep_level(api, model, 32, 5, prompt=16, max_tokens=8, offset=0)
    record(
        "concurrency: 32 clients x 5 streaming requests",
        row["requests"],
        row["failures"],
        None,
        "none" if not row["failures"] else f"{row['failures']} requests",
        wall_s=row["wall_s"],
        aggregate_tokens_per_s=row["aggregate_tokens_per_s"],
        ttft_p95_s=row["ttft_p95_s"],
    )
    assert row["failures"] == 0, row["failure_samples"]
    assert row["completed"] == 32 * 5 and row["completion_tokens"] >= 32 * 5


def long_stream(api: openai.OpenAI, streaming, ended: list[str], tokens: int = 300) -> None:
    """A stream of `tokens`; `streaming()` is called at its first chunk, before the next is read;
    how it ended goes into `ended`: completed, or the client's error (a clean one: the client was
    told)."""
    outcome = "hung"
    try:
        chunks = api.chat.completions.create(
            model="any",
            messages=[{"role": "user", "content": "Write a long story."}],
            max_tokens=tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for number, _ in enumerate(chunks):
            if number == 0:
                streaming()
        outcome = "completed"
    except openai.OpenAIError as exc:
        outcome = f"clean error ({type(exc).__name__})"
    finally:
        ended.append(outcome)


def test_kill_9_of_the_server_mid_stream_heals_without_an_operator(stack):
    """The kill comes from the stream's own first chunk, before the client reads on, and the stream
    asks for nearly the whole slot's context (ignoring end of text): however fast or loaded this
    machine is, the server cannot have finished it when the kill arrives."""
    ended: list[str] = []
    pid = server_pid(stack)
    killed: list[float] = []

    def kill() -> None:
        os.kill(pid, signal.SIGKILL)
        killed.append(time.monotonic())

    tokens = int(stack.env["CONTEXT"]) - 64  # room for the prompt
    thread = threading.Thread(
        target=long_stream, args=(client(stack, timeout=60), kill, ended, tokens)
    )
    thread.start()
    thread.join(timeout=120)
    assert killed, f"the stream never started: {ended}"
    recovery = wait_answering(stack, killed[0], RECOVERY_BOUND_S)
    cut = bool(ended) and ended[0].startswith("clean error")
    record(
        "kill -9 of llama-server mid-stream", 1, 1 if cut else 0, recovery,
        "the one in-flight stream (client got an error)" if cut else f"stream ended: {ended}",
    )  # fmt: skip
    assert cut, ended  # cut, and the client was told


def test_a_hung_server_is_restarted_without_an_operator(stack):
    pid = server_pid(stack)
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        recovery = wait_answering(stack, stopped, HUNG_BOUND_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert server_pid(stack) != pid, "answering again, but the hung process still serves"
    record(
        "hung server (SIGSTOP; stands in for a GPU that stops answering)",
        0,
        0,
        recovery,
        "requests in flight at the hang",
        bound_s=HUNG_BOUND_S,
    )


def test_stop_during_streaming_ends_in_flight_requests_cleanly_and_takes_no_new_ones(stack):
    api = client(stack, timeout=60)
    outcomes: list[str] = []
    streaming = threading.Barrier(5)

    def started() -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            streaming.wait(timeout=60)

    # Streams of nearly a whole slot each, in every slot: still in flight when the stop comes.
    tokens = int(stack.env["CONTEXT"]) - 64
    threads = [
        threading.Thread(target=long_stream, args=(api, started, outcomes, tokens))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    streaming.wait(timeout=60)
    # The new request goes in once the server has its SIGTERM, not after a guessed delay.
    container = stack.container("llama-server")
    signalled = subprocess.Popen(
        ["docker", "events", "--filter", f"container={container}", "--filter", "event=kill",
         "--format", "{{.Action}} {{.Actor.Attributes.signal}}"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    stopping = time.monotonic()
    stop = subprocess.Popen(stack.compose_cmd("stop", "-t", "30", "llama-server"), cwd=PROJECT_ROOT)
    try:
        ready, _, _ = select.select([signalled.stdout], [], [], 30)
        assert ready, "docker compose stop sent no signal within 30 s"
        assert signalled.stdout.readline().split()[-1] in ("15", "SIGTERM")
    finally:
        signalled.kill()
    refused_new = not answers(stack)
    stop.wait(timeout=60)
    stop_s = time.monotonic() - stopping
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == 4 and "hung" not in outcomes, outcomes
    assert refused_new, "a new request was taken while the server was stopping"
    assert stop_s < 35, f"docker compose stop took {stop_s:.0f} s (grace period 30 s)"
    restarted = time.monotonic()
    up = stack.compose("start", "llama-server")
    assert up.returncode == 0, up.stderr
    recovery = wait_answering(stack, restarted, RECOVERY_BOUND_S)
    cut = sum(o != "completed" for o in outcomes)
    record(
        "docker compose stop during 4 streams (then start)",
        4,
        cut,
        recovery,
        f"{cut} streams cut with a clean client error, {4 - cut} completed; new requests refused",
        stop_s=round(stop_s, 1),
    )


def dockerd_command() -> tuple[int, list[str]]:
    found = subprocess.run(["pidof", "dockerd"], capture_output=True, text=True)
    pid = int(found.stdout.split()[0])
    return pid, Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


def test_dockerd_restart_the_stack_comes_back_on_its_own(stack, cuda_build):
    """Requests every half second through the restart: how many failed, and the longest time
    without an answer (the Ansible docker role turns live-restore on; tests/bootstrap.py starts
    this machine's dockerd the same way)."""
    if cuda_build is not None:  # a restart would cut the CUDA image's build (conftest)
        cuda_build.wait()
    pid, command = dockerd_command()
    live_restore = subprocess.run(
        ["docker", "info", "--format", "{{.LiveRestoreEnabled}}"], capture_output=True, text=True
    ).stdout.strip()
    probes: list[tuple[float, bool]] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            probes.append((time.monotonic(), answers(stack)))
            time.sleep(0.5)

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(2)
    restarted = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = open("/var/log/dockerd-tests.log", "a")  # noqa: SIM115 - handed to the daemon
    subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
    while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        assert time.monotonic() - restarted < 60, "dockerd did not come back in 60 s"
        time.sleep(0.5)
    back = wait_answering(stack, restarted, RECOVERY_BOUND_S)

    def answered_after_the_last_failure() -> bool:
        failed = [at for at, ok in probes if not ok]
        return not failed or any(ok and at > failed[-1] for at, ok in probes)

    # The prober's own success after the outage, however long its last failed probe took.
    deadline = time.monotonic() + 60
    while not answered_after_the_last_failure():
        assert time.monotonic() < deadline, "the prober saw no answer after dockerd came back"
        time.sleep(0.5)
    done.set()
    prober.join(timeout=30)
    failed = [at for at, ok in probes if not ok]
    outage = min(at for at, ok in probes if ok and at > failed[-1]) - failed[0] if failed else 0.0
    record(
        f"dockerd restart (live-restore {live_restore}), a request every 0.5 s",
        len(probes),
        len(failed),
        outage,
        "requests in flight at the restart" if failed else "none",
        dockerd_back_s=round(back, 1),
    )


def test_abusive_requests_are_refused_or_bounded_and_the_server_stays_healthy(stack):
    http = stack.api()
    url = f"{stack.url}/v1/chat/completions"
    restarts = restart_count(stack)
    refused = {}
    refused["oversized body (50 MiB declared)"] = stack.status_for_declared_body(50 * 2**20)
    refused["malformed JSON"] = http.post(
        url, data=b'{"messages": [', headers={"Content-Type": "application/json"}, timeout=60
    ).status_code
    refused["invalid UTF-8"] = http.post(
        url,
        data=b'{"messages":[{"role":"user","content":"\xff\xfe\xc3"}],"max_tokens":2}',
        headers={"Content-Type": "application/json"},
        timeout=60,
    ).status_code
    # Streamed, with a bound on the wait for each chunk, not on the whole answer: how long a
    # context's worth of tokens takes depends on what else this machine runs (a cold run's CUDA
    # compile took it past 300 s once), the bound on what one request generates does not.
    huge = stream(client(stack, timeout=60), tokens=10**9)
    slow_s = slowloris(stack)
    assert refused["oversized body (50 MiB declared)"] == 413
    # Refused, though by the engine, which answers a body it cannot parse with a 500.
    assert refused["malformed JSON"] >= 400 and refused["invalid UTF-8"] >= 400, refused
    # 1e9 tokens asked: the slot's context bounds what one request generates.
    assert huge["tokens"] <= int(stack.env["CONTEXT"]), huge
    # The gateway's `timeout http-request 10s`.
    assert slow_s <= 12, f"a slow client held a connection for {slow_s:.0f} s"
    memory = container_memory(stack)
    assert memory["usage"] < memory["limit"]
    assert restart_count(stack) == restarts and not memory["oom_killed"]
    assert answers(stack)
    for what, status in refused.items():
        record(what, 1, 0, None, f"none: refused with HTTP {status}")
    record(
        "max_tokens 1e9",
        1,
        0,
        None,
        f"none: bounded by the slot's context ({huge['tokens']} tokens generated)",
    )
    record(
        "slowloris (headers 1 byte/2 s)",
        1,
        0,
        None,
        f"none: the gateway closed the connection after {slow_s:.0f} s",
        server_memory_mib=round(memory["usage"] / 2**20),
        server_memory_limit_mib=round(memory["limit"] / 2**20),
    )


def slowloris(stack) -> float:
    """Send a request's headers one byte every 2 s; seconds until the gateway answers (408) or
    hangs up."""
    context = ssl.create_default_context(cafile=stack.env["GATEWAY_TLS_FILE"])
    raw = socket.create_connection(("127.0.0.1", int(stack.env["PUBLISH_PORT"])), timeout=30)
    with context.wrap_socket(raw, server_hostname="localhost") as conn:
        started = time.monotonic()
        request = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 40
        try:
            for byte in request:
                conn.sendall(bytes([byte]))
                if select.select([conn], [], [], 2)[0]:
                    conn.recv(1024)
                    break
        except (OSError, ssl.SSLError):
            pass
        return time.monotonic() - started


def restart_count(stack) -> int:
    return int(
        subprocess.run(
            ["docker", "inspect", "--format", "{{.RestartCount}}", stack.container("llama-server")],
            capture_output=True,
            text=True,
        ).stdout
    )


def container_memory(stack) -> dict:
    container = stack.container("llama-server")
    stats = json.loads(
        subprocess.run(
            ["docker", "stats", "--no-stream", "--format", "{{json .}}", container],
            capture_output=True,
            text=True,
        ).stdout
    )
    inspected = json.loads(
        subprocess.run(["docker", "inspect", container], capture_output=True, text=True).stdout
    )[0]
    used = stats["MemUsage"].split("/")[0].strip()
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "B": 1}
    for unit, factor in units.items():
        if used.endswith(unit):
            usage = float(used.removesuffix(unit)) * factor
            break
    return {
        "usage": usage,
        "limit": inspected["HostConfig"]["Memory"],
        "oom_killed": inspected["State"]["OOMKilled"],
    }


class Endless(BaseHTTPRequestHandler):
    """A model source of unstated length (chunked), larger than the small disk: a size the
    fetch's free-space check cannot see coming."""

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        block = b"\0" * 2**20
        for _ in range(SMALL_DISK_MIB + 100):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block))
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):
        pass


def test_disk_full_during_a_model_fetch_leaves_the_live_model_serving(stack, capsys):
    """An operator fetches the next model into MODEL_DIR while the live one serves."""
    model = Path(stack.env["MODEL_DIR"]) / stack.env["MODEL_FILE"]
    before = model.read_bytes()
    server = ThreadingHTTPServer(("127.0.0.1", 0), Endless)
    server.handle_error = lambda *_: None  # the fetch hangs up on it: expected
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        source = f"http://127.0.0.1:{server.server_address[1]}/bigger.gguf"
        target = model.with_name("next.gguf")
        code = fetch_main([source, str(target), "--backend", "cpu"])
    finally:
        server.shutdown()
        target.with_name("next.gguf.partial").unlink(missing_ok=True)  # the RAM it holds
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fetch:")][-1]
    assert code == 1
    assert "is full after" in said and "untouched" in said, said
    assert model.read_bytes() == before
    assert answers(stack)
    record(
        f"disk full during a model fetch ({SMALL_DISK_MIB + 100} MiB into {SMALL_DISK_MIB} MiB)",
        1,
        1,
        None,
        "none: the fetch stopped with one line naming the fix; the live model is untouched and "
        "serving",
    )
