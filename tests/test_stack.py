"""The real stack, end to end: images built from docker/Dockerfile by Compose, the real llama-server
(mainline llama.cpp, CPU backend) serving a synthetic ternary Q2_0 model, the smoke sidecar.

Stand-ins, because this machine reaches no registry and has no GPU: the base images are a
debootstrapped Debian (tests/bootstrap.py) instead of nvidia/cuda and python images, and the CPU
variant (compose.cpu.yaml) replaces the GPU reservation. The CUDA build, the GPU reservation and the
fork's PTQ1_0/PQ2_0 kernels run only on a real box (docs/testing.md: "Verified only on a real box").
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest

from ternary_serve import synthetic
from ternary_serve.versions import PROJECT_ROOT
from ternary_serve.weights import require_ternary_gguf

pytestmark = pytest.mark.docker


def read_until(proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    """Collect proc's output until a line contains pattern; fail with the output on timeout."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if pattern in line:
            return "".join(seen)
    pytest.fail(f"no {pattern!r} (exit {proc.poll()}); output:\n{''.join(seen)[-4000:]}")


def test_compose_up_serves_and_the_smoke_sidecar_passes(stack_for, tiny_model):
    """`docker compose up` as an operator runs it: smoke passes and the server keeps serving."""
    stack = stack_for(tiny_model)
    proc = subprocess.Popen(
        stack.compose_cmd("up", "--no-color"),
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output = read_until(proc, "smoke-1 exited with code", timeout=300)
        assert "smoke-1 exited with code 0" in output, output[-3000:]
        assert "smoke: PASS" in output
        # The sidecar is done; the server stays up and answers on the published port.
        reply = stack.api().post(
            f"{stack.url}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "你好"}], "max_tokens": 4},
        )
        assert reply.status_code == 200
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
        assert stack.api().get(f"{stack.url}/health", timeout=10).json() == {"status": "ok"}
        metrics = stack.api().get(f"{stack.url}/metrics", timeout=10)  # the template turns it on
        assert metrics.status_code == 200 and "llamacpp:" in metrics.text
        # No user can read another's live prompt (SLOTS_ENDPOINT defaults to off).
        slots = stack.api().get(f"{stack.url}/slots", timeout=10)
        assert slots.status_code != 200 and "prompt" not in slots.text, slots.text[:300]
        assert_every_flag_is_effective(stack)
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def server_log_with(stack, *env: str) -> str:
    """The stack's llama-server started once more beside the live one with extra LLAMA_ARG_
    settings, until it listens; its log."""
    extra = [arg for setting in env for arg in ("-e", setting)]
    started = stack.compose("run", "-d", "--no-deps", *extra, "llama-server")
    assert started.returncode == 0, started.stderr[-2000:]
    container = started.stdout.strip().splitlines()[-1]
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
            log = logs.stdout + logs.stderr
            if "listening on" in log:
                return log
            time.sleep(0.5)
        raise AssertionError(f"the extra server never listened:\n{log[-2000:]}")
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True)


def disabled_flags(log: str) -> list[str]:
    return [line for line in log.splitlines() if re.search(r"not supported.*disabled", line)]


def assert_every_flag_is_effective(stack) -> None:
    """On the qwen35 hybrid llama-server turns off what it cannot do ("cache_reuse is not supported
    by this context, it will be disabled"): no flag the template sets may be one of those. The
    control, the same server with --cache-reuse, shows that the engine says so in this log."""
    logs = stack.compose("logs", "--no-color", "llama-server").stdout
    assert "listening on" in logs
    assert not disabled_flags(logs), disabled_flags(logs)
    assert disabled_flags(server_log_with(stack, "LLAMA_ARG_CACHE_REUSE=256"))


def test_make_style_deploy_reports_ttft_and_decode_rate(stack_for, tiny_model):
    stack = stack_for(tiny_model)
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "llama-server")
    assert up.returncode == 0, up.stderr[-3000:]
    smoke = stack.compose("run", "--rm", "smoke")
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    # The header prints whatever happens: read the measured rows under it.
    lines = smoke.stdout.splitlines()
    rows = [
        line.split() for line in lines[lines.index(next(x for x in lines if "ttft_ms" in x)) + 1 :]
    ]
    trips = [row for row in rows if len(row) == 5 and row[1].isdigit()]
    assert trips, smoke.stdout
    for _prompt, tokens, ttft_ms, decode, _finish in trips:
        assert int(tokens) > 0 and float(ttft_ms) > 0 and float(decode) > 0, smoke.stdout
    assert lines[-1] == "smoke: PASS", smoke.stdout


