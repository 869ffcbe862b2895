"""Configuration: image tags, the settings' one path to the Compose env and the server flags."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ternary_serve import catalog, config, envfile, settings
from ternary_serve.versions import PROJECT_ROOT, load_versions


def configure(tmp_path, **given: str):
    return config.configure(given, tmp_path / ".env", tmp_path)


def server_flags(tmp_path) -> dict[str, str]:
    return envfile.read(tmp_path / "llama-server.env")


def test_image_tag_names_version_commit_engine_backend_and_archs():
    assert config.image_tag("1.2.0", "54cf417", "prism-b10743-adfffbe", "cuda", "89;90") == (
        "1.2.0-54cf417-prism-b10743-adfffbe-cuda-sm89-90"
    )
    assert config.image_tag("1.2.0", "54cf417-dirty", "llama-cpp-python-0.3.36", "cpu", "89") == (
        "1.2.0-54cf417-dirty-llama-cpp-python-0.3.36-cpu"
    )


def test_image_tag_is_a_valid_docker_tag():
    tag = config.image_tag("1.0", "abc1234", "feature/some branch", "cuda", "89")
    assert tag == "1.0-abc1234-feature-some-branch-cuda-sm89"


def test_tag_follows_the_checkout(tmp_path):
    env, _ = configure(tmp_path)
    assert env["PROJECT_REVISION"] in env["IMAGE_TAG"]


def test_config_defaults_target_the_fork_on_cuda(tmp_path):
    env, memory = configure(tmp_path)
    pins = load_versions()
    assert envfile.read(tmp_path / ".env") == env
    assert env["ENGINE_REPO"] == pins["ENGINE_REPO"]
    assert env["ENGINE_REF"] == pins["ENGINE_REF"]
    assert env["BUILD_BASE_IMAGE"] == pins["CUDA_BUILD_IMAGE"]
    assert env["RUNTIME_BASE_IMAGE"] == pins["CUDA_RUNTIME_IMAGE"]
    # The gateway in front, on loopback too.
    assert env["COMPOSE_FILE"] == "compose.yaml:compose.gateway.yaml"
    assert env["PUBLISH_ADDRESS"] == "127.0.0.1"
    # No model in place: no plan yet, and the server flags say so (the deploy plans).
    assert memory is None
    assert server_flags(tmp_path)["LLAMA_ARG_FIT"] == "on"


@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_every_image_is_built_from_a_base_pinned_by_digest(tmp_path, backend):
    """What a default `make config` hands Compose's build: a tag alone can move under a rebuild, a
    digest cannot."""
    env, _ = configure(tmp_path, BACKEND=backend)
    dockerfile = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    from_args = set(re.findall(r"^FROM \$\{(\w+)\}", dockerfile, re.MULTILINE))
    bases = {key: env.get(key, "") for key in from_args}
    assert bases, "the Dockerfile builds from no base-image build arg"
    for key, image in bases.items():
        assert re.fullmatch(r"[a-z0-9./_-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), (
            f"{key}={image}: pin the base image in versions.env by digest (TAG@sha256:...)"
        )


def test_cuda_server_flags_put_every_layer_on_the_gpu(tmp_path):
    configure(tmp_path, MODEL_FILE="bonsai.gguf")
    flags = server_flags(tmp_path)
    assert flags["LLAMA_ARG_MODEL"] == "/models/bonsai.gguf"
    assert int(flags["LLAMA_ARG_N_GPU_LAYERS"]) >= 99
    assert flags["LLAMA_ARG_FLASH_ATTN"] == "on"
    assert all(key.startswith("LLAMA_ARG_") for key in flags)
    # Dead or non-server flags must never come back.
    assert not {"LLAMA_ARG_PROMPT_CACHE", "LLAMA_CUDA", "LLAMA_FLASH_ATTN"} & flags.keys()


def test_cpu_variant_adds_the_cpu_override_and_no_gpu_layers(tmp_path):
    env, _ = configure(tmp_path, BACKEND="cpu")
    assert env["COMPOSE_FILE"] == "compose.yaml:compose.cpu.yaml:compose.gateway.yaml"
    assert server_flags(tmp_path)["LLAMA_ARG_N_GPU_LAYERS"] == "0"
    assert env["IMAGE_TAG"].endswith("-cpu")


def test_rerun_with_same_settings_leaves_files_untouched(tmp_path, capsys):
    configure(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    configure(tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    assert "config: unchanged" in capsys.readouterr().err


def test_versions_file_rejects_malformed_lines(tmp_path):
    bad = tmp_path / "versions.env"
    bad.write_text("GOOD=1\nthis is not a pin\n")
    with pytest.raises(ValueError, match="versions.env:2"):
        load_versions(bad)


# --- settings flow ------------------------------------------------------------------------------

# setting, value -> what the server must be told (None: nothing on the server side)
SERVER_EFFECTS = [
    ("MODEL_FILE", "tiny-ternary.gguf", {"LLAMA_ARG_MODEL": "/models/tiny-ternary.gguf"}),
    ("BACKEND", "cpu", {"LLAMA_ARG_N_GPU_LAYERS": "0"}),
    ("CONTEXT", "4096", {"LLAMA_ARG_CTX_SIZE": str(16 * 4096)}),
    ("SLOTS", "3", {"LLAMA_ARG_N_PARALLEL": "3", "LLAMA_ARG_CTX_SIZE": str(3 * 8192)}),
    ("KV_TYPE", "q8_0", {"LLAMA_ARG_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_CACHE_TYPE_V": "q8_0"}),
    ("KV_UNIFIED", "on", {"LLAMA_ARG_KV_UNIFIED": "on"}),
    ("WORKLOAD", "chat", {"LLAMA_ARG_CTX_CHECKPOINTS": "2"}),
    ("PROMPT_CACHE", "on", {"LLAMA_ARG_CACHE_RAM": "8192", "LLAMA_ARG_CACHE_IDLE_SLOTS": "1"}),
    ("BATCH", "1024", {"LLAMA_ARG_BATCH": "1024"}),
    ("UBATCH", "256", {"LLAMA_ARG_UBATCH": "256"}),
    ("SERVER_EXTRA", "LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT=64 LLAMA_ARG_THREADS=2",
     {"LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT": "64", "LLAMA_ARG_THREADS": "2"}),
    ("SLOTS_ENDPOINT", "on", {"LLAMA_ARG_ENDPOINT_SLOTS": "1"}),
    ("VRAM_MIB", "4096", {}),
    ("GPU", "1", {}),
    ("PUBLISH_ADDRESS", "0.0.0.0", {}),
    ("PUBLISH_PORT", "9123", {}),
    ("QUALITY_GATE", "none", {}),
    ("MODEL_SOURCE", "bonsai-2-27b-pq2_0", {}),
    ("MODEL_TYPE", "Q1_0", {}),
    ("PROJECT_NAME", "other-stack", {}),
    ("WEB_UI", "on", {"LLAMA_ARG_UI": "1"}),
    ("GATEWAY", "off", {}),
    ("CORS_ORIGINS", "https://app.example.test", {}),
    ("BODY_LIMIT_KIB", "64", {}),
    ("CLIENT_CONNECTIONS", "5", {}),
    ("CLIENT_RATE", "7", {}),
    ("QUEUE_LENGTH", "3", {}),
    ("QUEUE_WAIT_S", "4", {}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "value", "server"), SERVER_EFFECTS, ids=[s[0] for s in SERVER_EFFECTS]
)
def test_each_setting_reaches_compose_and_the_server(tmp_path, tiny_model, name, value, server):
    """Planned for 2 GiB (VRAM_MIB) so the plan does not depend on this machine."""
    base = {"MODEL_DIR": str(tiny_model.parent), "MODEL_FILE": tiny_model.name, "VRAM_MIB": "2048"}
    env, memory = configure(tmp_path, **{**base, name: value})
    assert memory is not None
    assert env[name] == value
    flags = server_flags(tmp_path)
    for key, expected in server.items():
        assert flags[key] == expected, (key, flags)
    # With its default (VRAM_MIB: the base's 2048, as auto would read a GPU) the files differ.
    other = tmp_path / "default"
    control = base if name == "VRAM_MIB" else {**base, name: settings.SETTINGS[name].default}
    config.configure(control, other / ".env", other)
    assert envfile.read(other / ".env")[name] != value
    for key, expected in server.items():
        assert server_flags(other).get(key) != expected, key


def test_gpu_setting_picks_the_card_compose_reserves(tmp_path):
    configure(tmp_path, GPU="1")
    rendered = subprocess.run(
        ["docker", "compose", "--env-file", str(tmp_path / ".env"), "config", "--format", "json"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    server = json.loads(rendered.stdout)["services"]["llama-server"]
    devices = server["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["device_ids"] == ["1"]


def test_settings_persist_and_an_empty_value_restores_the_default(tmp_path):
    configure(tmp_path, CONTEXT="4096", PUBLISH_PORT="9000")
    env, _ = configure(tmp_path)  # a later `make up` with no settings keeps them
    assert (env["CONTEXT"], env["PUBLISH_PORT"]) == ("4096", "9000")
    assert envfile.read(tmp_path / "settings.env") == {"CONTEXT": "4096", "PUBLISH_PORT": "9000"}
    env, _ = configure(tmp_path, CONTEXT="")
    assert env["CONTEXT"] == "auto"
    assert envfile.read(tmp_path / "settings.env") == {"PUBLISH_PORT": "9000"}


def test_replace_drops_settings_not_given(tmp_path):
    configure(tmp_path, CONTEXT="4096")
    env, _ = config.configure({"SLOTS": "2"}, tmp_path / ".env", tmp_path, replace=True)
    assert (env["CONTEXT"], env["SLOTS"]) == ("auto", "2")


def test_a_retired_setting_in_settings_env_is_dropped_with_a_note(tmp_path, capsys):
    """An operator's settings.env from before the smoke image moved onto the runtime base."""
    configure(tmp_path, CONTEXT="4096")
    (tmp_path / "settings.env").write_text(
        (tmp_path / "settings.env").read_text() + "SMOKE_BASE_IMAGE=python:3.11-slim\n"
    )
    env, _ = configure(tmp_path)
    assert env["CONTEXT"] == "4096" and "SMOKE_BASE_IMAGE" not in env
    assert envfile.read(tmp_path / "settings.env") == {"CONTEXT": "4096"}
    assert "SMOKE_BASE_IMAGE dropped from settings.env" in capsys.readouterr().err


