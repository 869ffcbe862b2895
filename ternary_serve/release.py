"""Releases: deploy an image tag, keep it only if it passes health and smoke, roll back otherwise.

A release is an image tag (ternary_serve.config.image_tag) present locally for both the server and
the smoke image. The history is an append-only JSON-lines file in the state directory, fsynced per
line and never truncated: it alone says what is live and what was good before. A lock file
(flock, released by the kernel if the holder dies) keeps two deploys from running at once.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import subprocess
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import docker
import docker.errors
import requests

from ternary_serve import client, config, credentials, dockerd, envfile, errors, probe, settings
from ternary_serve.versions import PROJECT_ROOT

HISTORY_FILE = "releases.jsonl"
LOCK_FILE = "deploy.lock"
KEEP_RELEASES = 5
WAIT_TIMEOUT_S = 900
RESTART_POLL_S = 2
COMPOSE_PREFIX = re.compile(r"^[\w.-]+\s+\| ")
HALF_RECREATED = re.compile(r"^[0-9a-f]{12}_")


class ReleaseError(errors.ServeError):
    """A deploy step that failed or was refused; the message says what and what to do."""


@dataclass
class Project:
    """One deployed stack: its Compose env file and its state directory (history, lock)."""

    env_file: Path
    state_dir: Path

    @property
    def history_file(self) -> Path:
        return self.state_dir / HISTORY_FILE

    def env(self) -> dict[str, str]:
        if not self.env_file.is_file():
            raise ReleaseError(f"{self.env_file} does not exist: run `make config` first")
        return envfile.read(self.env_file)

    def set_tag(self, tag: str) -> None:
        """Point Compose at tag: the env file is rewritten in one rename, never half-written."""
        envfile.write(self.env_file, {**self.env(), "IMAGE_TAG": tag}, config.ENV_HEADER)

    def command(self, *args: str, tag: str | None = None) -> tuple[list[str], dict | None]:
        """docker compose on this project, and its environment: tag runs it for another release,
        .env unchanged (the shell beats .env)."""
        env = {**os.environ, "IMAGE_TAG": tag} if tag else None
        return ["docker", "compose", "--env-file", str(self.env_file), *args], env

    def compose(
        self, *args: str, timeout: float = WAIT_TIMEOUT_S + 60, tag: str | None = None
    ) -> subprocess.CompletedProcess:
        """docker compose ARGS; a failure because Docker does not answer is DockerUnreachable."""
        cmd, env = self.command(*args, tag=tag)
        result = subprocess.run(
            cmd, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout, env=env
        )
        if result.returncode != 0:
            dockerd.answers()
        return result


# --- history -------------------------------------------------------------------------------------


def read_history(project: Project) -> list[dict]:
    if not project.history_file.is_file():
        return []
    records = []
    for line in project.history_file.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash mid-write is skipped, never rewritten
    return records


def append_history(project: Project, **record) -> dict:
    record = {"at": datetime.now(timezone.utc).isoformat(timespec="seconds"), **record}
    project.state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(project.history_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return record


def live_tags(history: list[dict]) -> list[str]:
    """Tags that went live, oldest first (a tag appears once per time it went live)."""
    return [r["tag"] for r in history if r.get("status") == "live"]


def current_live(history: list[dict]) -> str | None:
    tags = live_tags(history)
    return tags[-1] if tags else None


def previous_good(history: list[dict]) -> str | None:
    """The last tag that was live before the current one, and is a different tag."""
    tags = live_tags(history)
    for tag in reversed(tags[:-1]):
        if tag != tags[-1]:
            return tag
    return None


# --- images --------------------------------------------------------------------------------------


def release_images(env: dict[str, str]) -> list[str]:
    """The image repositories one release tag spans."""
    return [
        env[key] for key in ("SERVER_IMAGE", "MODEL_INIT_IMAGE", "SMOKE_IMAGE", "GATEWAY_IMAGE")
    ]


def require_images(engine: docker.DockerClient, env: dict[str, str], tag: str) -> None:
    for repo in release_images(env):
        try:
            engine.images.get(f"{repo}:{tag}")
        except docker.errors.ImageNotFound:
            raise ReleaseError(
                f"unknown tag {tag!r}: no local image {repo}:{tag}; `make releases` lists the "
                "deployable tags, `make release` builds one"
            ) from None


def bundle_path(tag: str) -> Path:
    return PROJECT_ROOT / "build" / f"ternary-serve-images-{tag}.tar"


def bundle(env: dict[str, str], tag: str, out: Path) -> str:
    """The release's images in one `docker save` archive: what the Ansible role loads on a host
    that has no registry, or should not build (a second box, an offline one)."""
    engine = dockerd.client()
    require_images(engine, env, tag)
    names = tagged_images(env, tag)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    print(f"release: saving {len(names)} images of {tag} to {out} (a few GB)", flush=True)
    result = subprocess.run(
        ["docker", "save", "-o", str(partial), *names], capture_output=True, text=True
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        dockerd.answers()
        detail = (result.stderr.strip().splitlines() or ["docker save failed"])[-1]
        raise ReleaseError(f"bundle of {tag} not written ({detail}): free space under {out.parent}")
    partial.rename(out)  # never a half-written bundle under the final name
    return f"bundle: {out} ({out.stat().st_size / 2**30:.1f} GiB): {', '.join(names)}"


def prune(
    engine: docker.DockerClient, env: dict[str, str], history: list[dict], keep: int
) -> list[str]:
    """Remove release images beyond the newest `keep` deployed tags; never live or previous."""
    newest_first: list[str] = []
    for tag in reversed([r["tag"] for r in history if r.get("tag")]):
        if tag not in newest_first:
            newest_first.append(tag)
    protected = set(newest_first[:keep]) | {current_live(history), previous_good(history)}
    removed = []
    for tag in newest_first[keep:]:
        if tag in protected:
            continue
        for repo in release_images(env):
            with contextlib.suppress(docker.errors.ImageNotFound):
                engine.images.remove(f"{repo}:{tag}")
        removed.append(tag)
    return removed


def model_manifest_hash(env: dict[str, str]) -> str | None:
    """SHA-256 of the model's manifest (written by the weights tools), if there is one."""
    manifest = Path(env.get("MODEL_DIR", "")) / f"{env.get('MODEL_FILE', '')}.manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None