def test_images_carry_labels_and_build_info(built):
    image = f"{built.env['SERVER_IMAGE']}:{built.env['IMAGE_TAG']}"
    labels = json.loads(
        subprocess.run(
            ["docker", "image", "inspect", image, "--format", "{{json .Config.Labels}}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert labels["io.ternary-serve.engine.ref"] == built.env["ENGINE_REF"]
    assert labels["io.ternary-serve.engine.commit"] == built.env["ENGINE_COMMIT"]
    assert labels["io.ternary-serve.backend"] == "cpu"
    assert labels["org.opencontainers.image.version"] == built.env["PROJECT_VERSION"]
    assert labels["org.opencontainers.image.revision"] == built.env["PROJECT_REVISION"]
    info = json.loads(
        subprocess.run(
            [
                "docker",
                "run",
                "--rm",
                "--entrypoint",
                "cat",
                image,
                "/etc/llama-server/build-info.json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    assert info["engine_commit"] == built.env["ENGINE_COMMIT"]
    assert info["backend"] == "cpu"
    user = subprocess.run(
        ["docker", "image", "inspect", image, "--format", "{{.Config.User}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert user and user not in ("root", "0")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "not found: put the GGUF there"),
        ("truncated", "truncated"),
        ("unreadable", "not readable by uid 10001"),
    ],
)
def test_bad_model_never_starts_the_server(stack_for, tiny_model, tmp_path, damage, message):
    models = tmp_path / "models"
    models.mkdir()
    bad = models / "model.gguf"
    # Damaged after `config` (which would refuse a truncated file itself, test_release): what
    # model-init finds when the server is about to start.
    stack = stack_for(bad)
    if damage == "truncated":
        bad.write_bytes(tiny_model.read_bytes()[:50_000])
    if damage == "unreadable":
        bad.write_bytes(tiny_model.read_bytes())
        bad.chmod(0o600)  # owned by root: the containers' uid 10001 cannot read it
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120", "llama-server")
    assert up.returncode != 0
    logs = stack.compose("logs", "--no-color", "model-init").stdout
    assert message in logs, logs
    assert stack.compose("run", "--rm", "smoke", timeout=180).returncode != 0
    states = stack.compose("ps", "-a", "--format", "{{.Service}} {{.State}}").stdout
    assert "llama-server running" not in states, states


def test_model_init_fetches_the_configured_source_before_the_server_starts(
    stack_for, tiny_model, tmp_path
):
    """A fresh host: nothing at MODEL_FILE; model-init fetches MODEL_SOURCE, checked by SHA-256."""
    models = tmp_path / "models"
    (models / "incoming").mkdir(parents=True)
    shutil.copy(tiny_model, models / "incoming" / "tiny.gguf")
    digest = hashlib.sha256(tiny_model.read_bytes()).hexdigest()
    stack = stack_for(
        models / "model.gguf", MODEL_SOURCE="/models/incoming/tiny.gguf", MODEL_SHA256=digest
    )
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120", "llama-server")
    assert up.returncode == 0, up.stderr[-3000:]
    assert (models / "model.gguf").read_bytes() == tiny_model.read_bytes()
    manifest = json.loads((models / "model.gguf.manifest.json").read_text())
    assert manifest["sha256"] == digest
    assert stack.api().get(f"{stack.url}/health", timeout=10).json() == {"status": "ok"}


def test_model_init_refuses_a_source_with_the_wrong_checksum(stack_for, tiny_model, tmp_path):
    models = tmp_path / "models"
    (models / "incoming").mkdir(parents=True)
    shutil.copy(tiny_model, models / "incoming" / "tiny.gguf")
    stack = stack_for(
        models / "model.gguf", MODEL_SOURCE="/models/incoming/tiny.gguf", MODEL_SHA256="0" * 64
    )
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120", "llama-server")
    assert up.returncode != 0
    logs = stack.compose("logs", "--no-color", "model-init").stdout
    assert "checksum mismatch" in logs, logs
    assert not (models / "model.gguf").exists()
    states = stack.compose("ps", "-a", "--format", "{{.Service}} {{.State}}").stdout
    assert "llama-server running" not in states, states


def test_model_the_engine_cannot_load_makes_the_server_unhealthy(stack_for, tiny_model, tmp_path):
    """Passes the file checks, but a tensor is missing: the engine's error shows in the logs."""
    data = bytearray(tiny_model.read_bytes())
    at = data.index(b"output_norm.weight")
    data[at : at + 18] = b"output_norm.weighx"
    models = tmp_path / "models"
    models.mkdir()
    (models / "model.gguf").write_bytes(bytes(data))
    stack = stack_for(models / "model.gguf")
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "120", "llama-server")
    assert up.returncode != 0
    assert "unhealthy" in up.stderr or "exited" in up.stderr, up.stderr
    logs = stack.compose("logs", "--no-color", "llama-server").stdout
    assert "tensor 'output_norm.weight' not found" in logs, logs[-3000:]
    assert stack.compose("run", "--rm", "smoke", timeout=180).returncode != 0


def test_our_q2_0_packing_is_byte_identical_to_llama_quantize(built, tmp_path):
    """The engine's own quantizer (the one the model-init image ships), on the same ternary
    weights as F32, gives the same bytes."""
    gguf = require_ternary_gguf()
    synthetic.write_model(tmp_path / "ours.gguf", "llama-tiny", seed=7)
    synthetic.write_model(tmp_path / "f32.gguf", "llama-tiny", seed=7, packed=False)
    quantized = subprocess.run(
        ["docker", "run", "--rm", "-v", f"{tmp_path}:/m", "--entrypoint",
         "/opt/engine/bin/llama-quantize",
         f"{built.env['MODEL_INIT_IMAGE']}:{built.env['IMAGE_TAG']}",
         "/m/f32.gguf", "/m/engine.gguf", "Q2_0"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert quantized.returncode == 0, quantized.stderr[-3000:]
    ours = {t.name: t for t in gguf.GGUFReader(tmp_path / "ours.gguf").tensors}
    engine = {t.name: t for t in gguf.GGUFReader(tmp_path / "engine.gguf").tensors}
    packed = [name for name, t in ours.items() if t.tensor_type.name == "Q2_0"]
    assert len(packed) == 7 * synthetic.PROFILES["llama-tiny"].n_layer
    for name in packed:
        assert engine[name].tensor_type.name == "Q2_0", name
        np.testing.assert_array_equal(np.asarray(ours[name].data), np.asarray(engine[name].data))


def test_plain_compose_without_config_names_the_fix(tmp_path):
    """A fresh clone with no .env: Compose refuses with a line that says to run make config."""
    shutil.copy(PROJECT_ROOT / "compose.yaml", tmp_path / "compose.yaml")
    result = subprocess.run(
        ["docker", "compose", "config"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "run `make config` first" in result.stderr