BAD = [
    (["BACKEND=rocm"], "BACKEND=rocm: choose cuda or cpu"),
    (["CONTEXT=lots"], "CONTEXT=lots: a whole number from 256"),
    (["SLOTS=0"], "SLOTS=0: a whole number from 1 to 256, or auto"),
    (["KV_TYPE=q3_k"], "KV_TYPE=q3_k: choose auto or f16 or q8_0 or q4_0"),
    (["PUBLISH_PORT=70000"], "PUBLISH_PORT=70000: a whole number from 1 to 65535"),
    (["PUBLISH_ADDRESS=localhost"], "PUBLISH_ADDRESS=localhost: an IP address"),
    (["MODEL_FILE=../up.gguf"], "MODEL_FILE=../up.gguf: a file name ending in .gguf"),
    (["MODEL_SHA256=abc"], "MODEL_SHA256=abc: 64 lowercase hex digits"),
    (["SERVER_EXTRA=--threads 4"], "SERVER_EXTRA=--threads 4: space-separated LLAMA_ARG_NAME"),
    (["SERVER_EXTRA=LLAMA_ARG_CTX_SIZE=4096"], "SERVER_EXTRA sets LLAMA_ARG_CTX_SIZE, which the"),
    (["CONTXT=4096"], "CONTXT is not a setting: did you mean CONTEXT?"),
    (["SMOKE_BASE_IMAGE=x"], "SMOKE_BASE_IMAGE is no longer a setting: the smoke image is built"),
    (["CONTEXT"], "'CONTEXT': settings are given as NAME=value"),
    (
        ["MODEL_SOURCE=bonsai-8b"],
        "bonsai-8b is not a model in models.yaml: did you mean bonsai-8b-q2_0? its models: ",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[a[0] for a, _ in BAD])
def test_a_bad_value_is_refused_with_one_line_and_nothing_written(tmp_path, capsys, args, message):
    code = config.main([*args, "--env-file", str(tmp_path / ".env"), "--state-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"config: {message}"), err
    assert len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_mistyped_model_lists_the_catalogs_names(tmp_path, capsys):
    """`make up MODEL=...` and `make config MODEL=...` pass it as MODEL_SOURCE: refused before
    anything is built or written, with every name the catalog has."""
    code = config.main(["MODEL_SOURCE=qwen-27b", "--env-file", str(tmp_path / ".env")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("config: qwen-27b is not a model in models.yaml: its models: "), err
    assert all(name in err for name in catalog.load_catalog().models), err
    assert list(tmp_path.iterdir()) == []


def test_a_source_that_is_no_name_is_not_checked_against_the_catalog(tmp_path, monkeypatch):
    """Only a bare word must be a catalog name: a URL, an hf:// file, a path, a file here."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "here.gguf").write_bytes(b"")
    for source in ("https://example.org/m.gguf", "hf://o/r/m.gguf", "/models/ckpt", "here.gguf"):
        env, _ = configure(tmp_path / "stack", MODEL_SOURCE=source)
        assert env["MODEL_SOURCE"] == source


def test_the_settings_page_is_the_registry_as_it_stands():
    page = settings.SETTINGS_PAGE.read_text()
    assert page == settings.page(), "docs/settings.md is stale: run `make docs-settings`"
    rows = {line.split("`")[1]: line for line in page.splitlines() if line.startswith("| `")}
    assert list(rows) == list(settings.SETTINGS)
    # every row says what the setting accepts (a check without words would leave the cell empty)
    assert all(line.split(" | ")[2].strip() for line in rows.values()), rows


def test_make_passes_settings_by_name_and_refuses_a_misspelt_one():
    dry = subprocess.run(
        ["make", "-n", "config", "CONTEXT=4096", "KV_TYPE=q8_0"],
        cwd=PROJECT_ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    assert "config" in dry.stdout and "'CONTEXT=4096'" in dry.stdout
    assert "'KV_TYPE=q8_0'" in dry.stdout
    typo = subprocess.run(
        ["make", "-n", "config", "CONTXT=4096"], cwd=PROJECT_ROOT, capture_output=True, text=True
    )
    assert typo.returncode != 0
    assert "CONTXT is neither a setting nor a Make variable" in typo.stderr


def test_ansible_role_declares_no_setting_of_its_own():
    """Settings reach the role as llm_stack_settings by their names: no role variable may shadow
    one (a second declaration with a second default)."""
    defaults = (PROJECT_ROOT / "ansible/roles/llm_stack/defaults/main.yml").read_text().lower()
    for name in settings.SETTINGS:
        assert f"llm_stack_{name.lower()}:" not in defaults, name


# --- the gateway, the key, the limits -------------------------------------------------------------


def compose_config(tmp_path) -> dict:
    rendered = subprocess.run(
        ["docker", "compose", "--env-file", str(tmp_path / ".env"), "config", "--format", "json"],
        cwd=PROJECT_ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(rendered.stdout)


@pytest.mark.parametrize(
    ("given", "on"),
    [({}, True), ({"PUBLISH_ADDRESS": "0.0.0.0"}, True), ({"GATEWAY": "off"}, False),
     ({"PUBLISH_ADDRESS": "0.0.0.0", "GATEWAY": "off"}, False)],
)  # fmt: skip
def test_the_gateway_is_the_only_published_port_when_on(tmp_path, given, on):
    env, _ = configure(tmp_path, **given)
    services = compose_config(tmp_path)["services"]
    assert ("gateway" in services) is on
    if on:
        assert (
            env["COMPOSE_PROFILES"] == "gateway" and "compose.gateway.yaml" in env["COMPOSE_FILE"]
        )
        assert not services["llama-server"].get("ports")
        (published,) = services["gateway"]["ports"]
        assert (published["published"], published["target"]) == (env["PUBLISH_PORT"], 8443)
    else:
        (published,) = services["llama-server"]["ports"]
        assert published["host_ip"] == env["PUBLISH_ADDRESS"]


def test_gateway_settings_reach_its_configuration(tmp_path):
    configure(
        tmp_path, GATEWAY="on", CORS_ORIGINS="https://a.example.test http://b.example.test:8080",
        BODY_LIMIT_KIB="64", CLIENT_CONNECTIONS="5", CLIENT_RATE="7", QUEUE_LENGTH="3",
        QUEUE_WAIT_S="4",
    )  # fmt: skip
    cfg = (tmp_path / "haproxy.cfg").read_text()
    assert "queue(llama_server) ge 3 }" in cfg and "timeout queue 4s\n" in cfg
    assert "-m str https://a.example.test http://b.example.test:8080" in cfg
    assert (
        "content-length) gt 65536\n" in cfg
        and "sc_conn_cur(0) gt 5 }" in cfg
        and "sc_http_req_rate(0) gt 7 }" in cfg
    )
    assert "always_false" not in cfg and "/slots" not in cfg.split("acl api_path", 1)[1][:400]
    assert oct((tmp_path / "haproxy.cfg").stat().st_mode & 0o777) == "0o644"  # no secret in it
    configure(tmp_path, CORS_ORIGINS="")
    assert "acl cors_allowed always_false" in (tmp_path / "haproxy.cfg").read_text()


def test_a_changed_gateway_configuration_changes_its_container(tmp_path):
    env, _ = configure(tmp_path, GATEWAY="on")
    before = compose_config(tmp_path)["services"]["gateway"]["labels"]
    env2, _ = configure(tmp_path, CLIENT_RATE="9")
    after = compose_config(tmp_path)["services"]["gateway"]["labels"]
    assert env["GATEWAY_CONFIG_SHA"] != env2["GATEWAY_CONFIG_SHA"] and before != after


def test_the_key_and_certificate_are_made_once_private_and_kept(tmp_path):
    env, _ = configure(tmp_path, GATEWAY="on")
    key, pem = tmp_path / "api-key", tmp_path / "gateway.pem"
    for path in (key, pem):
        assert oct(path.stat().st_mode & 0o777) == "0o640" and path.stat().st_gid == 10001
    first = (key.read_text(), pem.read_text())
    assert len(first[0].strip()) >= 40 and "PRIVATE KEY" in first[1]
    configure(tmp_path, CLIENT_RATE="9")
    assert (key.read_text(), pem.read_text()) == first
    secrets = compose_config(tmp_path)["secrets"]
    assert secrets["api_key"]["file"] == str(key) and env["API_KEY_FILE"] == str(key)
    assert first[0].strip() not in (tmp_path / ".env").read_text()


def test_the_operators_certificate_replaces_the_generated_one(tmp_path):
    from ternary_serve import credentials

    bundle = credentials.self_signed(["api.example.test"])
    cert = bundle[: bundle.index("-----BEGIN PRIVATE KEY-----")]
    (tmp_path / "cert.pem").write_text(cert)
    (tmp_path / "key.pem").write_text(bundle[len(cert) :])
    with pytest.raises(config.ConfigError, match="TLS_CERT and TLS_KEY go together"):
        configure(tmp_path, TLS_CERT=str(tmp_path / "cert.pem"))
    configure(tmp_path, TLS_CERT=str(tmp_path / "cert.pem"), TLS_KEY=str(tmp_path / "key.pem"))
    assert (tmp_path / "gateway.pem").read_text() == bundle


def limit_mib(env: dict[str, str]) -> int:
    return int(env["SERVER_MEMORY_LIMIT"].removesuffix("m"))


def test_memory_limits_come_from_the_plan(tmp_path, tiny_model):
    base = {"MODEL_DIR": str(tiny_model.parent), "MODEL_FILE": tiny_model.name, "BACKEND": "cpu"}
    env, memory = configure(tmp_path, **base)
    server = compose_config(tmp_path)["services"]["llama-server"]
    assert int(server["mem_limit"]) == limit_mib(env) * 2**20
    # The default holds what the plan holds, on a CPU all of it, and no checkpoint or cache.
    assert memory.used_mib < limit_mib(env) <= memory.used_mib + 2048
    chat, _ = configure(tmp_path, WORKLOAD="chat")
    assert limit_mib(chat) - limit_mib(env) == 2 * memory.recurrent_mib  # 2 per slot
    cached, _ = configure(tmp_path, WORKLOAD="api", PROMPT_CACHE="on")
    assert limit_mib(cached) - limit_mib(env) == 8192
    fewer, _ = configure(tmp_path, WORKLOAD="chat", PROMPT_CACHE="off", SLOTS="2")
    assert limit_mib(fewer) < limit_mib(chat)  # fewer slots: fewer checkpoints


def test_a_workload_the_hosts_ram_cannot_hold_is_refused_and_nothing_is_written(tmp_path, capsys):
    """Bonsai 2 27B's shape (header only): 256 slots of chat keep 2 x 256 x ~150 MiB of
    checkpoints in host RAM, more than this machine has; api keeps none and is planned."""
    from ternary_serve import synthetic

    (tmp_path / "models").mkdir()
    model = synthetic.write_model(tmp_path / "models" / "bonsai.gguf", "27b", header_only=True)
    args = [f"MODEL_DIR={model.parent}", f"MODEL_FILE={model.name}", "BACKEND=cuda",
            f"VRAM_MIB={10**6}", "SLOTS=256", "CONTEXT=1024"]  # fmt: skip
    state = tmp_path / "state"
    state.mkdir()
    where = ["--env-file", str(state / ".env"), "--state-dir", str(state)]
    assert config.main([*args, "WORKLOAD=chat", *where]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "context checkpoints for WORKLOAD=chat" in err, err
    assert "set WORKLOAD=api, fewer SLOTS, or PROMPT_CACHE=off" in err
    assert list(state.iterdir()) == []
    assert config.main([*args, *where]) == 0, capsys.readouterr().err


def test_a_server_the_ram_holds_only_without_the_systems_share_is_refused(tmp_path):
    """An RTX 4090 plan of Bonsai 2 27B (header only) with chat and the prompt cache on a 16 GB
    box (MemTotal about 15,800 MiB): the server alone would fit the RAM, and the OS, Docker and
    the gateway would then swap or be OOM-killed under load. Refused, naming both figures; api
    without the cache fits."""
    from ternary_serve import plan, synthetic

    model = synthetic.write_model(tmp_path / "bonsai.gguf", "27b", header_only=True)
    base = {"BACKEND": "cuda", "VRAM_MIB": "24564"}
    chat = settings.resolve({}, {**base, "WORKLOAD": "chat", "PROMPT_CACHE": "on"})
    need = config.host_need(chat, plan.for_settings(chat, model), host_mib=15_800)
    assert need.server_mib <= 15_800
    with pytest.raises(config.ConfigError) as refused:
        need.check()
    message = str(refused.value)
    assert f"needs {need.server_mib} MiB" in message and "this host has 15800" in message
    assert "kept for the system" in message and "PROMPT_CACHE=off" in message
    api = settings.resolve({}, base)
    fits = config.host_need(api, plan.for_settings(api, model), host_mib=15_800)
    fits.check()
    report = config.plan_report(api, plan.for_settings(api, model))
    assert "host memory:" in report and "kept for the system" in report


def test_each_workload_sets_its_server_flags(tmp_path, tiny_model):
    """The profiles' flags as the server reads them (tests/test_serving.py: on the live server)."""
    base = {"MODEL_DIR": str(tiny_model.parent), "MODEL_FILE": tiny_model.name, "BACKEND": "cpu"}
    configure(tmp_path, **base)
    api = server_flags(tmp_path)
    configure(tmp_path, WORKLOAD="chat")
    chat = server_flags(tmp_path)
    assert (api["LLAMA_ARG_CTX_CHECKPOINTS"], chat["LLAMA_ARG_CTX_CHECKPOINTS"]) == ("0", "2")
    assert api["LLAMA_ARG_BACKEND_SAMPLING"] == chat["LLAMA_ARG_BACKEND_SAMPLING"] == "1"
    # The host prompt cache is off in both until PROMPT_CACHE=on (ggml-org/llama.cpp#27148).
    for flags in (api, chat):
        assert (flags["LLAMA_ARG_CACHE_RAM"], flags["LLAMA_ARG_CACHE_IDLE_SLOTS"]) == ("0", "0")
    configure(tmp_path, PROMPT_CACHE="on")
    cached = server_flags(tmp_path)
    assert (cached["LLAMA_ARG_CACHE_RAM"], cached["LLAMA_ARG_CACHE_IDLE_SLOTS"]) == ("8192", "1")


def test_a_reader_that_stops_early_gets_no_traceback():
    """`make settings | head`: the CLI's stdout closes under it; it exits as a tool killed by
    SIGPIPE does (141), saying nothing."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "ternary_serve.cli", "settings"],
            stdout=writer, stderr=subprocess.PIPE, text=True, cwd=PROJECT_ROOT,
        )  # fmt: skip
    finally:
        os.close(writer)
    assert (result.returncode, result.stderr) == (141, "")