# --- deploy --------------------------------------------------------------------------------------


@contextlib.contextmanager
def deploy_lock(project: Project):
    project.state_dir.mkdir(parents=True, exist_ok=True)
    with open(project.state_dir / LOCK_FILE, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            raise ReleaseError(
                f"another deploy is running ({holder}): wait for it to finish"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()} since {datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}\n")
        fh.flush()
        yield


def last_line(result: subprocess.CompletedProcess) -> str:
    """The line that says why, from a one-shot container's output (less Compose's log prefix)."""
    lines = (result.stdout + result.stderr).strip().splitlines()
    return COMPOSE_PREFIX.sub("", lines[-1]).strip() if lines else "no output"


def serving_services(env: dict[str, str]) -> list[str]:
    """The long-running services: the server, and the gateway in front of it when it is on."""
    return ["llama-server", *(["gateway"] if client.gateway(env) else [])]


def containers(engine: docker.DockerClient, env: dict[str, str], *services: str) -> list:
    """This project's containers, running or not (of the given services only, if any)."""
    found = engine.containers.list(
        all=True,
        filters={"label": f"com.docker.compose.project={env['COMPOSE_PROJECT_NAME']}"},
        ignore_removed=True,  # Compose replaces containers while this looks
    )
    return [c for c in found if not services or c.labels["com.docker.compose.service"] in services]


def remove_half_recreated(engine: docker.DockerClient, env: dict[str, str]) -> None:
    """Compose recreates a container by creating its successor as `<old ID's first 12>_<name>`,
    then removing the old one and renaming the successor: a deploy killed before the old one is
    gone leaves the successor created and never started, and the next `up`, recreating the old
    one again under the same name, fails on "name already in use"."""
    for container in containers(engine, env):
        if container.status != "running" and HALF_RECREATED.match(container.name):
            container.remove(force=True)


def docker_time(stamp: str) -> datetime:
    """A Docker timestamp (RFC 3339, nanoseconds with trailing zeros trimmed, Z), in a form
    Python 3.10's fromisoformat takes (Ubuntu 22.04's Python runs this on the hosts)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return datetime.fromisoformat(f"{whole}.{fraction[:6]:0<6}+00:00")


def restarted(
    engine: docker.DockerClient, env: dict[str, str], services: list[str], before: dict[str, int]
) -> str | None:
    """Which of services restarted since before (restart counts by container ID), and why: its
    exit code and the last lines its previous run wrote."""
    for container in containers(engine, env, *services):
        if container.attrs["RestartCount"] > before.get(container.id, 0):
            state = container.attrs["State"]
            service = container.labels["com.docker.compose.service"]
            return (
                f"{service} restarted (exit code {state['ExitCode']}; "
                f"before that: {last_words(container, state)})"
            )
    return None


def last_words(container, state: dict) -> str:
    """The last lines the container's previous run wrote (the liveness probe writes its kill's
    reason there too), never empty. Docker counts the restart before the new run starts: until
    then, StartedAt is still the previous run's and the whole log is the previous run's."""
    started = docker_time(state["StartedAt"])
    new_run = state["Running"] and started >= docker_time(state["FinishedAt"])
    logs = container.logs(until=started.timestamp()) if new_run else container.logs()
    lines = [line.strip() for line in logs.decode(errors="replace").splitlines() if line.strip()]
    if lines:
        return " | ".join(lines[-3:])
    health = (state.get("Health") or {}).get("Log") or []
    if health and health[-1].get("Output", "").strip():
        return f"its last health check said: {health[-1]['Output'].strip().splitlines()[-1]}"
    return "it wrote nothing"


def start(project: Project, services: list[str], wait_timeout: int, recreate: bool) -> str | None:
    """`compose up --wait` on services: None once they are healthy, else why not (one line). A
    container that restarts meanwhile ends the wait at once: a server that crashes, or that its
    liveness check kills, comes back `starting`, and Compose would wait out the whole timeout."""
    engine = dockerd.client()
    env = project.env()
    remove_half_recreated(engine, env)
    before = {c.id: c.attrs["RestartCount"] for c in containers(engine, env, *services)}
    cmd, shell_env = project.command(
        "up",
        "-d",
        "--wait",
        "--wait-timeout",
        str(wait_timeout),
        *(["--force-recreate"] if recreate else []),
        *services,
    )
    deadline = time.monotonic() + wait_timeout + 120
    with subprocess.Popen(
        cmd,
        cwd=PROJECT_ROOT,
        env=shell_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as up:
        while True:
            try:
                _, err = up.communicate(timeout=RESTART_POLL_S)
                break
            except subprocess.TimeoutExpired:
                why = restarted(engine, env, services, before)
                if why is None and time.monotonic() < deadline:
                    continue
                up.terminate()
                up.communicate()
                return why or f"docker compose up did not return within {wait_timeout + 120} s"
    if up.returncode == 0:
        return None
    dockerd.answers()
    detail = (err.strip().splitlines() or ["no output"])[-1]
    logs = project.compose("logs", "--no-color", "--tail", "5", "model-init", *services)
    hint = " | ".join(line.split("|", 1)[-1].strip() for line in logs.stdout.splitlines()[-3:])
    return detail + (f" (last log lines: {hint})" if hint else "")


def bring_up(project: Project, tag: str, wait_timeout: int, recreate: bool = False) -> str | None:
    """Start tag and smoke test it. Returns None on success, else what failed (one line).
    recreate: new containers even where nothing in their configuration changed (a new key)."""
    project.set_tag(tag)
    detail = start(project, serving_services(project.env()), wait_timeout, recreate)
    if detail is not None:
        return f"not healthy: {detail}"
    smoke = project.compose("run", "--rm", "--no-deps", "smoke", timeout=600)
    if smoke.returncode != 0:
        return f"smoke test failed: {last_line(smoke)}"
    print(smoke.stdout.rstrip(), flush=True)  # the TTFT / decode table
    return None


def recorded_rate(history: list[dict], tag: str | None) -> float | None:
    """The decode rate the gate recorded when tag last went live here (None: never measured)."""
    for record in reversed(history):
        live = record.get("tag") == tag and record.get("status") == "live"
        if live and record.get("decode_tokens_per_s"):
            return record["decode_tokens_per_s"]
    return None


def decode_gate(
    env: dict[str, str], gate: int, baseline: tuple[str, float] | None
) -> tuple[float | None, str | None]:
    """The live server's decode rate, and what is wrong with it (None: nothing): under gate % of
    the baseline release's recorded rate, or not measurable."""
    try:
        rate = probe.decode_rate(client.Endpoint.of(env))
    except (probe.ProbeError, requests.RequestException) as exc:
        return None, f"decode benchmark failed: {exc}"
    if baseline is None:
        print(f"decode gate: {rate:.1f} tokens/s (no earlier rate here to compare)", flush=True)
        return rate, None
    tag, previous = baseline
    print(
        f"decode gate: {rate:.1f} tokens/s; {tag} recorded {previous:.1f} (at least {gate}%)",
        flush=True,
    )
    if rate < previous * gate / 100:
        return rate, (
            f"decodes {rate:.1f} tokens/s, under {gate}% of the {previous:.1f} recorded for "
            f"{tag} (DECODE_GATE)"
        )
    return rate, None


