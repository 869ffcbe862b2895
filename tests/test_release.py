"""Releases on the real stack: deploy, automatic rollback, manual rollback, the lock, a killed
deploy, unknown tags, retention and the quality gate. Which release is live is read over HTTP, not
from our files.

Each release image is the built server image with `--alias release-vN` on its command line (a
flag beats its LLAMA_ARG_ twin), so /v1/models names the release that answers. v3 is broken: an
unknown flag makes llama-server exit at start, as a release with a bad server flag would.
`standin-right` and `standin-wrong` replace llama-server with tests/standin_server.py (named as a
stand-in there): no model that can answer questions runs here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest
from harness import configure, release_whose_server_is

from ternary_serve import errors, release
from ternary_serve.versions import PROJECT_ROOT
from ternary_serve.weights import SYNTHETIC_MARKER

pytestmark = pytest.mark.docker

WAIT = 120


def remove_releases(client, built, tags) -> None:
    for tag in tags:
        for repo in release.release_images(built.env):
            with contextlib.suppress(docker.errors.ImageNotFound):
                client.images.remove(f"{repo}:{tag}")


@pytest.fixture(scope="module")
def tags(built, tmp_path_factory):
    """Release tags v1..v4 of the release's images; v3's server refuses to start."""
    client = docker.from_env()
    made = {}
    for name in ("v1", "v2", "v3", "v4"):
        args = ["--no-such-flag"] if name == "v3" else ["--alias", f"release-{name}"]
        entrypoint = json.dumps(["/usr/local/bin/llama-server", *args])
        made[name] = release_whose_server_is(
            built,
            f"test-release-{name}",
            tmp_path_factory.mktemp(name),
            f"ENTRYPOINT {entrypoint}\n",
        )
    yield made
    remove_releases(client, built, made.values())


@pytest.fixture(scope="module")
def standin_tags(built, tmp_path_factory):
    """Releases whose server is the stand-in: `right` answers the gate, `wrong` does not; `slow`
    answers as `right` does and reports a tenth of its decode rate in its timings."""
    client = docker.from_env()
    made = {}
    for name, mode, rate in (
        ("right", "right", 200),
        ("wrong", "wrong", 200),
        ("slow", "right", 20),
    ):
        context = tmp_path_factory.mktemp(name)
        shutil.copy(Path(__file__).with_name("standin_server.py"), context)
        made[name] = release_whose_server_is(
            built,
            f"test-standin-{name}",
            context,
            "COPY standin_server.py /opt/standin_server.py\n"
            f"ENV STANDIN_DECODE_PER_SECOND={rate}\n"
            f'ENTRYPOINT ["python3", "/opt/standin_server.py", "{mode}"]\n',
        )
    yield made
    remove_releases(client, built, made.values())


@pytest.fixture
def project(built, tiny_model, tmp_path, request):
    name = "tr-" + request.node.name.lower().replace("_", "-")[:30].strip("-")
    stack = configure(tmp_path / "stack", tiny_model, name)
    yield stack, release.Project(stack.workdir / ".env", stack.workdir)
    stack.down()


def serving(stack) -> str:
    """The release that answers on the published port, by its alias."""
    models = stack.api().get(f"{stack.url}/v1/models", timeout=10).json()
    return models["data"][0]["id"]


def chat_ok(stack) -> bool:
    reply = stack.api().post(
        f"{stack.url}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    return reply.status_code == 200


def test_failed_deploy_rolls_back_and_rollback_by_tag(project, tags):
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    assert serving(stack) == "release-v1"
    release.deploy(proj, tags["v2"], wait_timeout=WAIT)
    assert serving(stack) == "release-v2"

    with pytest.raises(release.ReleaseError) as failed:
        release.deploy(proj, tags["v3"], wait_timeout=WAIT)
    assert f"rolled back: {tags['v2']} is live" in str(failed.value)
    assert serving(stack) == "release-v2" and chat_ok(stack)
    assert proj.env()["IMAGE_TAG"] == tags["v2"]

    history = release.read_history(proj)
    assert [r["tag"] for r in history if r["status"] == "live"] == [
        tags["v1"],
        tags["v2"],
        tags["v2"],
    ]
    assert any(r["tag"] == tags["v3"] and r["status"] == "failed" for r in history)
    table = release.format_history(history, release.running(proj.env()))
    assert tags["v3"] in table and "failed" in table
    live_rows = [line for line in table.splitlines() if line.startswith("*")]
    assert len(live_rows) == 1 and tags["v2"] in live_rows[0]
    assert table.splitlines()[-1].startswith(f"running now: {tags['v2']} (running, healthy)")

    release.rollback(proj, tags["v1"], wait_timeout=WAIT)
    assert serving(stack) == "release-v1"
    release.rollback(proj, wait_timeout=WAIT)  # the previous good one: v2
    assert serving(stack) == "release-v2"

    # Stopped behind the history's back (`make down`): the list says so, no `*`.
    stack.compose("stop", "llama-server", timeout=120)
    table = release.format_history(release.read_history(proj), release.running(proj.env()))
    assert not [line for line in table.splitlines() if line.startswith("*")]
    assert [line for line in table.splitlines() if line.startswith("!")]
    assert f"the history's live release {tags['v2']} is not running" in table.splitlines()[-1]


def test_bad_model_config_is_refused_and_the_live_release_keeps_serving(
    project, tags, tiny_model, tmp_path
):
    """A truncated model: `make config` refuses it; one that turns bad after config makes the
    deploy refuse before any change."""
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    truncated = tiny_model.parent / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[:50_000])
    truncated.chmod(0o644)
    env_before = proj.env_file.read_bytes()
    with pytest.raises(errors.ServeError, match="truncated.gguf is truncated or corrupt"):
        configure(stack.workdir, truncated, stack.name, PUBLISH_PORT=stack.env["PUBLISH_PORT"])
    assert proj.env_file.read_bytes() == env_before
    # Configured while the file was still arriving, then found damaged by the deploy.
    truncated.unlink()
    configure(stack.workdir, truncated, stack.name, PUBLISH_PORT=stack.env["PUBLISH_PORT"])
    truncated.write_bytes(tiny_model.read_bytes()[:50_000])
    truncated.chmod(0o644)
    env_before = proj.env_file.read_bytes()
    with pytest.raises(release.ReleaseError) as refused:
        release.deploy(proj, tags["v2"], wait_timeout=WAIT)
    message = str(refused.value)
    assert "refused before any change" in message and "truncated" in message
    assert f"{tags['v1']} is still live" in message
    assert serving(stack) == "release-v1" and chat_ok(stack)
    assert proj.env_file.read_bytes() == env_before
    history = release.read_history(proj)
    assert history[-1]["status"] == "refused"
    assert release.current_live(history) == tags["v1"]


def test_a_server_flag_the_engine_does_not_read_is_refused_before_any_change(
    project, tags, tiny_model
):
    """llama-server ignores an LLAMA_ARG_* name it does not know: SERVER_EXTRA is checked against
    the release's own `llama-server --help`; only the unknown name is refused, one line."""
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    configure(
        stack.workdir, tiny_model, stack.name, PUBLISH_PORT=stack.env["PUBLISH_PORT"],
        SERVER_EXTRA="LLAMA_ARG_THREADS=2 LLAMA_ARG_SPECULATIVE_WISHES=1",
    )  # fmt: skip
    with pytest.raises(release.ReleaseError) as refused:
        release.deploy(proj, tags["v2"], wait_timeout=WAIT)
    message = str(refused.value)
    assert "refused before any change: SERVER_EXTRA sets LLAMA_ARG_SPECULATIVE_WISHES," in message
    assert "LLAMA_ARG_THREADS" not in message.split("does not read")[0].replace(
        "LLAMA_ARG_SPECULATIVE_WISHES", ""
    )
    assert f"{tags['v1']} is still live" in message and "\n" not in message
    assert serving(stack) == "release-v1" and chat_ok(stack)
    assert release.read_history(proj)[-1]["status"] == "refused"


