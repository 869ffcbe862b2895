"""The liveness probe (ternary_serve/liveness.py, the server image's HEALTHCHECK): a server whose
/health says ok while it no longer decodes turns unhealthy, and after three failed checks it is
killed and its restart policy brings it back; a working server stays healthy idle and under load.

Stand-in: no GPU can be lost here. A server whose GPU is gone while /health still answers is stood
in for by tests/standin_server.py in its `hang` mode (every completion taken and never answered, the
llama_decode() counter stopped: a decode stuck on a dead device) and its `fail` mode (every
completion answered with llama-server's HTTP 500 "Compute error.", as when llama_decode() fails).
In Docker it runs in the real server image, under its tini, with its real HEALTHCHECK, hardened as
Compose runs it; only the health timing is shortened. A release whose server is the `fail`
stand-in goes through the release gate (`ternary-serve release deploy`). The probe's device-node
check (EPERM on /dev/nvidia* once a container lost its device access) is exercised here only with
a path that cannot be opened; the real EPERM needs a GPU host. The no-false-kill side runs the
real llama-server with the tiny model.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import docker as docker_sdk
import pytest
import standin_server
from harness import configure, release_whose_server_is

from ternary_serve import liveness, release

PROBE = ["python3", "-I", "/usr/local/lib/ternary-serve/liveness.py"]
STANDIN = Path(__file__).with_name("standin_server.py")


# --- the decision logic, against the stand-in on loopback ----------------------------------------


@contextlib.contextmanager
def standin(mode: str):
    server = standin_server.serve(mode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def probe(server, state: dict, now: float = 0.0, devices=()) -> liveness.Verdict:
    port = server.server_address[1]
    return liveness.check(liveness.Server(port, None, time.monotonic() + 9), state, now, devices)


@pytest.fixture
def short_completion(monkeypatch):
    monkeypatch.setattr(liveness, "COMPLETION_TIMEOUT_S", 1.0)


def test_a_working_server_is_healthy_and_decodes_one_token():
    with standin("right") as server:
        verdict = probe(server, {})
        assert verdict.healthy and not verdict.strike, verdict
        assert verdict.reason.startswith("idle, a 1-token completion answered in")
        assert server.RequestHandlerClass.counters["predicted"] == 1  # the probe's completion


def test_failing_completions_are_a_strike_naming_the_server_error():
    with standin("fail") as server:
        verdict = probe(server, {})
    assert not verdict.healthy and verdict.strike
    assert verdict.reason == 'decode failed: a 1-token completion: HTTP 500 "Compute error."'


def test_a_hung_decode_is_a_strike_then_a_stall_the_metrics_show(short_completion):
    with standin("hang") as server:
        state: dict = {}
        first = probe(server, state, now=100.0)
        assert first.strike and "got no answer in 1 s on an idle server" in first.reason, first
        # The hung completion stays in flight: no second completion, judged by the counter.
        soon = probe(server, state, now=103.0)
        assert soon.healthy and not soon.judged, soon  # within STALL_S: neither kind of verdict
        later = probe(server, state, now=100.0 + liveness.STALL_S + 1)
        assert later.strike, later
        assert later.reason == "decode stalled: 1 in flight and no llama_decode() call for 9 s"
        assert server.RequestHandlerClass.counters["in_flight"] == 1  # one completion, not three


def test_busy_slots_are_judged_by_the_decode_counter_without_a_completion():
    with standin("right") as server:
        counters = server.RequestHandlerClass.counters
        counters["in_flight"] = 4
        state: dict = {}
        for now in (0.0, 10.0, 20.0):
            counters["n_decode"] += 37  # long prompts and streams in progress
            verdict = probe(server, state, now)
            assert verdict.healthy and verdict.judged, verdict
            assert verdict.reason == "busy (4 in flight), decode advancing"
        stalled = probe(server, state, 30.0)
        assert stalled.strike and "no llama_decode() call for 10 s" in stalled.reason
        assert counters["predicted"] == 0  # never queued a completion behind the busy slots


def test_a_probe_queued_behind_new_requests_passes_while_decode_advances(short_completion):
    """Idle when /metrics is read, then every slot taken before the probe's completion runs: it
    waits, but the counter shows the server decoding."""
    with standin("hang") as server:
        counters = server.RequestHandlerClass.counters
        done = threading.Event()

        def decoding():
            while not done.wait(0.05):
                counters["n_decode"] += 1

        thread = threading.Thread(target=decoding)
        thread.start()
        try:
            verdict = probe(server, {})
        finally:
            done.set()
            thread.join()
    assert verdict.healthy and "queued behind requests" in verdict.reason, verdict


def test_a_device_node_that_cannot_be_opened_is_a_lost_gpu(tmp_path):
    (tmp_path / "nvidiactl").mkdir()  # opening it for writing fails, as EPERM would
    (tmp_path / "nvidia0").write_text("")
    assert liveness.lost_devices([str(tmp_path / "nvidia[0-9]*")]) is None
    with standin("right") as server:
        verdict = probe(server, {}, devices=[str(tmp_path / "nvidiactl")])
    assert verdict.strike and verdict.reason.startswith(f"GPU lost: {tmp_path}/nvidiactl: ")


def test_loading_and_not_listening_are_unhealthy_but_no_strike(monkeypatch):
    class Loading(standin_server.Handler):
        def do_GET(self):
            self.send_json(503, {"error": {"code": 503, "message": "Loading model"}})

    server = standin_server.ThreadingHTTPServer(("127.0.0.1", 0), Loading)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        verdict = probe(server, {})
    finally:
        server.shutdown()
        server.server_close()
    assert not verdict.healthy and not verdict.strike
    assert verdict.reason == "GET /health: HTTP 503 Loading model"
    closed = liveness.check(liveness.Server(1, None, time.monotonic() + 9), {}, 0.0, ())
    assert not closed.strike and closed.reason == "GET /health: nothing listens on port 1"


def test_three_strikes_in_a_row_kill_and_an_answered_check_resets(monkeypatch, tmp_path, capsys):
    killed: list[str] = []
    monkeypatch.setattr(liveness, "kill_server", killed.append)
    state = str(tmp_path / "state.json")
    with standin("fail") as server:
        monkeypatch.setenv("LLAMA_ARG_PORT", str(server.server_address[1]))
        assert [liveness.main(state), liveness.main(state)] == [1, 1]
        server.RequestHandlerClass.mode = "right"
        assert liveness.main(state) == 0  # answered: the count starts again
        server.RequestHandlerClass.mode = "fail"
        assert [liveness.main(state) for _ in range(3)] == [1, 1, 1]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("unhealthy (failed check 2 of 3): decode failed")
    assert lines[2].startswith("ok: idle")
    assert lines[-1].startswith("unhealthy (failed check 3 of 3): decode failed")
    assert lines[-1].endswith("; killing llama-server for a restart")
    assert killed == [lines[-1]]
    assert json.loads(Path(state).read_text()) == {}  # the next server starts afresh


# --- in the real server image, with its HEALTHCHECK ----------------------------------------------


def docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def inspect(container: str) -> dict:
    return json.loads(docker("inspect", container).stdout)[0]


@pytest.fixture
def server_image(built) -> str:
    image = f"{built.env['SERVER_IMAGE']}:{built.env['IMAGE_TAG']}"
    health = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]["Healthcheck"]
    assert health["Test"] == ["CMD", *PROBE], health  # the image under test has the probe
    return image


@pytest.mark.docker
@pytest.mark.parametrize(
    "mode, reason",
    [
        ("fail", 'decode failed: a 1-token completion: HTTP 500 "Compute error."'),
        ("hang", "decode stalled: "),
    ],
)
def test_gpu_lost_health_ok_turns_unhealthy_then_is_killed_and_restarted(
    server_image, mode, reason
):
    """The stand-in in the server image as Compose runs it (read-only root, /tmp tmpfs, no
    capabilities, uid 10001, tini, restart unless-stopped), checks every 4 s; unhealthy from the
    first failed check (retries 1) so that the state is visible before the third kills it."""
    name = f"ts-liveness-{mode}-{os.getpid()}"
    run = docker(
        "run", "-d", "--name", name, "--restart", "unless-stopped",
        "--read-only", "--tmpfs", "/tmp:size=64m,mode=1777", "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges:true", "--pids-limit", "256",
        "--health-interval", "4s", "--health-retries", "1", "--health-start-period", "1s",
        "-v", f"{STANDIN}:/opt/standin_server.py:ro",
        "--entrypoint", "/usr/bin/tini", server_image,
        "--", "python3", "/opt/standin_server.py", mode,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    started = time.monotonic()
    try:
        seen: dict[str, dict] = {}  # health log entries by start (Docker keeps the last 5)
        statuses: set[str] = set()
        health_code = ""
        while time.monotonic() - started < 90:
            state = inspect(name)
            if state["RestartCount"] >= 1 and state["State"]["Running"]:
                break
            health = state["State"].get("Health") or {}
            statuses.add(health.get("Status", ""))
            for entry in health.get("Log") or []:
                seen[entry["Start"]] = entry
            if health_code != "200" and state["State"]["Running"]:
                health_code = docker(
                    "exec", name, "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                    "-m", "3", "http://127.0.0.1:8080/health",
                ).stdout.strip()  # fmt: skip
            time.sleep(0.5)
        took = time.monotonic() - started
        final = inspect(name)
        logs = docker("logs", name)
        outputs = [e["Output"].strip() for _, e in sorted(seen.items())]
    finally:
        docker("rm", "-f", name)
    assert health_code == "200", "the stand-in's /health must say ok while decode is dead"
    assert "unhealthy" in statuses, (statuses, outputs)
    failed = [o for o in outputs if o.startswith("unhealthy (failed check")]
    assert failed and all(reason in o for o in failed[-1:]), outputs
    assert final["RestartCount"] >= 1, ("not restarted within 90 s", outputs)
    killed = [line for line in (logs.stdout + logs.stderr).splitlines() if "liveness:" in line]
    assert killed and killed[0].startswith("liveness: unhealthy (failed check 3 of 3): "), logs
    assert killed[0].endswith("; killing llama-server for a restart") and reason in killed[0]
    print(f"{mode}: killed and restarted {took:.0f} s after start; {killed[0]}")


@pytest.mark.docker
def test_the_release_gate_refuses_a_server_whose_health_is_ok_but_decode_fails(
    server_image, built, tiny_model, tmp_path
):
    """`ternary-serve release deploy` of a release whose server is the `fail` stand-in: Compose's
    --wait never sees it healthy (the probe fails from its first check; killed at the third, it
    restarts in its start period, `starting` again). The deploy fails at that third check, not
    after its whole wait (15 min by default), naming the reason (the kill's line); nothing goes
    live."""
    client = docker_sdk.from_env()
    tag = "test-liveness-fail"
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / "standin_server.py").write_text(STANDIN.read_text())
    release_whose_server_is(
        built,
        tag,
        tmp_path / "image",
        "COPY standin_server.py /opt/standin_server.py\n"
        'ENTRYPOINT ["/usr/bin/tini", "--", "python3", "/opt/standin_server.py", "fail"]\n',
    )
    stack = configure(tmp_path / "stack", tiny_model, "tl-liveness-gate")
    project = release.Project(stack.workdir / ".env", stack.workdir)
    started = time.monotonic()
    try:
        with pytest.raises(release.ReleaseError) as failed:
            release.deploy(project, tag)
        took = time.monotonic() - started  # the deploy's own time, not the clean-up's
    finally:
        stack.down()
        for repo in release.release_images(built.env):
            with contextlib.suppress(docker_sdk.errors.ImageNotFound):
                client.images.remove(f"{repo}:{tag}")
    message = str(failed.value)
    print(f"gate: {took:.0f} s: {message}")
    # Whichever sees it first ends the wait: Compose (the container unhealthy at the third failed
    # check) or the release's restart watch (the kill at that check restarted it).
    assert f"deploy of {tag} failed: not healthy: " in message
    assert "llama-server restarted (exit code " in message or " is unhealthy (" in message
    assert took < 180, f"the deploy waited {took:.0f} s: it should end at the first restart"
    # The kill's line, from the server's log before the restart.
    killed = 'check 3 of 3): decode failed: a 1-token completion: HTTP 500 "Compute error."'
    assert killed in message
    assert message.endswith("so nothing is live")
    assert [r["status"] for r in release.read_history(project)][-1] == "failed"


def wait_for_all_in(stack, clients: int, bound_s: float = 120) -> None:
    """Until the server has every client's request, processing or deferred (its /metrics): the
    probes then meet full slots, however long the clients took to get there."""
    deadline = time.monotonic() + bound_s
    with stack.api() as api:
        while True:
            metrics = liveness.parse_metrics(api.get(f"{stack.url}/metrics", timeout=10).text)
            if liveness.in_flight(metrics) >= clients:
                return
            assert time.monotonic() < deadline, f"the server never had all {clients}: {metrics}"
            time.sleep(0.2)


# --- the real llama-server: no false kill ---------------------------------------------------------


def probe_in(container: str) -> tuple[int, str]:
    done = docker("exec", container, *PROBE, timeout=30)
    return done.returncode, done.stdout.strip()


@pytest.mark.docker
def test_the_real_server_is_healthy_idle_and_while_requests_stream(
    stack_for, tiny_model, server_image
):
    # Two slots and four clients: every slot busy, requests deferred behind them.
    stack = stack_for(tiny_model, SLOTS="2", CONTEXT="512")
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "llama-server")
    assert up.returncode == 0, up.stderr[-3000:]  # healthy: the probe passed on a real decode
    container = stack.container("llama-server")
    code, said = probe_in(container)
    assert code == 0 and said.startswith("ok: idle, a 1-token completion answered in"), said

    url = f"{stack.url}/v1/chat/completions"
    stop, served, errors = threading.Event(), [], []

    def client():
        while not stop.is_set():
            try:
                with stack.api() as api, api.post(
                    url,
                    json={"messages": [{"role": "user", "content": "Tell me a story."}],
                          "max_tokens": 96, "stream": True, "ignore_eos": True},
                    stream=True, timeout=120,
                ) as reply:  # fmt: skip
                    reply.raise_for_status()
                    chunks = sum(1 for line in reply.iter_lines() if line.startswith(b"data: "))
                served.append(chunks)
            except Exception as exc:  # noqa: BLE001 - reported by the test
                errors.append(repr(exc))
                return

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    probes = []
    try:
        wait_for_all_in(stack, len(clients))
        loaded = time.monotonic()
        while time.monotonic() - loaded < 25:  # two of Docker's own checks (10 s) fall in here
            probes.append(probe_in(container))
            time.sleep(2)
    finally:
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    print(*probes, sep="\n")
    assert not errors and served, (errors, probes)
    assert all(code == 0 for code, _ in probes), probes
    busy = [said for _, said in probes if said.startswith("ok: busy (")]
    assert len(busy) >= len(probes) - 1, probes  # judged by the counter, not by a completion
    state = inspect(container)
    assert state["RestartCount"] == 0 and state["State"]["Health"]["Status"] == "healthy"
    # Docker's own checks (the last five: /health 503 while loading, then none failed).
    docker_said = [e["Output"].strip() for e in state["State"]["Health"]["Log"]]
    assert not [o for o in docker_said if "failed check" in o], docker_said
    assert docker_said[-1].startswith("ok: "), docker_said
    code, said = probe_in(container)
    assert code == 0, said
