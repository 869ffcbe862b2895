"""The memory plan: model facts read from real GGUF headers (both architectures), the choice of
slots x context x KV type, and the refusal of what cannot fit. How close the plan comes to what the
engine allocates is measured on a GPU (docs/plan.md), not here: no GPU in CI."""

from __future__ import annotations

import math

import pytest

from ternary_serve import config, plan, settings, synthetic

MIB = 2**20


@pytest.fixture(scope="module")
def llama_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "llama-tiny.gguf"
    return synthetic.write_model(path, "llama-tiny", seed=0)


def expected_from_profile(profile: str) -> tuple[int, int, int]:
    """KV elements per token, recurrent bytes per slot and attention layers, from the profile
    the model was generated from (llama.cpp's formulas, not the plan's code)."""
    shape = synthetic.PROFILES[profile]
    if profile.startswith("llama"):
        return shape.n_layer * shape.n_head_kv * 2 * shape.head_dim, 0, shape.n_layer
    attention = [il for il in range(shape.n_layer) if shape.is_full_attention(il)]
    conv = (shape.ssm_conv_kernel - 1) * (
        shape.ssm_inner_size + 2 * shape.ssm_group_count * shape.ssm_state_size
    )
    ssm = shape.ssm_state_size * shape.ssm_inner_size
    recurrent = (shape.n_layer - len(attention)) * (conv + ssm) * 4
    return len(attention) * shape.n_head_kv * 2 * shape.head_dim, recurrent, len(attention)


@pytest.mark.parametrize("which", ["tiny", "llama-tiny"])
def test_shape_is_read_from_the_header(which, tiny_model, llama_tiny):
    path = tiny_model if which == "tiny" else llama_tiny
    shape = plan.Shape.from_gguf(path)
    kv, recurrent, attention = expected_from_profile(which)
    assert shape.architecture == synthetic.PROFILES[which].architecture
    assert shape.kv_elements_per_token == kv
    assert shape.recurrent_bytes_per_slot == recurrent
    assert shape.attention_layers == attention
    assert shape.n_ctx_train == synthetic.PROFILES[which].context_length
    assert shape.weight_bytes + shape.host_weight_bytes <= path.stat().st_size


def test_bonsai_2_27b_facts(tmp_path):
    """The plan's reader on Bonsai 2 27B's own header (hyperparameters only, no weights) gives
    what llama.cpp reports when it loads the real model: 64 KiB of f16 KV cache per token over
    16 attention layers, and about 150 MiB of recurrent state per slot."""
    header = synthetic.write_model(tmp_path / "bonsai.gguf", "27b", header_only=True)
    shape = plan.Shape.from_gguf(header)
    assert (shape.architecture, shape.attention_layers) == ("qwen35", 16)
    assert shape.kv_bytes_per_token("f16") == 64 * 1024
    assert 149 < shape.recurrent_bytes_per_slot / MIB < 150


def plan_for(path, **given):
    return plan.for_settings(settings.resolve({}, {"VRAM_MIB": "2048", **given}), path)


def test_auto_fills_the_memory_up_to_the_slot_cap(tiny_model):
    memory = plan_for(tiny_model)
    assert (memory.slots, memory.context, memory.kv_type) == (plan.MAX_SLOTS, 8192, "f16")
    assert memory.ctx_total == memory.slots * memory.context
    assert memory.used_mib + memory.headroom_mib <= memory.memory_mib


def test_llama_context_defaults_to_what_the_model_was_trained_for(llama_tiny):
    assert plan_for(llama_tiny).context == 4096


def test_explicit_settings_are_kept(tiny_model):
    memory = plan_for(tiny_model, SLOTS="3", CONTEXT="2048", KV_TYPE="q4_0", KV_UNIFIED="on")
    assert (memory.slots, memory.context, memory.kv_type, memory.kv_unified) == (
        3, 2048, "q4_0", "on",
    )  # fmt: skip


def test_q8_0_when_f16_cannot_hold_the_context(tiny_model):
    shape = plan.Shape.from_gguf(tiny_model)
    context = 32768
    weights = math.ceil(shape.weight_bytes / MIB)
    fixed = (
        weights + shape.compute_mib(512, context) + plan.CUDA_RUNTIME_MIB + plan.HEADROOM_MIN_MIB
    )
    fixed += 1
    state = shape.recurrent_bytes_per_slot / MIB + shape.compute_per_slot_mib()
    f16 = context * shape.kv_bytes_per_token("f16") / MIB + state
    q8 = context * shape.kv_bytes_per_token("q8_0") / MIB + state
    between = math.ceil(fixed + (f16 + q8) / 2)
    memory = plan_for(tiny_model, VRAM_MIB=str(between), CONTEXT=str(context))
    assert (memory.kv_type, memory.slots) == ("q8_0", 1)
    f16_fits = plan_for(tiny_model, VRAM_MIB=str(math.ceil(fixed + f16)), CONTEXT=str(context))
    assert f16_fits.kv_type == "f16"


