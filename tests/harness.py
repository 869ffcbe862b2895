"""Helpers for tests that run the real stack: a Compose project per test, configured by
`ternary-serve config` into its own directory, on images built once per session."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import random
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import docker
import docker.errors
import requests

from ternary_serve import client, config, envfile, release
from ternary_serve.versions import PROJECT_ROOT

STAND_IN_IMAGE = "local/debian:bookworm-test"
ANSIBLE_DIR = PROJECT_ROOT / "ansible"
VENV_BIN = Path(sys.executable).parent
BUILD_TIMEOUT = 3600
# The checkout's commit as the session starts, marked as the tests': every stack of the session runs
# the images built for it, under a tag of their own, so that the suite never rebuilds, re-tags or
# removes the images of an operator's release of the same commit (`make demo`, `make up`).
SESSION_REVISION = f"{config.project_revision()}-tests"
# Set by tests/lanes.py for each lane it runs (plain pytest runs as lane 0, alone): the lane's
# number picks its block of host ports; the run's directory holds what lanes share (locks, the
# Molecule fixtures) and its results folder the figures.
# The Compose projects whose images the suite builds (the release images, the CUDA image, the
# releases tests make FROM them): what `tests/lanes.py` removes after a run.
BUILD_PROJECT, CUDA_PROJECT, TEST_RELEASE_PROJECT = "ts-build", "ts-cuda-image", "ts-test-release"
IMAGE_PROJECTS = (BUILD_PROJECT, CUDA_PROJECT, TEST_RELEASE_PROJECT)
LANE_INDEX = int(os.environ.get("TS_TEST_LANE_INDEX", "0"))
RUN_DIR = Path(os.environ.get("TS_TEST_RUN_DIR", f"/tmp/ternary-serve-tests-{os.getpid()}"))
RESULTS_DIR = Path(os.environ.get("TS_TEST_RESULTS_DIR", PROJECT_ROOT / "test-results"))
PORTS_PER_LANE = 1000
FIRST_PORT = 20000


def free_port() -> int:
    """A free loopback port from this lane's block: lanes never hand out each other's ports (the
    kernel's port 0 can give a port another lane's container is about to publish)."""
    first = FIRST_PORT + LANE_INDEX * PORTS_PER_LANE
    block = range(first, first + PORTS_PER_LANE)
    for port in random.sample(block, len(block)):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {block.start}-{block.stop - 1}")


@contextlib.contextmanager
def exclusive(name: str):
    """One lane at a time past this point, across the run's lanes (a file lock in RUN_DIR)."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with (RUN_DIR / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass
class Stack:
    """One Compose project, configured by `ternary-serve config` into its own directory."""

    workdir: Path
    name: str
    env: dict[str, str]

    @property
    def url(self) -> str:
        return client.published_url(self.env)

    def api(self) -> requests.Session:
        """An HTTP session as the API's clients have one: the key, the gateway's certificate."""
        return client.Endpoint.of(self.env).session()

    def compose_cmd(self, *args: str) -> list[str]:
        return [
            "docker",
            "compose",
            "--env-file",
            str(self.workdir / ".env"),
            "-p",
            self.name,
            *args,
        ]

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            self.compose_cmd(*args),
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def env_now(self) -> dict[str, str]:
        """.env as it is now (a deploy rewrites the planned limits)."""
        return envfile.read(self.workdir / ".env")

    def release(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
        """`ternary-serve release ...` on this stack, as `make deploy` runs it."""
        return subprocess.run(
            [sys.executable, "-m", "ternary_serve.cli", "release", "--env-file",
             str(self.workdir / ".env"), "--state-dir", str(self.workdir), *args],
            cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def container(self, service: str) -> str:
        """The running container of a service (its id)."""
        ids = self.compose("ps", "-q", service).stdout.split()
        assert ids, f"no {service} container in {self.name}"
        return ids[0]

    def status_for_declared_body(self, length: int, path: str = "/v1/chat/completions") -> int:
        """The gateway's answer to a POST whose headers declare a body of `length` bytes, read
        before any of the body is sent (HTTP libraries that are still sending when the answer
        comes report a broken connection instead of the status)."""
        context = ssl.create_default_context(cafile=self.env["GATEWAY_TLS_FILE"])
        port = int(self.env["PUBLISH_PORT"])
        with context.wrap_socket(
            socket.create_connection(("127.0.0.1", port), timeout=30), server_hostname="localhost"
        ) as conn:
            conn.sendall(
                f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                f"Content-Length: {length}\r\n\r\n".encode()
            )
            return int(conn.recv(4096).split(b" ", 2)[1])

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", timeout=120)


def readable_by_containers(model: Path) -> None:
    """pytest's temp dirs are private (0700); the containers run as uid 10001."""
    for directory in (model.parent, *model.parent.parents):
        if directory == Path(directory.anchor) or directory.stat().st_mode & 0o005 == 0o005:
            continue
        directory.chmod(directory.stat().st_mode | 0o005)
    if model.exists():
        model.chmod(0o644)


def remove_replaced_images(project: str) -> None:
    """Images a rebuild of this Compose project left without a tag (`make build` does the same)."""
    label = f"label=com.docker.compose.project={project}"
    subprocess.run(
        ["docker", "image", "prune", "-f", "--filter", label], capture_output=True, check=True
    )


def remove_earlier_sessions_images(project: str, tag: str) -> None:
    """Release images earlier test sessions built (other revisions' tags) under this Compose
    project: each run leaves one release's images, not one more per commit. Images this project
    did not build (an operator's releases) are never touched."""
    engine = docker.from_env()
    for image in engine.images.list(filters={"label": f"com.docker.compose.project={project}"}):
        for name in image.tags:
            if not name.endswith(f":{tag}"):
                with contextlib.suppress(docker.errors.APIError):  # in use by a container
                    engine.images.remove(name)


def process_tree() -> dict[int, list[int]]:
    """Every process's children, from /proc (the host sees the processes of Docker's builds)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return children


BACKGROUND_CGROUP = "ternary-serve-tests-background"


def background_cgroup() -> Path | None:
    """A CPU cgroup that gets only what the others leave idle (None where no CPU controller can be
    written). nice alone does not do it: it ranks processes within one cgroup, and BuildKit runs
    each build step in a cgroup of its own, weighed the same as every container's (a nice-19 build
    step took half of the 2 cores from the suite's engine build)."""
    v1, v2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")
    if (v1 / "cpu.shares").is_file():
        group, knobs = v1 / BACKGROUND_CGROUP, {"cpu.shares": "2"}
    elif (v2 / "cgroup.subtree_control").is_file() and "cpu" in (
        v2 / "cgroup.subtree_control"
    ).read_text().split():
        group, knobs = v2 / BACKGROUND_CGROUP, {"cpu.weight": "1", "cpu.idle": "1"}
    else:
        return None
    try:
        group.mkdir(exist_ok=True)
        for knob, value in knobs.items():
            with contextlib.suppress(OSError):  # cpu.idle: Linux 5.15 and later
                (group / knob).write_text(value)
    except OSError:
        return None
    return group


def lower_priority(marker: bytes, cgroup: Path | None) -> None:
    """nice 19 and the background cgroup for every process whose command line holds marker, and
    for all it started (their later children inherit both)."""
    tree = process_tree()
    todo = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker in cmdline.read_bytes():
                todo.append(int(cmdline.parent.name))
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        with contextlib.suppress(OSError):
            if os.getpriority(os.PRIO_PROCESS, pid) < 19:
                os.setpriority(os.PRIO_PROCESS, pid, 19)
            if cgroup and BACKGROUND_CGROUP not in Path(f"/proc/{pid}/cgroup").read_text():
                (cgroup / "cgroup.procs").write_text(str(pid))


# A cold CUDA build of the engine for one architecture: about 4,900 CPU-seconds, 41 min on 2
# idle cores (85 min measured on 2 shared ones); with the layer cache, seconds; with only ccache
# warm, under a minute. Its wall time follows what the lanes leave idle, so it is bounded by
# progress instead: a build whose output has not grown for this long is stuck (ninja prints a line
# per compiled file; the slowest CUDA file takes a few minutes alone, many times that on the few
# percent of the CPU that busy lanes leave it).
CUDA_BUILD_STALL_S = 2700


class BackgroundBuild:
    """`docker compose build` of some services running beside the tests, its compiler processes
    (found by marker, a string in the build script's command line) at the lowest CPU priority and
    in the background cgroup: it takes the CPU the rest of the suite leaves idle (waiting for
    health, for timeouts)."""

    def __init__(self, stack: Stack, services: list[str], marker: bytes):
        self.stack = stack
        self.log = stack.workdir / "build.log"
        self.started = time.monotonic()
        self.seconds: float | None = None
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                stack.compose_cmd("build", *services), cwd=PROJECT_ROOT, stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        self.marker = marker
        self.cgroup = background_cgroup()
        threading.Thread(target=self._nice, daemon=True).start()

    def _nice(self) -> None:
        while self.proc.poll() is None:
            lower_priority(self.marker, self.cgroup)
            time.sleep(2)

    def wait(self, stall_s: float = CUDA_BUILD_STALL_S) -> tuple[int, str]:
        """The build's exit status and the last lines of its output (self.seconds: how long);
        killed once its output has not grown for stall_s."""
        size, grew = -1, time.monotonic()
        while self.proc.poll() is None:
            now_size = self.log.stat().st_size
            if now_size != size:
                size, grew = now_size, time.monotonic()
            elif time.monotonic() - grew > stall_s:
                self.proc.kill()
                with self.log.open("a") as log:
                    log.write(f"\n[tests] killed: no build output for {stall_s:.0f} s\n")
                break
            time.sleep(5)
        code = self.proc.wait()
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
        return code, self.log.read_text()[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.cgroup:
            with contextlib.suppress(OSError):  # still busy: a build step not yet torn down
                self.cgroup.rmdir()


class KeptBuild:
    """The tested CUDA image kept under the key of unchanged inputs, in place of a build: tagged
    as the image the build would have made (BackgroundBuild's interface)."""

    def __init__(self, stack: Stack, kept: str):
        self.stack, self.kept, self.seconds = stack, kept, 0.0

    def wait(self, stall_s: float = CUDA_BUILD_STALL_S) -> tuple[int, str]:
        image = f"{self.stack.env['SERVER_IMAGE']}:{self.stack.env['IMAGE_TAG']}"
        tagged = subprocess.run(["docker", "tag", self.kept, image], capture_output=True, text=True)
        return tagged.returncode, tagged.stderr or f"{image}: the kept {self.kept}"

    def stop(self) -> None:
        pass


def keep_tested_cuda_image(image: str, key: str) -> None:
    """image passed its tests: kept as the build of key, in place of any other key's."""
    engine = docker.from_env()
    engine.images.get(image).tag(CUDA_KEPT_REPO, key)
    for old in engine.images.list(name=CUDA_KEPT_REPO):
        for name in old.tags:
            if name != f"{CUDA_KEPT_REPO}:{key}":
                with contextlib.suppress(docker.errors.APIError):
                    engine.images.remove(name)


def release_whose_server_is(built: Stack, tag: str, context: Path, dockerfile: str) -> str:
    """Tag `tag` on every release image: the server built from dockerfile (FROM the session's
    server image), the rest as built. Labelled with a project of its own, so that a session's
    clean-up of the build project's other tags leaves it alone; no intermediate containers."""
    engine = docker.from_env()
    server = built.env["SERVER_IMAGE"]
    (context / "Dockerfile").write_text(
        f"FROM {server}:{built.env['IMAGE_TAG']}\n{dockerfile}"
        f"LABEL com.docker.compose.project={TEST_RELEASE_PROJECT}\n"
    )
    engine.images.build(path=str(context), tag=f"{server}:{tag}", rm=True, forcerm=True)
    for repo in release.release_images(built.env):
        if repo != server:
            engine.images.get(f"{repo}:{built.env['IMAGE_TAG']}").tag(repo, tag)
    return tag


@contextlib.contextmanager
def deployed(workdir: Path, model: Path, name: str, **settings: str | None):
    """A stack configured with these settings and deployed by the release CLI; torn down after."""
    stack = configure(workdir, model, name, **settings)
    done = stack.release("deploy")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    try:
        yield stack
    finally:
        stack.down()


def configure(workdir: Path, model: Path, name: str, **settings: str | None) -> Stack:
    """`ternary-serve config` with the test defaults below, over any settings given by name; a
    setting given as None is left to its own default, as an operator who never set it has it."""
    workdir.mkdir(parents=True, exist_ok=True)
    readable_by_containers(model)
    defaults = {
        "BACKEND": "cpu",
        "ENGINE_SOURCE": "local",
        "PROJECT_NAME": name,
        "MODEL_DIR": str(model.parent),
        "MODEL_FILE": model.name,
        "PUBLISH_PORT": str(free_port()),
        "BUILD_BASE_IMAGE": STAND_IN_IMAGE,
        "RUNTIME_BASE_IMAGE": STAND_IN_IMAGE,
        "GATEWAY_BASE_IMAGE": STAND_IN_IMAGE,
        "REVISION": SESSION_REVISION,
        # Off unless a test is about it: a tiny model's CPU decode rate follows the machine's
        # load, so two deploys minutes apart could differ by more than any gate allows.
        "DECODE_GATE": "0",
        # The server's own port: most suites test the server and the release path, through
        # endpoints the gateway does not pass (/completion, /props, /slots). The default
        # deployment, gateway on, is test_endpoint's (GATEWAY=None); test_chaos's and the
        # bounded queue's set it on.
        "GATEWAY": "off",
    }
    chosen = {name: value for name, value in {**defaults, **settings}.items() if value is not None}
    env, _ = config.configure(chosen, workdir / ".env", workdir, replace=True)
    return Stack(workdir, name, env)


def ansible_env(**extra: str) -> dict[str, str]:
    """The environment ansible-playbook and molecule run in: this venv's tools, the project's
    roles, plain output at a width nothing wraps."""
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles"),
        "ANSIBLE_FORCE_COLOR": "0",
        "NO_COLOR": "1",
        "COLUMNS": "400",  # molecule wraps its output at the terminal width
        # The tests' image tag for the hosts' deploys (molecule.yml's llm_stack_settings).
        "TS_TEST_REVISION": SESSION_REVISION,
        **extra,
    }


def write_figures(
    stem: str, title: str, intro: str, columns: list[str], rows: list[dict], raw: list[dict]
) -> None:
    """<results>/docs/<stem>.md (a table: one row per figure, the given columns of rows) and
    <results>/docs/results/<stem>.json (raw), stamped with the time and the machine the suite ran
    on. Never into the checkout: `make docs-figures` copies them into docs/ from a green run. A
    suite split across lanes writes its part: the figures already there from this run's other part
    are kept, each scenario (raw["scenario"]) once. Under an exclusive lock: lanes write at once."""
    docker_info = subprocess.run(
        ["docker", "info", "--format", "{{.ServerVersion}} live-restore={{.LiveRestoreEnabled}}"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    machine = f"{os.cpu_count()} CPUs, {platform.machine()}, Docker {docker_info}"
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    docs = RESULTS_DIR / "docs"
    results = docs / "results"
    results.mkdir(parents=True, exist_ok=True)
    with exclusive(f"figures-{stem}"):
        raw_file = results / f"{stem}.json"
        if raw_file.exists():
            earlier = json.loads(raw_file.read_text())
            mine = {figure["scenario"] for figure in raw}
            kept = [i for i, f in enumerate(earlier["scenarios"]) if f["scenario"] not in mine]
            raw = [earlier["scenarios"][i] for i in kept] + raw
            rows = [earlier["rows"][i] for i in kept] + rows
        raw_file.write_text(
            json.dumps({"when": when, "machine": machine, "scenarios": raw, "rows": rows}, indent=2)
            + "\n"
        )
        write_table(docs / f"{stem}.md", title, intro, f"{when}, {machine}", columns, rows)


def write_table(
    path: Path, title: str, intro: str, run: str, columns: list[str], rows: list[dict]
) -> None:
    lines = ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    path.write_text(
        f"# {title}\n\n{intro}\n\nRun: {run}.\n\n"
        "| " + " | ".join(columns) + " |\n"
        "|" + "---|" * len(columns) + "\n" + "\n".join(lines) + "\n"
    )


# Lines for the end of the session's output, whatever pytest captured (conftest prints them): which
# CUDA build a run tested.
REPORT_LINES: list[str] = []
# The last CUDA server image whose tests passed on this machine, kept under the key of its inputs:
# a cold build is about 4,900 CPU-seconds, and a run whose inputs did not change needs none.
CUDA_KEPT_REPO = "local/ternary-serve-cuda-tested"
DOCKERFILE = PROJECT_ROOT / "docker" / "Dockerfile"
ENGINE_TREE = "vendor/llama.cpp"  # stands for itself by the engine pins in the key


def dockerfile_stages(text: str) -> tuple[str, dict[str, str]]:
    """The Dockerfile's global part (ARGs before the first FROM) and its stages' text by name."""
    head, *parts = re.split(r"^(?=FROM )", text, flags=re.MULTILINE)
    stages = {}
    for part in parts:
        name = re.match(r"FROM \S+ AS (\S+)", part)
        if name:
            stages[name.group(1)] = part
    return head, stages


def stages_of(target: str, stages: dict[str, str], build_args: dict[str, str]) -> list[str]:
    """target and every stage it is built from or copies from, build args substituted."""
    wanted, todo = [], [target]
    while todo:
        name = todo.pop()
        if name in wanted or name not in stages:
            continue
        wanted.append(name)
        base = re.match(r"FROM (\S+)", stages[name]).group(1)
        base = re.sub(r"\$\{(\w+)\}", lambda m: build_args.get(m.group(1), m.group(0)), base)
        todo.append(base)
        todo.extend(re.findall(r"--from=(\S+)", stages[name]))
    return sorted(wanted)


def image_key_label(image: str) -> str:
    """What stands for a base image in a key: its stand-in key (tests/bootstrap.py labels the
    images it makes with the key of their inputs), else its ID."""
    found = docker.from_env().images.get(image)
    return (found.labels or {}).get("io.ternary-serve.standin-key") or found.id


def cuda_image_inputs(env: dict[str, str], target: str = "server") -> dict[str, str]:
    """Everything the CUDA server image is made from, each as text or a digest: the Dockerfile's
    stages it uses, the files they copy from the checkout, the build args they read (not the
    revision: it only labels), and the base images' keys."""
    head, stages = dockerfile_stages(DOCKERFILE.read_text())
    used = stages_of(target, stages, env)
    inputs = {"dockerfile": head + "".join(stages[name] for name in used)}
    for name in used:
        for line in re.findall(r"^COPY (?!--from)(.+)$", stages[name], re.MULTILINE):
            for source in line.split()[:-1]:
                path = PROJECT_ROOT / source
                if source != ENGINE_TREE and path.is_file():
                    inputs[source] = hashlib.sha256(path.read_bytes()).hexdigest()
    stage_text = "".join(stages[name] for name in used)
    args = set(re.findall(r"^ARG (\w+)", stage_text, re.MULTILINE)) | {"ENGINE_SOURCE"}
    args -= {"PROJECT_REVISION"}
    inputs.update({f"arg {arg}": env[arg] for arg in sorted(args) if arg in env})
    for base in ("BUILD_BASE_IMAGE", "RUNTIME_BASE_IMAGE"):
        inputs[f"base {base}"] = image_key_label(env[base])
    return inputs


def cuda_image_key(env: dict[str, str]) -> str:
    text = json.dumps(cuda_image_inputs(env), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