def test_unknown_tag_is_refused_before_anything_changes(project, tags):
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    env_before = proj.env_file.read_bytes()
    history_before = proj.history_file.read_bytes()
    with pytest.raises(release.ReleaseError, match="unknown tag 'no-such-tag'"):
        release.deploy(proj, "no-such-tag", wait_timeout=WAIT)
    assert proj.env_file.read_bytes() == env_before
    assert proj.history_file.read_bytes() == history_before
    assert serving(stack) == "release-v1"


def cli(proj, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ternary_serve.cli",
        "release",
        "--env-file",
        str(proj.env_file),
        "--state-dir",
        str(proj.state_dir),
        "--wait-timeout",
        str(WAIT),
        *args,
    ]


def wait_until_started(proj, timeout: float = 30) -> None:
    """Until the deploy running in another process has recorded its start."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        history = release.read_history(proj)
        if history and history[-1]["status"] == "started":
            return
        time.sleep(0.05)
    pytest.fail("the deploy never recorded its start")


def test_second_deploy_is_refused_while_one_runs(project, tags):
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    env_before = proj.env_file.read_bytes()
    first = subprocess.Popen(
        cli(proj, "deploy", tags["v2"]),
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_until_started(proj)
        # Held mid-deploy (lock taken, not yet done) while the second one tries: however slowly
        # the second process starts, the first cannot have finished.
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = subprocess.run(
                cli(proj, "deploy", tags["v4"]), cwd=PROJECT_ROOT, capture_output=True, text=True
            )
        finally:
            os.kill(first.pid, signal.SIGCONT)
        assert second.returncode == 1
        assert "another deploy is running (pid" in second.stderr
        assert f"IMAGE_TAG={tags['v4']}".encode() not in proj.env_file.read_bytes()
    finally:
        code = first.wait(timeout=300)
        output = first.stdout.read()
        assert code == 0, output
    assert env_before != proj.env_file.read_bytes()
    assert serving(stack) == "release-v2"
    # The deploy ends saying where the endpoint is and how to stop it.
    assert f"the API is at http://127.0.0.1:{stack.env['PUBLISH_PORT']}/v1" in output
    assert "`make down` stops it" in output


def test_killed_deploy_leaves_a_consistent_state_and_the_next_deploy_succeeds(project, tags):
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    victim = subprocess.Popen(
        cli(proj, "deploy", tags["v2"]),
        cwd=PROJECT_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_until_started(proj)
    time.sleep(1)  # into `docker compose up`
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()

    assert proj.env()["IMAGE_TAG"] in (tags["v1"], tags["v2"])  # whole, one or the other
    for line in proj.history_file.read_text().splitlines():
        json.loads(line)
    release.deploy(proj, tags["v2"], wait_timeout=WAIT)
    assert serving(stack) == "release-v2" and chat_ok(stack)
    statuses = [r["status"] for r in release.read_history(proj)]
    assert "interrupted" in statuses and statuses[-1] == "live"


def test_a_deploy_killed_mid_recreate_does_not_block_the_next_one(project, tags):
    """What a deploy killed between Compose's create and remove leaves (the killed-deploy test
    above hits it only when the kill lands there): the old server's successor, created under
    Compose's temporary name and never started."""
    stack, proj = project
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)
    (live,) = release.containers(docker.from_env(), proj.env(), "llama-server")
    leftover = docker.from_env().containers.create(
        live.image.id, name=f"{live.id[:12]}_{live.name}", labels=live.labels
    )
    release.deploy(proj, tags["v2"], wait_timeout=WAIT)
    assert serving(stack) == "release-v2" and chat_ok(stack)
    with pytest.raises(docker.errors.NotFound):
        leftover.reload()