def test_too_much_is_refused_naming_what_would_fit(tiny_model):
    with pytest.raises(plan.PlanError) as refused:
        plan_for(tiny_model, SLOTS="64", CONTEXT="32768")
    message = str(refused.value)
    assert message.startswith("64 slots x 32768 tokens need")
    # Both suggestions are real: planned, they fit.
    context = message.split("SLOTS=64 with CONTEXT=")[1].split()[0]
    slots = message.split("CONTEXT=32768 with SLOTS=")[1].split()[0]
    assert plan_for(tiny_model, SLOTS="64", CONTEXT=context).slots == 64
    assert plan_for(tiny_model, SLOTS=slots, CONTEXT="32768").slots == int(slots)


def test_a_model_larger_than_the_card_is_refused(tiny_model):
    with pytest.raises(plan.PlanError, match="before any context .* use a smaller packing"):
        plan_for(tiny_model, VRAM_MIB="1024")


def test_context_beyond_training_is_refused(llama_tiny):
    with pytest.raises(plan.PlanError, match="more than the 4096 tokens .* set CONTEXT=4096"):
        plan_for(llama_tiny, CONTEXT="8192")


def test_config_refuses_a_plan_that_cannot_fit_and_writes_nothing(tiny_model, tmp_path, capsys):
    args = [f"MODEL_DIR={tiny_model.parent}", f"MODEL_FILE={tiny_model.name}", "VRAM_MIB=2048",
            "SLOTS=64", "CONTEXT=32768"]  # fmt: skip
    code = config.main([*args, "--env-file", str(tmp_path / ".env"), "--state-dir", str(tmp_path)])
    assert code == 1
    err = capsys.readouterr().err
    assert err.startswith("config: 64 slots x 32768 tokens need") and "would fit" in err
    assert list(tmp_path.iterdir()) == []


def test_plan_command_prints_the_table(tiny_model, capsys, tmp_path):
    out = tmp_path / "plan.json"
    unconfigured = ["--env-file", str(tmp_path / "none" / ".env")]
    assert (
        plan.main([str(tiny_model), "--vram-mib", "24564", "--json", str(out), *unconfigured]) == 0
    )
    table = capsys.readouterr().out
    for row in ("weights", "KV cache (f16, 16 x 8192 tokens)", "recurrent state", "compute"):
        assert row in table
    assert '"slots": 16' in out.read_text()


def test_make_plan_plans_with_the_configured_settings(tiny_model, capsys, tmp_path):
    """`make plan` after `make config CONTEXT=4096 SLOTS=2 KV_TYPE=q8_0`: that plan, not the
    defaults'; a setting given on the command line still wins."""
    where = ["--env-file", str(tmp_path / ".env"), "--state-dir", str(tmp_path)]
    chosen = ["BACKEND=cpu", "CONTEXT=4096", "SLOTS=2", "KV_TYPE=q8_0", "VRAM_MIB=24564",
              f"MODEL_DIR={tiny_model.parent}", f"MODEL_FILE={tiny_model.name}"]  # fmt: skip
    assert config.main([*chosen, *where]) == 0
    capsys.readouterr()
    assert plan.main([str(tiny_model), "--env-file", str(tmp_path / ".env")]) == 0
    assert "KV cache (q8_0, 2 x 4096 tokens)" in capsys.readouterr().out
    assert plan.main([str(tiny_model), "--env-file", str(tmp_path / ".env"), "SLOTS=3"]) == 0
    assert "KV cache (q8_0, 3 x 4096 tokens)" in capsys.readouterr().out


def stand_in_nvidia_smi(tmp_path, monkeypatch, script: str) -> None:
    """STAND-IN for nvidia-smi (no GPU here): a script on PATH printing what the real one prints
    for `--format=csv,noheader,nounits` (a 4090 on driver 580), or failing the way it fails
    without a driver. That the real tool prints these columns is seen only on a GPU box."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    tool = bin_dir / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")


def test_the_plan_sizes_the_server_by_the_card_nvidia_smi_reports(
    tiny_model, tmp_path, monkeypatch, capsys
):
    stand_in_nvidia_smi(
        tmp_path, monkeypatch, 'echo "0, NVIDIA GeForce RTX 4090, 580.142, 24564, 1"'
    )
    memory = plan.for_settings(settings.resolve({}, {"BACKEND": "cuda"}), tiny_model)
    assert (memory.memory_mib, memory.memory) == (24564, "GPU 0: NVIDIA GeForce RTX 4090")
    stand_in_nvidia_smi(
        tmp_path / "no-driver",
        monkeypatch,
        "echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'"
        "; exit 9",
    )
    assert plan.main([str(tiny_model), "BACKEND=cuda", "--env-file", str(tmp_path / ".env")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("plan: cannot read GPU 0's memory (NVIDIA-SMI has failed because")
    assert "the nvidia_driver role" in err and "VRAM_MIB" in err
