"""The answers the Ansible roles ask the CLI for instead of computing them in Jinja: a host's
replicas (`fleet replicas`), the release history and images (`release history|images|
bundle-images`), the checkout's revision and the model's size (`config --revision|--model-size`).
Each runs as the roles run it: the command line, its JSON on stdout."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from ternary_serve import catalog, cli, config, envfile, settings, versions

ERRORS: list[str] = []


def ask(capsys, *argv: str) -> tuple[int, object]:
    """Run the CLI; its exit code and its stdout as JSON (None when it printed none). What it
    said on stderr is ERRORS[-1]."""
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    ERRORS.append(err)
    return code, json.loads(out) if out.strip() else None


# --- fleet replicas ------------------------------------------------------------------------------


def replicas(capsys, *args: str, gpu_count: int = 1) -> list[dict]:
    code, found = ask(
        capsys, "fleet", "replicas", "--host", "box", "--dir", "/opt/ts",
        "--gpu-count", str(gpu_count), *args,
    )  # fmt: skip
    assert code == 0
    return found


def test_one_gpu_is_one_replica_in_the_checkout_itself(capsys):
    [only] = replicas(capsys, "CONTEXT=4096")
    assert only["dir"] == "/opt/ts"
    assert only["env_file"] == "/opt/ts/.env" and only["state_dir"] == "/opt/ts/state"
    assert only["project"] == settings.SETTINGS["PROJECT_NAME"].default
    assert only["port"] == int(settings.SETTINGS["PUBLISH_PORT"].default)
    assert only["settings"]["CONTEXT"] == "4096" and only["settings"]["GPU"] == "0"


def test_three_gpus_are_three_replicas_apart(capsys):
    found = replicas(capsys, "PUBLISH_PORT=9000", "PROJECT_NAME=llm", gpu_count=3)
    assert [r["name"] for r in found] == ["box-gpu0", "box-gpu1", "box-gpu2"]
    # Nothing two replicas could fight over: port, project, directory, files.
    for key in ("port", "project", "dir", "env_file", "state_dir"):
        assert len({r[key] for r in found}) == 3, key
    assert found[0]["dir"] == "/opt/ts" and found[0]["project"] == "llm"
    assert [r["port"] for r in found] == [9000, 9001, 9002]
    assert all(r["dir"].startswith("/opt/ts/replicas/") for r in found[1:])
    # Each replica is configured for its own card, port and project.
    for r in found:
        assert r["settings"]["PUBLISH_PORT"] == str(r["port"])
        assert r["settings"]["PROJECT_NAME"] == r["project"]
        assert r["name"].endswith("-gpu" + r["settings"]["GPU"])
    assert [r["settings"]["GPU"] for r in found] == ["0", "1", "2"]


def test_gpus_asked_for_pick_the_cards_and_the_first_keeps_the_checkout(capsys):
    found = replicas(capsys, "--gpus", "2", "1", gpu_count=3)
    assert [r["settings"]["GPU"] for r in found] == ["2", "1"]
    assert found[0]["dir"] == "/opt/ts" and found[1]["dir"] == "/opt/ts/replicas/gpu1"


def test_a_cpu_stack_is_one_replica_whatever_the_gpus(capsys):
    assert len(replicas(capsys, "BACKEND=cpu", gpu_count=0)) == 1


def test_in_a_fleet_each_replica_serves_without_a_gateway_on_every_address(capsys):
    found = replicas(capsys, "--fleet", gpu_count=2)
    assert {(r["settings"]["GATEWAY"], r["settings"]["PUBLISH_ADDRESS"]) for r in found} == {
        ("off", "0.0.0.0")
    }
    [kept] = {r["settings"]["PUBLISH_ADDRESS"] for r in replicas(
        capsys, "--fleet", "PUBLISH_ADDRESS=10.0.0.5", gpu_count=2
    )}  # fmt: skip
    assert kept == "10.0.0.5"
    assert "GATEWAY" not in replicas(capsys)[0]["settings"]


@pytest.mark.parametrize(
    "args, gpu_count, message",
    [
        (["--gpus", "3"], 2, "asks for GPU 3; this host has 2"),
        (["--gpus", "1", "1"], 2, "each GPU once"),
        ([], 0, "no NVIDIA GPU visible"),
        (["CONTXT=4096"], 1, "did you mean CONTEXT?"),
        (["PUBLISH_PORT=65535"], 2, "would need port 65536"),
    ],
)  # fmt: skip
def test_replicas_that_cannot_be_deployed_get_one_line(capsys, args, gpu_count, message):
    code, out = ask(
        capsys, "fleet", "replicas", "--host", "box", "--dir", "/opt/ts",
        "--gpu-count", str(gpu_count), *args,
    )  # fmt: skip
    assert code == 1 and out is None
    assert message in ERRORS[-1]


def test_the_manifest_carries_each_replicas_planned_slots(capsys, tmp_path):
    envfile.write(tmp_path / ".env", {"SERVER_SLOTS": "4"})
    code, rows = ask(
        capsys, "fleet", "replicas", "--host", "box", "--dir", str(tmp_path), "--gpu-count", "2",
        "--manifest", "--address", "10.0.0.11",
    )  # fmt: skip
    assert code == 0
    assert [(r["name"], r["address"], r["slots"]) for r in rows] == [
        ("box-gpu0", "10.0.0.11", "4"),
        ("box-gpu1", "10.0.0.11", ""),  # not planned yet: no .env there
    ]
    assert rows[1]["port"] == rows[0]["port"] + 1
    assert {"project", "env_file", "state_dir"} <= set(rows[0])


def test_the_replicas_deployed_are_the_manifest_else_the_checkouts_one_project(capsys, tmp_path):
    """What a rollout and releases.yml walk through: replicas.json where the llm_stack role
    wrote one, else (a host set up with `make up`) the checkout itself, or the files named."""
    deployed = ("fleet", "deployed", "--host", "box", "--dir", str(tmp_path))
    code, alone = ask(capsys, *deployed)
    assert code == 0
    assert alone == [
        {"name": "box", "env_file": str(tmp_path / ".env"), "state_dir": str(tmp_path / "state")}
    ]
    code, named = ask(capsys, *deployed, "--env-file", "/srv/a.env", "--state-dir", "/srv/state")
    assert (named[0]["env_file"], named[0]["state_dir"]) == ("/srv/a.env", "/srv/state")
    code, rows = ask(
        capsys, "fleet", "replicas", "--host", "box", "--dir", str(tmp_path), "--gpu-count", "2",
        "--manifest", "--address", "10.0.0.11",
    )  # fmt: skip
    (tmp_path / "replicas.json").write_text(json.dumps(rows))
    code, found = ask(capsys, *deployed, "--env-file", "/srv/a.env")
    assert code == 0 and found == rows and len(found) == 2


def test_a_replicas_file_cut_by_a_crash_gets_one_line_naming_it(capsys, tmp_path):
    (tmp_path / "replicas.json").write_text('[{"name": "box-gpu0", "addr')
    code, out = ask(capsys, "fleet", "deployed", "--host", "box", "--dir", str(tmp_path))
    assert code == 1 and out is None
    assert str(tmp_path / "replicas.json") in ERRORS[-1] and len(ERRORS[-1].splitlines()) == 1


# --- release history, images, bundle-images ------------------------------------------------------


def release(capsys, tmp_path, *args: str) -> tuple[int, object]:
    return ask(
        capsys, "release", "--env-file", str(tmp_path / ".env"), "--state-dir", str(tmp_path),
        *args,
    )  # fmt: skip


def test_the_history_skips_a_line_cut_by_a_crash(capsys, tmp_path):
    (tmp_path / "releases.jsonl").write_text(
        '{"tag": "v1", "status": "live"}\n'
        '{"tag": "v2", "status": "live"}\n'
        '{"tag": "v3", "status": "sta'  # the deploy of v3 died mid-write
    )
    code, history = release(capsys, tmp_path, "history", "--json")
    assert code == 0
    assert history["live"] == "v2" and history["previous"] == "v1"
    assert [r["tag"] for r in history["records"]] == ["v1", "v2"]


def test_no_history_is_nothing_live(capsys, tmp_path):
    code, history = release(capsys, tmp_path, "history", "--json")
    assert code == 0 and history == {"live": None, "previous": None, "records": []}


def test_a_releases_images_are_every_image_under_its_tag(capsys, tmp_path):
    envfile.write(
        tmp_path / ".env",
        {"IMAGE_TAG": "t1", "SERVER_IMAGE": "s", "MODEL_INIT_IMAGE": "m", "SMOKE_IMAGE": "k",
         "GATEWAY_IMAGE": "g"},
    )  # fmt: skip
    code, found = release(capsys, tmp_path, "images", "--json")
    assert code == 0 and found["tag"] == "t1"
    assert found["images"] == ["s:t1", "m:t1", "k:t1", "g:t1"]
    code, other = release(capsys, tmp_path, "images", "t2", "--json")
    assert other["tag"] == "t2" and all(image.endswith(":t2") for image in other["images"])


@pytest.mark.parametrize(
    "profiles, services",
    [("gateway", ["llama-server", "gateway"]), ("", ["llama-server"])],
)
def test_a_release_keeps_the_gateway_running_only_where_its_profile_is_on(
    capsys, tmp_path, profiles, services
):
    values = settings.resolve({}, {"GATEWAY": "on" if profiles else "off", "REVISION": "r"})
    env = config.compose_env(versions.load_versions(), values, tmp_path)
    assert env["COMPOSE_PROFILES"] == profiles  # what Compose starts with `up`
    envfile.write(tmp_path / ".env", env)
    code, found = release(capsys, tmp_path, "images", "--json")
    assert code == 0 and found["services"] == services


def test_images_without_a_rendered_env_file_are_refused(capsys, tmp_path):
    code, found = release(capsys, tmp_path, "images", "--json")
    assert code == 1 and found is None
    assert "make config" in ERRORS[-1]


def write_bundle(path: Path, manifest: object) -> Path:
    data = json.dumps(manifest).encode()
    with tarfile.open(path, "w") as archive:
        member = tarfile.TarInfo("manifest.json")
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    return path


def test_a_bundles_images_by_id_in_either_layout_docker_save_writes(capsys, tmp_path):
    a, b = "a" * 64, "0123456789abcdef" * 4
    bundle = write_bundle(
        tmp_path / "bundle.tar",
        [
            {"Config": f"{a}.json", "RepoTags": ["local/server:t1"]},  # docker save before 25
            {"Config": f"blobs/sha256/{b}", "RepoTags": ["local/smoke:t1", "local/smoke:x"]},
        ],
    )
    code, found = release(
        capsys, tmp_path, "bundle-images", "t1", "--bundle", str(bundle), "--json"
    )
    assert code == 0 and found["found"] and found["bundle"] == str(bundle)
    assert found["images"] == {"local/server:t1": f"sha256:{a}", "local/smoke:t1": f"sha256:{b}"}


def test_without_a_bundle_named_the_tags_own_is_used_where_it_was_made(capsys, tmp_path):
    """`make images-bundle` leaves build/ternary-serve-images-TAG.tar (docs/operations.md): the
    roles ship that one when given none, and ship nothing (build on the host, or stop a
    rollout) while it is not there."""
    tag = f"test-answers-{os.getpid()}"
    made = versions.PROJECT_ROOT / "build" / f"ternary-serve-images-{tag}.tar"
    code, missing = release(capsys, tmp_path, "bundle-images", tag, "--json")
    assert code == 0 and missing == {"bundle": str(made), "found": False, "images": {}}
    made.parent.mkdir(exist_ok=True)
    try:
        write_bundle(made, [{"Config": f"{'c' * 64}.json", "RepoTags": [f"local/server:{tag}"]}])
        code, found = release(capsys, tmp_path, "bundle-images", tag, "--json")
    finally:
        made.unlink()
    assert code == 0 and found["found"]
    assert found["images"] == {f"local/server:{tag}": f"sha256:{'c' * 64}"}


@pytest.mark.parametrize("manifest", [[], [{"Config": "no-id", "RepoTags": ["x:t"]}], None])
def test_a_bundle_that_is_not_one_is_refused(capsys, tmp_path, manifest):
    path = tmp_path / "bundle.tar"
    if manifest is None:
        path.write_text("not a tar archive")
    else:
        write_bundle(path, manifest)
    code, found = release(capsys, tmp_path, "bundle-images", "t1", "--bundle", str(path), "--json")
    assert code == 1 and found is None
    assert str(path) in ERRORS[-1]


# --- config --revision, --model-size -------------------------------------------------------------


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    git(tmp_path, "init", "-q")
    (tmp_path / "file").write_text("one\n")
    git(tmp_path, "add", "file")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return tmp_path


def test_the_revision_is_the_commit_and_dirty_when_a_tracked_file_changed(capsys, repo):
    commit = git(repo, "rev-parse", "--short=7", "HEAD")
    assert ask(capsys, "config", "--revision", "--project-dir", str(repo)) == (
        0, {"revision": commit}
    )  # fmt: skip
    (repo / "untracked").write_text("not part of the build's tree\n")
    assert ask(capsys, "config", "--revision", "--project-dir", str(repo))[1]["revision"] == commit
    (repo / "file").write_text("two\n")
    assert ask(capsys, "config", "--revision", "--project-dir", str(repo)) == (
        0, {"revision": f"{commit}-dirty"}
    )  # fmt: skip


def test_the_revision_outside_a_checkout_is_unknown(capsys, tmp_path):
    assert ask(capsys, "config", "--revision", "--project-dir", str(tmp_path))[1] == {
        "revision": "unknown"
    }


def test_the_model_size_is_the_catalogs_for_a_catalog_name(capsys):
    models = catalog.load_catalog()
    name, entry = next((n, e) for n, e in models.models.items() if e.size_bytes)
    code, size = ask(capsys, "config", "--model-size", f"MODEL_SOURCE={name}")
    assert code == 0 and size == {
        "model_source": name,
        "bytes": entry.size_bytes,
        "from": "catalog",
    }


def test_a_source_the_catalog_does_not_size_counts_as_its_largest_model():
    models = catalog.Catalog(
        {
            "small": catalog.CatalogEntry("small", "hf://o/r/s.gguf", "mainline", size_bytes=10),
            "big": catalog.CatalogEntry("big", "hf://o/r/b.gguf", "mainline", size_bytes=30),
            "unsized": catalog.CatalogEntry("unsized", "hf://o/r/u.gguf", "mainline"),
        }
    )
    for source in ("https://example.org/m.gguf", "unsized", ""):
        values = settings.resolve({}, {"MODEL_SOURCE": source})
        assert config.model_size(values, models)["bytes"] == 30, source
    assert config.model_size(settings.resolve({}, {}), catalog.Catalog())["bytes"] is None


def test_no_size_at_all_is_refused_rather_than_guessed(capsys, monkeypatch):
    monkeypatch.setattr(catalog, "load_catalog", catalog.Catalog)
    code, size = ask(capsys, "config", "--model-size", "MODEL_SOURCE=https://example.org/m.gguf")
    assert code == 1 and size is None
    assert "no size known" in ERRORS[-1]


def test_the_settings_check_refuses_a_mistyped_model_with_the_catalogs_names(capsys):
    """site.yml's first pre-task and the role's preflight: before anything on a host changes."""
    assert ask(capsys, "config", "--check", "MODEL_SOURCE=bonsai-2-27b-pq2_0", "CONTEXT=4096") == (
        0, None
    )  # fmt: skip
    for answer in ("--check", "--model-size"):
        code, out = ask(capsys, "config", answer, "MODEL_SOURCE=bonsai-27b")
        assert code == 1 and out is None
        said = ERRORS[-1].strip()
        assert said.startswith("config: bonsai-27b is not a model in models.yaml"), said
        assert len(said.splitlines()) == 1, said
        assert all(name in said for name in catalog.load_catalog().models), said
    for wrong, message in (("TLS_CERT=/c.pem", "TLS_CERT and TLS_KEY go together"),
                           ("SLOTS=0", "SLOTS=0: a whole number")):  # fmt: skip
        assert ask(capsys, "config", "--check", wrong) == (1, None)
        assert message in ERRORS[-1]


def test_a_wrong_setting_gets_no_model_size(capsys):
    code, size = ask(capsys, "config", "--model-size", "CONTXT=1")
    assert code == 1 and size is None
    assert "did you mean CONTEXT?" in ERRORS[-1]
