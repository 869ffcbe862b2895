"""Configuration: image tags, the Compose env file and the one server-flags template."""

from __future__ import annotations

import pytest

from ternary_serve import plan
from ternary_serve.versions import load_versions


def parse_env(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_image_tag_names_version_commit_engine_backend_and_archs():
    assert plan.image_tag("1.2.0", "54cf417", "prism-b10743-adfffbe", "cuda", "89;90") == (
        "1.2.0-54cf417-prism-b10743-adfffbe-cuda-sm89-90"
    )
    assert plan.image_tag("1.2.0", "54cf417-dirty", "llama-cpp-python-0.3.36", "cpu", "89") == (
        "1.2.0-54cf417-dirty-llama-cpp-python-0.3.36-cpu"
    )


def test_image_tag_is_a_valid_docker_tag():
    tag = plan.image_tag("1.0", "abc1234", "feature/some branch", "cuda", "89")
    assert tag == "1.0-abc1234-feature-some-branch-cuda-sm89"


def test_tag_follows_the_checkout(tmp_path):
    env = plan.configure(plan.Choices(), tmp_path / ".env", tmp_path)
    assert env["PROJECT_REVISION"] in env["IMAGE_TAG"]


def test_config_defaults_target_the_fork_on_cuda(tmp_path):
    env = plan.configure(plan.Choices(), tmp_path / ".env", tmp_path)
    pins = load_versions()
    written = parse_env((tmp_path / ".env").read_text())
    assert written == env
    assert env["ENGINE_REPO"] == pins["ENGINE_REPO"]
    assert env["ENGINE_REF"] == pins["ENGINE_REF"]
    assert env["BUILD_BASE_IMAGE"] == pins["CUDA_BUILD_IMAGE"]
    assert env["RUNTIME_BASE_IMAGE"] == pins["CUDA_RUNTIME_IMAGE"]
    assert env["COMPOSE_FILE"] == "compose.yaml"
    assert env["PUBLISH_ADDRESS"] == "127.0.0.1"


def test_cuda_server_flags_put_every_layer_on_the_gpu(tmp_path):
    plan.configure(plan.Choices(model_file="bonsai.gguf"), tmp_path / ".env", tmp_path)
    flags = parse_env((tmp_path / "llama-server.env").read_text())
    assert flags["LLAMA_ARG_MODEL"] == "/models/bonsai.gguf"
    assert int(flags["LLAMA_ARG_N_GPU_LAYERS"]) >= 99
    assert flags["LLAMA_ARG_FLASH_ATTN"] == "on"
    assert all(key.startswith("LLAMA_ARG_") for key in flags)
    # Dead or non-server flags must never come back.
    assert not {"LLAMA_ARG_PROMPT_CACHE", "LLAMA_CUDA", "LLAMA_FLASH_ATTN"} & flags.keys()


def test_cpu_variant_adds_the_cpu_override_and_no_gpu_layers(tmp_path):
    env = plan.configure(plan.Choices(backend="cpu"), tmp_path / ".env", tmp_path)
    flags = parse_env((tmp_path / "llama-server.env").read_text())
    assert env["COMPOSE_FILE"] == "compose.yaml:compose.cpu.yaml"
    assert flags["LLAMA_ARG_N_GPU_LAYERS"] == "0"
    assert env["IMAGE_TAG"].endswith("-cpu")


def test_template_needs_only_backend_model_and_port():
    """Ansible will render this template with its own variables: these three must suffice."""
    text = plan.render_server_env({"backend": "cuda", "model_file": "m.gguf", "server_port": 9000})
    assert "LLAMA_ARG_PORT=9000" in text


def test_unknown_backend_is_refused(tmp_path):
    with pytest.raises(plan.ConfigError, match="choose cuda or cpu"):
        plan.configure(plan.Choices(backend="rocm"), tmp_path / ".env", tmp_path)


def test_rerun_with_same_choices_leaves_files_untouched(tmp_path):
    plan.configure(plan.Choices(), tmp_path / ".env", tmp_path)
    before = (tmp_path / ".env").stat().st_mtime_ns
    plan.configure(plan.Choices(), tmp_path / ".env", tmp_path)
    assert (tmp_path / ".env").stat().st_mtime_ns == before


def test_versions_file_rejects_malformed_lines(tmp_path):
    bad = tmp_path / "versions.env"
    bad.write_text("GOOD=1\nthis is not a pin\n")
    with pytest.raises(ValueError, match="versions.env:2"):
        load_versions(bad)