SERVER_HELP_ENV = re.compile(r"\(env: (LLAMA_ARG_\w+)\)")


def unread_server_flags(project: Project, tag: str, server_extra: str) -> str | None:
    """Why SERVER_EXTRA cannot go live with tag: a name the tag's llama-server does not read (it
    ignores those silently), from its own --help in the service's container; None when it reads
    them all. Asked only when SERVER_EXTRA sets something."""
    names = [pair.split("=", 1)[0] for pair in server_extra.split()]
    if not names:
        return None
    helped = project.compose("run", "--rm", "--no-deps", "llama-server", "--help", tag=tag)
    known = set(SERVER_HELP_ENV.findall(helped.stdout))
    if helped.returncode != 0 or not known:
        return f"cannot list the flags of its llama-server ({last_line(helped)})"
    # A boolean flag is also read as its negation: LLAMA_ARG_NO_X for LLAMA_ARG_X.
    unread = [
        name for name in names
        if name not in known and name.replace("LLAMA_ARG_NO_", "LLAMA_ARG_", 1) not in known
    ]  # fmt: skip
    if not unread:
        return None
    return (
        f"SERVER_EXTRA sets {', '.join(unread)}, which this llama-server does not read "
        "(`docker compose run --rm --no-deps llama-server --help` lists its LLAMA_ARG_* names)"
    )