def test_retention_keeps_the_newest_and_never_the_live_or_previous(project, tags, built):
    stack, proj = project
    client = docker.from_env()
    server = built.env["SERVER_IMAGE"]
    # Tags of its own, so pruning them leaves the shared release tags to the other tests.
    retained = {}
    for name in ("v1", "v2", "v4"):
        retained[name] = f"test-retain-{name}"
        for repo in release.release_images(built.env):
            client.images.get(f"{repo}:{tags[name]}").tag(repo, retained[name])
    try:
        for name in ("v1", "v2", "v4"):
            release.deploy(proj, retained[name], wait_timeout=WAIT, keep=1)
        present = {tag for tag in retained.values() if client.images.list(name=f"{server}:{tag}")}
        assert present == {retained["v2"], retained["v4"]}  # v4 live, v2 previous; v1 pruned
        assert serving(stack) == "release-v4"
    finally:
        for tag in retained.values():
            for repo in release.release_images(built.env):
                with contextlib.suppress(docker.errors.ImageNotFound):
                    client.images.remove(f"{repo}:{tag}")


def run_playbook(proj, playbook: str, *extra: str, inventory) -> subprocess.CompletedProcess:
    """The real ansible-playbook against this host over the local connection."""
    inventory.write_text(
        "[llm_servers]\n"
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ansible-playbook"),
        "-i",
        str(inventory),
        f"ansible/{playbook}",
        "-e",
        "ansible_become=false",
        "-e",
        f"ternary_serve_dir={PROJECT_ROOT}",
        "-e",
        f"ternary_serve_env_file={proj.env_file}",
        "-e",
        f"ternary_serve_state_dir={proj.state_dir}",
        *extra,
    ]
    return subprocess.run(cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=600)


