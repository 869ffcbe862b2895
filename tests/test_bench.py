"""`make bench` against the CPU stack: llama-bench and llama-batched-bench in the release's server
image, the sweep through the published port with the official openai client, JSON and PNG out.
The numbers mean nothing on 2 CPU cores; the GPU figures are in docs/bench.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ternary_serve.versions import PROJECT_ROOT

pytestmark = pytest.mark.docker


def test_bench_measures_the_deployed_stack(stack_for, tiny_model, tmp_path):
    # Few slots keep the 2x-slots level quick on two cores; chat: turns reuse the history.
    stack = stack_for(tiny_model, SLOTS="2", CONTEXT="2048", WORKLOAD="chat")
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "llama-server")
    assert up.returncode == 0, up.stderr[-3000:]
    out = tmp_path / "bench"
    # What `make bench` runs, pointed at this test's stack and with short runs.
    run = subprocess.run(
        [sys.executable, "-m", "ternary_serve.cli", "bench",
         "--env-file", str(stack.workdir / ".env"),
         "--out", str(out), "--pp", "32", "--tg", "8", "--reps", "1", "--rounds", "2",
         "--prompt-tokens", "16", "--chat-turns", "3", "--chat-user-tokens", "120",
         "--chat-max-tokens", "4"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "sweep 3/3: 4 clients" in run.stderr  # progress while it runs
    result = json.loads((out / "bench.json").read_text())
    assert result["release"] == stack.env["IMAGE_TAG"]
    assert result["model"] == tiny_model.name
    assert result["settings"]["slots"] == 2 and result["settings"]["context"] == 2048
    assert {r["test"] for r in result["llama_bench"]} == {"pp32", "tg8"}
    assert all(r["tokens_per_s"] > 0 for r in result["llama_bench"])
    assert [r["parallel"] for r in result["batched_bench"]] == [1, 2]
    assert [r["clients"] for r in result["sweep"]] == [1, 2, 4]
    for level in result["sweep"]:
        assert level["failures"] == 0
        # Counted by the server: every request generated exactly --tg tokens (ignore_eos).
        assert level["completion_tokens"] == level["requests"] * 8
        assert level["aggregate_tokens_per_s"] > 0 and level["ttft_p95_s"] > 0
    assert result["settings"]["workload"] == "chat"
    assert result["settings"]["server_flags"]["LLAMA_ARG_CTX_CHECKPOINTS"] == "2"
    assert [level["users"] for level in result["chat"]] == [1, 2]
    for level in result["chat"]:
        assert level["failures"] == 0, level["failure_samples"]
        first, *later = level["turns"]
        assert [t["completed"] for t in level["turns"]] == [level["users"]] * 3
        assert first["prompt_reused_mean"] < 8  # at most what the sweep left (BOS)
        # Each turn carries the whole history, and the server reuses the earlier turns.
        prompts = [t["prompt_tokens_mean"] for t in level["turns"]]
        assert prompts == sorted(prompts) and prompts[-1] > 2 * 120
        for turn, before in zip(later, level["turns"], strict=False):
            assert turn["prompt_reused_mean"] >= before["prompt_tokens_mean"] - 8, turn
    assert "chat, 2 users" in run.stdout and "reused" in run.stdout
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_without_a_server_says_what_to_do(stack_for, tiny_model, tmp_path):
    stack = stack_for(tiny_model)
    run = subprocess.run(
        [sys.executable, "-m", "ternary_serve.cli", "bench",
         "--env-file", str(stack.workdir / ".env"),
         "--out", str(tmp_path), "--pp", "16", "--tg", "4", "--reps", "1"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].endswith("deploy first (make up)")