def deploy(
    project: Project,
    tag: str,
    wait_timeout: int = WAIT_TIMEOUT_S,
    keep: int = KEEP_RELEASES,
    event: str = "deploy",
    recreate: bool = False,
) -> str:
    """Make tag live, or leave the last good release live and raise. Returns a summary line."""
    env = project.env()
    engine = dockerd.client()
    require_images(engine, env, tag)  # before anything changes
    values = settings.configured(project.env_file)
    with deploy_lock(project):
        try:
            config.check_port(values)  # inside the lock: no other deploy is moving the port
        except errors.ServeError as exc:
            raise ReleaseError(f"{event} of {tag} refused before any change: {exc}") from None
        history = read_history(project)
        if history and history[-1].get("status") == "started":
            append_history(
                project,
                tag=history[-1]["tag"],
                status="interrupted",
                detail="the deploy process ended before recording an outcome",
            )
            history = read_history(project)
        fallback = current_live(history)

        def refused(detail: str) -> ReleaseError:
            append_history(project, tag=tag, status="refused", event=event, detail=detail)
            live = f"{fallback} is still live" if fallback else "nothing was live"
            return ReleaseError(f"{event} of {tag} refused before any change: {detail}; {live}")

        # The model and server flags live in .env, not in the release: a bad one would fail the
        # fallback too. Check it with the new release's model-init while nothing has changed.
        check = project.compose(
            "run", "--rm", "--no-deps", "model-init", tag=tag, timeout=wait_timeout + 120
        )
        if check.returncode != 0:
            raise refused(f"model check failed: {last_line(check)}")
        unread = unread_server_flags(project, tag, values["SERVER_EXTRA"])
        if unread:
            raise refused(unread)
        # Now that the model is in place: plan its memory; render the server's flags, the
        # gateway's configuration and the memory limits with it.
        try:
            files, derived, memory = config.planned(values)
        except errors.ServeError as exc:
            raise refused(str(exc)) from None
        config.write_planned(Path(env["SERVER_ENV_FILE"]).parent, files)
        envfile.write(project.env_file, {**project.env(), **derived}, config.ENV_HEADER)
        if memory is not None:
            print(config.plan_report(values, memory), flush=True)
        manifest = model_manifest_hash(env)
        append_history(project, tag=tag, status="started", event=event, model_manifest=manifest)
        print(f"{event}: starting {tag}", flush=True)
        failure = bring_up(project, tag, wait_timeout, recreate)
        smoke = "fail" if failure else "pass"
        rate = None
        gate = int(values["DECODE_GATE"])
        if failure is None and gate:
            previous = recorded_rate(history, fallback)
            baseline = (fallback, previous) if fallback and previous else None
            rate, failure = decode_gate(project.env(), gate, baseline)
        if failure is None:
            append_history(
                project,
                tag=tag,
                status="live",
                event=event,
                smoke="pass",
                model_manifest=manifest,
                decode_tokens_per_s=rate,
            )
            removed = prune(engine, env, read_history(project), keep)
            pruned = f"; pruned {', '.join(removed)}" if removed else ""
            return f"{event}: {tag} is live (healthy, smoke passed){pruned}"
        append_history(
            project,
            tag=tag,
            status="failed",
            event=event,
            smoke=smoke,
            detail=failure,
            model_manifest=manifest,
            decode_tokens_per_s=rate,
        )
        if fallback is None or fallback == tag:
            raise ReleaseError(
                f"{event} of {tag} failed: {failure}; there is no earlier good "
                "release to return to, so nothing is live"
            )
        print(f"{event}: {tag} failed ({failure}); returning to {fallback}", flush=True)
        again = bring_up(project, fallback, wait_timeout)
        if again is not None:
            append_history(
                project,
                tag=fallback,
                status="failed",
                event="auto-rollback",
                smoke="fail",
                detail=again,
            )
            raise ReleaseError(
                f"{event} of {tag} failed: {failure}; returning to {fallback} "
                f"failed too: {again}; nothing is live"
            )
        append_history(
            project,
            tag=fallback,
            status="live",
            event="auto-rollback",
            smoke="pass",
            model_manifest=manifest,
        )
        raise ReleaseError(
            f"{event} of {tag} failed: {failure}; rolled back: {fallback} is "
            "live and passed its smoke test"
        )