def test_ansible_playbooks_use_the_same_release_path(project, tags, tmp_path):
    stack, proj = project
    inventory = tmp_path / "inventory"
    release.deploy(proj, tags["v1"], wait_timeout=WAIT)

    deployed = run_playbook(
        proj, "deploy.yml", "-e", f"release_tag={tags['v2']}", inventory=inventory
    )
    assert deployed.returncode == 0, deployed.stdout[-3000:]
    assert serving(stack) == "release-v2"

    checked = run_playbook(proj, "rollback.yml", "--check", inventory=inventory)
    assert checked.returncode == 0, checked.stdout[-3000:]
    assert serving(stack) == "release-v2"  # check mode changes nothing

    rolled = run_playbook(proj, "rollback.yml", inventory=inventory)
    assert rolled.returncode == 0, rolled.stdout[-3000:]
    assert "changed=1" in rolled.stdout
    assert serving(stack) == "release-v1"

    failed = run_playbook(
        proj, "deploy.yml", "-e", f"release_tag={tags['v3']}", inventory=inventory
    )
    assert failed.returncode != 0
    assert f"rolled back: {tags['v1']} is live" in failed.stdout
    assert serving(stack) == "release-v1"

    bad = run_playbook(
        proj, "rollback.yml", "-e", json.dumps({"release_tag": "not a tag!"}), inventory=inventory
    )
    assert bad.returncode != 0 and "release_tag (optional) a Docker image tag" in bad.stdout


def test_quality_gate_keeps_gibberish_and_wrong_answers_from_staying_live(
    standin_tags, tags, tiny_model, tmp_path
):
    """A deploy that streams fine but answers wrongly or in gibberish is rolled back.

    The model is the tiny one with its synthetic marker removed, so the gate applies (the default
    `chat` questions). The real llama-server on it streams random-weight gibberish, as stock
    llama.cpp does on Bonsai 2's fork-packed file; the wrong-answer server is a stand-in.
    """
    model = tmp_path / "models" / "unmarked.gguf"
    model.parent.mkdir()
    editor = Path(sys.executable).with_name("gguf-new-metadata")
    subprocess.run(
        [editor, "--force", "--remove-metadata", SYNTHETIC_MARKER, tiny_model, model],
        check=True,
        capture_output=True,
    )
    stack = configure(tmp_path / "stack", model, "tr-quality-gate")
    proj = release.Project(stack.workdir / ".env", stack.workdir)
    try:
        release.deploy(proj, standin_tags["right"], wait_timeout=WAIT)
        assert serving(stack) == "standin-right"
        for tag, check in ((tags["v1"], "capital-en"), (standin_tags["wrong"], "capital-en")):
            with pytest.raises(release.ReleaseError) as failed:
                release.deploy(proj, tag, wait_timeout=WAIT)
            message = str(failed.value)
            assert f"smoke test failed: smoke: FAIL: quality[{check}]: expected 'Paris'" in message
            assert f"rolled back: {standin_tags['right']} is live" in message
            assert serving(stack) == "standin-right"
        statuses = [(r["tag"], r["status"]) for r in release.read_history(proj)]
        assert (tags["v1"], "failed") in statuses and (standin_tags["wrong"], "failed") in statuses
    finally:
        stack.down()


def test_decode_gate_keeps_a_slower_release_from_staying_live(standin_tags, tiny_model, tmp_path):
    """DECODE_GATE: after the smoke test a short benchmark measures the new release's decode rate
    from the server's own timings; under the set share of the rate recorded for the release it
    replaces, the deploy fails and rolls back. Stand-in servers report the rates (200 and 20
    tokens/s): the gate's arithmetic and the rollback are what this shows, not a real engine's
    speed (`make bench` on the GPU box measures that)."""
    right, slow = standin_tags["right"], standin_tags["slow"]
    stack = configure(tmp_path / "stack", tiny_model, "tr-decode-gate", DECODE_GATE="80")
    proj = release.Project(stack.workdir / ".env", stack.workdir)
    try:
        release.deploy(proj, right, wait_timeout=WAIT)
        assert release.recorded_rate(release.read_history(proj), right) == 200.0
        with pytest.raises(release.ReleaseError) as failed:
            release.deploy(proj, slow, wait_timeout=WAIT)
        message = str(failed.value)
        assert f"decodes 20.0 tokens/s, under 80% of the 200.0 recorded for {right}" in message
        assert f"rolled back: {right} is live" in message
        assert proj.env()["IMAGE_TAG"] == right and chat_ok(stack)
        failed_record = release.read_history(proj)[-2]
        assert (failed_record["tag"], failed_record["status"]) == (slow, "failed")
        assert failed_record["smoke"] == "pass" and failed_record["decode_tokens_per_s"] == 20.0

        # The operator's call: a lower gate lets the same release go live, its rate recorded.
        port = stack.env["PUBLISH_PORT"]
        configure(stack.workdir, tiny_model, stack.name, DECODE_GATE="5", PUBLISH_PORT=port)
        release.deploy(proj, slow, wait_timeout=WAIT)
        history = release.read_history(proj)
        assert release.current_live(history) == slow
        table = release.format_history(history, release.running(proj.env()))
        live_row = next(line for line in table.splitlines() if line.startswith("*"))
        assert slow in live_row and " 20.0 " in live_row
    finally:
        stack.down()