def rollback(project: Project, tag: str | None = None, **kwargs) -> str:
    """Deploy tag, or the release that was live before the current one."""
    if tag is None:
        tag = previous_good(read_history(project))
        if tag is None:
            raise ReleaseError("no earlier good release in the history: name one with TAG=")
    return deploy(project, tag, event="rollback", **kwargs)


def rotate_key(project: Project, wait_timeout: int = WAIT_TIMEOUT_S) -> str:
    """A new API key for the live release, through the release gate: the server restarts with it
    and must pass its smoke test, else the old key comes back (and with it the old containers)."""
    live = current_live(read_history(project))
    if live is None:
        raise ReleaseError("nothing is live: deploy first (make up); the key is used from then on")
    dockerd.answers()  # before the key changes: no deploy and no undo without Docker
    key_file = Path(project.env()["API_KEY_FILE"])
    old = key_file.read_text()
    try:
        credentials.write_secret(key_file, credentials.new_api_key() + "\n")
        return deploy(project, live, wait_timeout, event="rotate-key", recreate=True)
    except errors.ServeError as exc:
        credentials.write_secret(key_file, old)
        again = bring_up(project, live, wait_timeout, recreate=True)
        state = f"{live} is live with the old key" if again is None else f"and then: {again}"
        if again is None:
            append_history(project, tag=live, status="live", event="rotate-key-undo", smoke="pass")
        raise ReleaseError(f"key rotation failed: {exc}; the old key is back: {state}") from None


def endpoint(env: dict[str, str]) -> str:
    """Where a client on this host reaches the API, with what, and how to stop it."""
    where = f"the API is at {client.published_url(env)}/v1 (OpenAI-compatible)"
    key = f"; API key in {env['API_KEY_FILE']} (Authorization: Bearer <key>)"
    cert = f"; certificate {env['GATEWAY_TLS_FILE']}" if client.gateway(env) else ""
    return where + key + cert + "; `make down` stops it"


def running(env: dict[str, str]) -> dict | None:
    """What Docker runs as this project's llama-server: its tag, state and health (None when
    there is no container). The history says what should run; this says what does."""
    server = containers(dockerd.client(), env, "llama-server")
    if not server:
        return None
    state = server[0].attrs["State"]
    return {
        "tag": server[0].attrs["Config"]["Image"].rsplit(":", 1)[-1],
        "state": state["Status"],
        "health": (state.get("Health") or {}).get("Status"),
    }


def format_history(history: list[dict], now: dict | None) -> str:
    """The history as a table; `*` marks the live release only where Docker runs it (now),
    `!` where the history says live and Docker disagrees. A last line says what runs."""
    live = current_live(history)
    serving = now is not None and now["state"] == "running" and now["tag"] == live
    rows = [("", "TAG", "WHEN", "EVENT", "STATUS", "SMOKE", "DECODE T/S", "MODEL MANIFEST")]
    for r in history:
        if r.get("status") == "started":
            continue
        rows.append(
            (
                "",
                r.get("tag", "?"),
                r.get("at", "?"),
                r.get("event", "-"),
                r.get("status", "?"),
                r.get("smoke", "-"),
                f"{r['decode_tokens_per_s']:.1f}" if r.get("decode_tokens_per_s") else "-",
                (r.get("model_manifest") or "-")[:12],
            )
        )
    # The marker goes on the newest record that made the live tag live.
    for row in reversed(rows[1:]):
        if row[1] == live and row[4] == "live":
            rows[rows.index(row)] = ("*" if serving else "!", *row[1:])
            break
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join(
        "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
    if now is None:
        status = "nothing: no llama-server container"
    else:
        health = f", {now['health']}" if now["health"] else ""
        status = f"{now['tag']} ({now['state']}{health})"
    if live and not serving:
        status += f"; the history's live release {live} is not running (! above): make deploy"
    return f"{table}\n\nrunning now: {status}"


# --- answers for Ansible --------------------------------------------------------------------------
# What the roles and playbooks ask instead of parsing the project's files themselves.

ANSWERS = ("history", "images", "bundle-images")
IMAGE_ID = re.compile(r"[0-9a-f]{64}")


def history_answer(history: list[dict]) -> dict:
    """The history as read_history has it (a line cut by a crash skipped), with what is live and
    what was good before."""
    return {"live": current_live(history), "previous": previous_good(history), "records": history}


def tagged_images(env: dict[str, str], tag: str) -> list[str]:
    """repository:tag of every image one release spans."""
    return [f"{repo}:{tag}" for repo in release_images(env)]


def bundle_images(path: Path) -> dict[str, str]:
    """The images a `docker save` archive holds: first tag -> image ID (sha256:...), from its
    manifest.json (Config names the image's config blob: `<id>.json`, or `blobs/sha256/<id>`)."""
    try:
        with tarfile.open(path) as archive:
            member = archive.extractfile("manifest.json")
            manifest = json.loads(member.read()) if member else None
    except (OSError, KeyError, tarfile.TarError, ValueError) as exc:
        raise ReleaseError(f"{path}: not a `make images-bundle` archive ({exc})") from None
    images = {}
    for entry in manifest or []:
        found = IMAGE_ID.search(str(entry.get("Config", "")))
        if not entry.get("RepoTags") or not found:
            raise ReleaseError(f"{path}: an image without a tag or an ID in its manifest: {entry}")
        images[entry["RepoTags"][0]] = f"sha256:{found.group()}"
    if not images:
        raise ReleaseError(f"{path}: holds no images: run `make images-bundle`")
    return images


def bundle_answer(tag: str, given: Path | None) -> dict:
    """The bundle a rollout ships for tag (the one given, else `make images-bundle`'s for the tag)
    and its images by ID; none found: no images, and the path looked at."""
    path = given or bundle_path(tag)
    if given is None and not path.is_file():
        return {"bundle": str(path), "found": False, "images": {}}
    return {"bundle": str(path), "found": True, "images": bundle_images(path)}


def add_answers(sub) -> None:
    history = sub.add_parser("history", help="the release history (the live and previous tags)")
    images = sub.add_parser(
        "images", help="the images of a release tag and the services it keeps running"
    )
    images.add_argument("tag", nargs="?", help="image tag (default: the one in the env file)")
    bundle_ids = sub.add_parser("bundle-images", help="the images an images bundle holds, by ID")
    bundle_ids.add_argument("tag", help="the release's image tag")
    bundle_ids.add_argument(
        "--bundle", type=Path, help="a `make images-bundle` archive (default: the tag's, if made)"
    )
    for parser in (history, images, bundle_ids):
        parser.add_argument("--json", action="store_true", help="print JSON (Ansible reads it)")


def answer(args: argparse.Namespace, project: Project) -> int:
    """history, images, bundle-images: read only, printed as JSON or as lines."""
    if args.action == "history":
        result: dict = history_answer(read_history(project))
        lines = [f"{r.get('tag', '?')} {r.get('status', '?')}" for r in result["records"]]
    elif args.action == "images":
        env = project.env()
        try:
            tag = args.tag or env["IMAGE_TAG"]
            result = {
                "tag": tag,
                "images": tagged_images(env, tag),
                "services": serving_services(env),
            }
        except KeyError as exc:
            raise ReleaseError(
                f"images: {project.env_file} has no {exc}: render it again (make config)"
            ) from None
        lines = result["images"]
    else:
        result = bundle_answer(args.tag, args.bundle)
        lines = [f"{name} {image}" for name, image in result["images"].items()]
    print(json.dumps(result) if args.json else "\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ternary-serve release", description="deploy, roll back and list releases"
    )
    ap.add_argument("--env-file", type=Path, default=PROJECT_ROOT / ".env")
    ap.add_argument("--state-dir", type=Path, default=PROJECT_ROOT / "state")
    ap.add_argument(
        "--wait-timeout", type=int, default=WAIT_TIMEOUT_S, help="seconds to wait for /health"
    )
    ap.add_argument(
        "--keep", type=int, default=KEEP_RELEASES, help="release images to keep locally"
    )
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("deploy").add_argument(
        "tag", nargs="?", help="image tag (default: the one in the env file)"
    )
    sub.add_parser("rollback").add_argument(
        "tag", nargs="?", help="image tag (default: the previous good one)"
    )
    sub.add_parser("list")
    sub.add_parser("rotate-key", help="a new API key for the live release, through the gate")
    bundle_args = sub.add_parser("bundle", help="the release's images in one archive")
    bundle_args.add_argument("tag", nargs="?", help="image tag (default: the one in the env file)")
    bundle_args.add_argument("--out", type=Path, help="default: build/ternary-serve-images-TAG.tar")
    add_answers(sub)
    args = ap.parse_args(argv)
    return errors.run("release", lambda: act(args, Project(args.env_file, args.state_dir)))


def act(args: argparse.Namespace, project: Project) -> int:
    if args.action in ANSWERS:
        return answer(args, project)
    started = time.monotonic()
    if args.action == "list":
        print(format_history(read_history(project), running(project.env())))
        return 0
    if args.action == "bundle":
        tag = args.tag or project.env()["IMAGE_TAG"]
        print(bundle(project.env(), tag, args.out or bundle_path(tag)))
        return 0
    options = {"wait_timeout": args.wait_timeout, "keep": args.keep}
    if args.action == "deploy":
        print(deploy(project, args.tag or project.env()["IMAGE_TAG"], **options))
    elif args.action == "rotate-key":
        print(rotate_key(project, args.wait_timeout))
    else:
        print(rollback(project, args.tag, **options))
    print(f"release: {endpoint(project.env())}")
    print(f"release: done in {time.monotonic() - started:.0f} s")
    return 0
