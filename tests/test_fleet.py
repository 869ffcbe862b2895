"""A fleet's gateway configuration (`ternary-serve fleet`): rendered from the replicas and the
stack's settings, checked by HAProxy itself, and refused with one line when the inventory cannot
make one."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import docker
import docker.errors
import pytest
import requests
import yaml
from harness import (
    ANSIBLE_DIR,
    VENV_BIN,
    Stack,
    ansible_env,
    release_whose_server_is,
    write_figures,
)

from ternary_serve import release
from ternary_serve.client import Endpoint
from ternary_serve.versions import PROJECT_ROOT

REPLICAS = [
    {"name": "gpu-box-1-gpu0", "address": "10.0.0.11", "port": 8080, "slots": 4},
    {"name": "gpu-box-1-gpu1", "address": "10.0.0.11", "port": 8081, "slots": 4},
    {"name": "gpu-box-2-gpu0", "address": "gpu-box-2", "port": 8080, "slots": ""},
]
HOST_PATHS = [
    "--tls-file=/etc/haproxy/ternary-serve.pem",
    "--stats-socket=/run/haproxy/admin.sock",
    "--api-key-file=/etc/prometheus/ternary-serve-api-key",
]


def render(tmp_path, replicas, *settings: str) -> subprocess.CompletedProcess:
    """The gateway rendered as the llm_gateway role renders it: from one replicas.json per
    serving host (its replicas' names start with the host's)."""
    hosts: dict[str, list[dict]] = {}
    for replica in replicas:
        hosts.setdefault(str(replica.get("name", "")).rsplit("-gpu", 1)[0], []).append(replica)
    files = []
    for host, rows in (hosts or {"none": []}).items():
        files.append(tmp_path / f"{host or 'unnamed'}.json")
        files[-1].write_text(json.dumps(rows))
    return subprocess.run(
        [sys.executable, "-m", "ternary_serve.cli", "fleet", "gateway", "--out", tmp_path / "gw",
         "--replicas", *files, "--address", "10.0.0.10", *HOST_PATHS, *settings],
        capture_output=True, text=True, cwd=PROJECT_ROOT,
    )  # fmt: skip


def test_every_replica_is_a_checked_server_of_one_least_connections_backend(tmp_path):
    result = render(tmp_path, REPLICAS, "CLIENT_RATE=100")
    assert result.returncode == 0, result.stderr
    assert "fleet: written" in result.stdout
    cfg = (tmp_path / "gw" / "haproxy.cfg").read_text()
    servers = [line.split() for line in cfg.splitlines() if line.strip().startswith("server ")]
    assert [s[1:3] for s in servers] == [
        ["gpu-box-1-gpu0", "10.0.0.11:8080"],
        ["gpu-box-1-gpu1", "10.0.0.11:8081"],
        ["gpu-box-2-gpu0", "gpu-box-2:8080"],
    ]
    # Health-checked; at most a replica's planned slots passed on; no Docker DNS outside Docker.
    assert all("check" in s for s in servers)
    assert servers[0][-2:] == ["maxconn", "4"] and "maxconn" not in servers[2]
    assert "resolvers" not in cfg
    assert "balance leastconn" in cfg and "option httpchk GET /health" in cfg
    # The same frontend as a single host's gateway, with the fleet's settings.
    assert "sc_http_req_rate(0) gt 100" in cfg
    assert "bind :443 ssl crt /etc/haproxy/ternary-serve.pem" in cfg
    assert "stats socket /run/haproxy/admin.sock mode 600 level admin" in cfg
    assert "user haproxy" in cfg and "bind 10.0.0.10:8405" in cfg
    scrape = yaml.safe_load((tmp_path / "gw" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    replicas = jobs["ternary-serve-replicas"]
    assert [c["targets"][0] for c in replicas["static_configs"]] == [
        "10.0.0.11:8080",
        "10.0.0.11:8081",
        "gpu-box-2:8080",
    ]
    assert replicas["authorization"]["credentials_file"] == "/etc/prometheus/ternary-serve-api-key"
    assert jobs["ternary-serve-gateway"]["static_configs"][0]["targets"] == ["10.0.0.10:8405"]
    pem = tmp_path / "gw" / "gateway.pem"
    assert "PRIVATE KEY" in pem.read_text() and oct(pem.stat().st_mode & 0o777) == "0o600"
    # A rerun with the same inventory changes nothing (the certificate is kept).
    before = pem.read_text()
    again = render(tmp_path, REPLICAS, "CLIENT_RATE=100")
    assert "fleet: unchanged" in again.stdout and pem.read_text() == before


@pytest.mark.parametrize(
    "replicas, message",
    [
        ([], "no replicas: the inventory's llm_servers group is empty"),
        ([REPLICAS[0], REPLICAS[0]], "replica name 'gpu-box-1-gpu0': use letters"),
        ([{**REPLICAS[0], "name": "box 1"}], "replica name 'box 1': use letters"),
        ([{**REPLICAS[0], "address": "fd00::11"}], "fd00::11 is IPv6; set the host's ansible_host"),
        ([{**REPLICAS[0], "port": 0}], "port 0 is not a TCP port"),
        ([{"name": "x"}], "needs name, address, port"),
    ],
)  # fmt: skip
def test_an_inventory_that_cannot_make_a_gateway_gets_one_line(tmp_path, replicas, message):
    result = render(tmp_path, replicas)
    assert result.returncode == 1
    assert result.stderr.startswith("fleet: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "gw" / "haproxy.cfg").exists()


def test_a_bad_setting_is_refused_with_the_settings_message(tmp_path):
    result = render(tmp_path, REPLICAS, "CLIENT_RATE=lots")
    assert result.returncode == 1
    assert "CLIENT_RATE" in result.stderr and "whole number" in result.stderr


def test_the_fleet_key_is_made_once_and_kept(tmp_path):
    cmd = [sys.executable, "-m", "ternary_serve.cli", "fleet", "key", "--out", str(tmp_path)]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=PROJECT_ROOT)
    key = (tmp_path / "api-key").read_text()
    second = subprocess.run(cmd, capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert "fleet: generated" in first.stdout and "fleet: unchanged" in second.stdout
    assert (tmp_path / "api-key").read_text() == key and key.startswith("ts-")
    assert oct((tmp_path / "api-key").stat().st_mode & 0o777) == "0o600"


@pytest.mark.docker
def test_haproxy_accepts_the_fleet_configuration(built, tmp_path):
    """HAProxy's own check (`haproxy -c`) of the rendered configuration, in the release's gateway
    image: Debian's HAProxy 2.6 package, the one the llm_gateway role installs (there from the
    distribution's archive). It knows the Prometheus exporter, leastconn and the user, and a
    replica whose host name does not resolve (gpu-box-2 here) leaves that server down, not the
    gateway."""
    assert render(tmp_path, REPLICAS).returncode == 0
    image = f"{built.env['GATEWAY_IMAGE']}:{built.env['IMAGE_TAG']}"
    gw = tmp_path / "gw"
    for path in gw.iterdir():
        path.chmod(0o644)  # the image's user reads them
    # The exporter binds the gateway's own address; here the container's loopback stands in.
    cfg = (gw / "haproxy.cfg").read_text().replace("bind 10.0.0.10:8405", "bind 127.0.0.1:8405")
    (gw / "haproxy.cfg").write_text(cfg)
    output = docker.from_env().containers.run(
        image,
        ["-c", "-f", "/etc/haproxy/fleet.cfg"],
        volumes={
            str(gw / "haproxy.cfg"): {"bind": "/etc/haproxy/fleet.cfg", "mode": "ro"},
            str(gw / "gateway.pem"): {"bind": "/etc/haproxy/ternary-serve.pem", "mode": "ro"},
        },
        user="0",
        entrypoint="haproxy",
        remove=True,
        stderr=True,
    )
    assert b"Configuration file is valid" in output, output


# --- the fleet scenario (ansible/molecule/fleet) --------------------------------------------------

SCENARIO = "fleet"
GATEWAY_HOST = "ts-fleet-gw"
SERVING_HOSTS = ("ts-fleet-a", "ts-fleet-b")
REPLICA_NAMES = ("ts-fleet-a-gpu0", "ts-fleet-a-gpu1", "ts-fleet-b-gpu0")
# Replica, its host and its state directory there (the llm_stack role's layout).
REPLICA_STATES = (
    ("ts-fleet-a-gpu0", "ts-fleet-a", "/opt/ternary-serve/state"),
    ("ts-fleet-a-gpu1", "ts-fleet-a", "/opt/ternary-serve/replicas/gpu1/state"),
    ("ts-fleet-b-gpu0", "ts-fleet-b", "/opt/ternary-serve/state"),
)
NESTED_DOCKER_VOLUMES = ("ts-fleet-docker-a", "ts-fleet-docker-b")


@dataclass
class Fleet:
    fixtures: Path
    built: Stack

    @property
    def files(self) -> Path:
        return self.fixtures / "fleet"

    @property
    def state(self) -> Path:
        """Molecule's ephemeral directory for the scenario: its inventory is the operator's."""
        return self.fixtures / "molecule-fleet"

    def run(self, *cmd: str, timeout: float = 1800) -> subprocess.CompletedProcess:
        env = ansible_env(
            TS_MOLECULE_FIXTURES=str(self.fixtures), MOLECULE_EPHEMERAL_DIRECTORY=str(self.state)
        )
        return subprocess.run(
            cmd, cwd=ANSIBLE_DIR, env=env, capture_output=True, text=True, timeout=timeout
        )

    def molecule(self, step: str) -> subprocess.CompletedProcess:
        return self.run(str(VENV_BIN / "molecule"), step, "-s", SCENARIO)

    def playbook(self, name: str, *args: str) -> subprocess.CompletedProcess:
        """An operator's playbook against the scenario's hosts, as `make fleet-*` runs it."""
        return self.run(
            str(VENV_BIN / "ansible-playbook"), "-i", str(self.state / "inventory"), name,
            "-e", f"ternary_serve_fleet_dir={self.files}", *args,
        )  # fmt: skip

    def history(self, host: str, state_dir: str) -> list[dict]:
        """A replica's release history, read on its host."""
        cat = (
            docker.from_env().containers.get(host).exec_run(["cat", f"{state_dir}/releases.jsonl"])
        )
        return [json.loads(line) for line in cat.output.decode().splitlines() if line.strip()]

    @property
    def address(self) -> str:
        networks = docker.from_env().containers.get(GATEWAY_HOST).attrs["NetworkSettings"]
        return networks["Networks"][SCENARIO_NETWORK]["IPAddress"]

    def endpoint(self) -> Endpoint:
        return Endpoint(
            url=f"https://{self.address}",
            api_key=(self.files / "api-key").read_text().strip(),
            verify=str(self.files / "gateway" / GATEWAY_HOST / "gateway.pem"),
        )

    def releases(self) -> dict[str, str]:
        """The fleet view (releases.yml): replica -> the tag it runs, when running and healthy."""
        result = self.playbook("releases.yml")
        assert result.returncode == 0, result.stdout[-3000:]
        found = dict(
            re.findall(
                r'"(ts-fleet-[ab]-gpu\d): running now: (\S+) \(running, healthy\)', result.stdout
            )
        )
        return found

    def servers(self) -> dict[str, tuple[bool, int]]:
        """The gateway's own view (its Prometheus exporter): server -> (up?, sessions so far)."""
        text = requests.get(f"http://{self.address}:8405/metrics", timeout=10).text
        up, sessions = {}, {}
        for line in text.splitlines():
            name, _, rest = line.partition("{")
            labels = dict(re.findall(r'(\w+)="([^"]*)"', rest.rpartition("}")[0]))
            if labels.get("proxy") != "llama_server" or "server" not in labels:
                continue
            value = float(line.rsplit(" ", 1)[1])
            if name == "haproxy_server_status" and labels.get("state") == "UP":
                up[labels["server"]] = value == 1
            elif name == "haproxy_server_sessions_total":
                sessions[labels["server"]] = int(value)
        return {name: (up.get(name, False), count) for name, count in sessions.items()}


SCENARIO_NETWORK = "ts-fleet"
FIGURES: list[dict] = []


class Load:
    """Bounded constant load through the gateway: `clients` clients, each one short streamed chat
    completion at a time, one every `period` seconds at most, until stopped. Every request's
    outcome is counted; a failure is anything but a 200 whose stream ends with [DONE]."""

    def __init__(self, api: Endpoint, clients: int = 2, period: float = 0.6):
        self.api, self.clients, self.period = api, clients, period
        self.outcomes: list[tuple[float, str | None]] = []  # (when it started, failure or None)
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.client) for _ in range(clients)]

    def one(self, http: requests.Session) -> str | None:
        try:
            with http.post(
                f"{self.api.url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "stream": True},
                stream=True, timeout=60,
            ) as resp:  # fmt: skip
                if resp.status_code != 200:
                    return f"HTTP {resp.status_code}: {resp.text[:120]}"
                if not any(line == b"data: [DONE]" for line in resp.iter_lines()):
                    return "the stream ended without [DONE]"
        except requests.RequestException as exc:
            return f"{type(exc).__name__}: {exc}"[:200]
        return None

    def client(self) -> None:
        with self.api.session() as http:
            while not self.stopping.is_set():
                started = time.monotonic()
                outcome = self.one(http)
                with self.lock:
                    self.outcomes.append((started, outcome))
                self.stopping.wait(max(0.0, self.period - (time.monotonic() - started)))

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=90)

    @property
    def failures(self) -> list[str]:
        return [failure for _, failure in self.outcomes if failure]

    def report(self, what: str, **more: object) -> None:
        """Print the figures and keep them for docs/fleet.md."""
        samples = sorted(set(self.failures))[:3]
        detail = "; ".join(f"{key}: {value}" for key, value in more.items()) or "-"
        FIGURES.append(
            {"scenario": what, "requests": len(self.outcomes), "failures": len(self.failures),
             **more, "detail": detail, "failure samples": samples}
        )  # fmt: skip
        print(f"{what}: {len(self.outcomes)} requests, {len(self.failures)} failed", more)
        for failure in samples:
            print(f"  {failure}")


@pytest.fixture(scope="module")
def fleet(built, molecule_fixtures):
    """Two serving hosts (three replicas) and a gateway host, converged by site.yml on the
    session's release; destroyed after the module."""
    made = Fleet(molecule_fixtures, built)
    client = docker.from_env()

    def clean() -> None:
        made.molecule("destroy")
        for volume in NESTED_DOCKER_VOLUMES:
            with contextlib.suppress(docker.errors.NotFound):
                client.volumes.get(volume).remove(force=True)

    clean()
    try:
        for step in ("create", "prepare", "converge"):
            result = made.molecule(step)
            assert result.returncode == 0, (
                f"molecule {step}:\n" + result.stdout[-6000:] + result.stderr[-3000:]
            )
        yield made
    finally:
        clean()
        if FIGURES:
            write_figures(
                "fleet",
                "A fleet under load: figures",
                "Written by `tests/test_fleet.py` (part of `make test`): two serving hosts\n"
                "(three replicas) and a gateway host, systemd containers of\n"
                "`ansible/molecule/fleet` on one machine, the CPU stack with the tiny synthetic\n"
                "model. The load is a bounded constant one through the gateway (HTTPS, the\n"
                "fleet's key): a few clients, each one short streamed chat completion at a\n"
                "time; a failure is anything but a 200 whose stream ends with [DONE]. What each\n"
                "scenario does and holds the fleet to is in the test.",
                ["scenario", "requests", "failures", "detail"],
                FIGURES,
                FIGURES,
            )


def bundle_of(fleet: Fleet, tag: str) -> Path:
    out = fleet.fixtures / f"images-{tag}.tar"
    release.bundle(fleet.built.env, tag, out)
    return out


@pytest.fixture(scope="module")
def v2(fleet):
    """A second release: the session's images under another tag (their IDs are on the hosts
    already: the role tags them in place instead of shipping the bundle again)."""
    engine = docker.from_env()
    tag = f"{fleet.built.env['IMAGE_TAG']}-fleet-v2"[:128]
    for repo in release.release_images(fleet.built.env):
        engine.images.get(f"{repo}:{fleet.built.env['IMAGE_TAG']}").tag(repo, tag)
    bundle = bundle_of(fleet, tag)
    yield tag, bundle
    bundle.unlink()
    for repo in release.release_images(fleet.built.env):
        with contextlib.suppress(docker.errors.ImageNotFound):
            engine.images.remove(f"{repo}:{tag}")


@pytest.mark.docker
def test_every_replica_serves_through_the_gateway(fleet):
    v1 = fleet.built.env["IMAGE_TAG"]
    assert fleet.releases() == dict.fromkeys(REPLICA_NAMES, v1)
    with Load(fleet.endpoint(), clients=3, period=0.3) as load:
        time.sleep(12)
    load.report("v1, three replicas")
    assert load.outcomes and not load.failures, load.failures[:3]
    servers = fleet.servers()
    assert set(servers) == set(REPLICA_NAMES)
    # Every replica up and given requests by least-connections balancing.
    assert all(up and sessions > 0 for up, sessions in servers.values()), servers


@pytest.mark.docker
def test_a_tag_no_host_holds_and_no_bundle_stops_the_rollout_before_it_starts(fleet):
    """Neither the hosts nor the controller (no `make images-bundle` for it) have the tag: the
    canary stops at shipping, before any replica is drained."""
    before = fleet.releases()
    tag = "never-built"
    # The inventory names a bundle (the fixtures', of another release); then none at all.
    named = fleet.playbook("deploy.yml", "-e", f"release_tag={tag}")
    assert named.returncode != 0
    refusal = next((line for line in named.stdout.splitlines() if "does not hold" in line), "")
    assert f"llama-server:{tag}" in refusal.split("(it holds")[0], named.stdout[-4000:]
    result = fleet.playbook(
        "deploy.yml", "-e", f"release_tag={tag}", "-e", "llm_stack_images_bundle="
    )
    assert result.returncode != 0
    assert f"lacks the images of {tag} and the controller has no bundle" in result.stdout, (
        result.stdout[-4000:]
    )
    assert f"ternary-serve-images-{tag}.tar" in result.stdout
    for run in (named, result):
        assert "Drain" not in run.stdout and "deploy of never-built stopped" not in run.stdout
    assert fleet.releases() == before
    assert all(up for up, _ in fleet.servers().values())


@pytest.mark.docker
def test_a_rolling_deploy_under_load_fails_no_request(fleet, v2):
    tag, bundle = v2
    with Load(fleet.endpoint()) as load:
        result = fleet.playbook(
            "deploy.yml", "-e", f"release_tag={tag}", "-e", f"llm_stack_images_bundle={bundle}"
        )
        time.sleep(3)
    assert result.returncode == 0, result.stdout[-6000:]
    load.report("rolling deploy of a new release over three replicas")
    assert load.outcomes and not load.failures, load.failures[:3]
    assert fleet.releases() == dict.fromkeys(REPLICA_NAMES, tag)
    # The canary went first: both replicas of ts-fleet-a went live before ts-fleet-b's.
    went_live = {
        name: next(
            r["at"] for r in fleet.history(host, state) if r["tag"] == tag and r["status"] == "live"
        )
        for name, host, state in REPLICA_STATES
    }
    assert (
        max(went_live["ts-fleet-a-gpu0"], went_live["ts-fleet-a-gpu1"])
        < went_live["ts-fleet-b-gpu0"]
    )


@pytest.mark.docker
def test_a_broken_release_stops_at_the_canary_and_the_fleet_keeps_serving(fleet, v2, tmp_path):
    """Its server never becomes healthy: the canary host's first replica is rolled back by the
    release CLI, the rollout stops there, ts-fleet-b is never touched, and the gateway serves the
    previous release from both hosts throughout."""
    previous, _ = v2
    tag = release_whose_server_is(
        fleet.built,
        f"{fleet.built.env['IMAGE_TAG']}-fleet-broken"[:128],
        tmp_path,
        'ENTRYPOINT ["/usr/local/bin/llama-server", "--no-such-flag"]\n',
    )
    bundle = bundle_of(fleet, tag)
    try:
        with Load(fleet.endpoint()) as load:
            result = fleet.playbook(
                "deploy.yml", "-e", f"release_tag={tag}", "-e", f"llm_stack_images_bundle={bundle}"
            )
            time.sleep(3)
    finally:
        bundle.unlink()
        for repo in release.release_images(fleet.built.env):
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker.from_env().images.remove(f"{repo}:{tag}")
    assert result.returncode != 0
    lines = result.stdout.splitlines()
    stopped = next((line for line in lines if f"deploy of {tag} stopped on" in line), "")
    assert stopped, result.stdout[-4000:]
    # The release CLI's own reason, carried to the rollout's last word.
    assert "stopped on ts-fleet-a: " in stopped and f"rolled back: {previous} is" in stopped, (
        stopped
    )
    # ts-fleet-b never heard of it; on ts-fleet-a only the first replica tried it.
    tried = {name for name, host, state in REPLICA_STATES
             if any(r["tag"] == tag for r in fleet.history(host, state))}  # fmt: skip
    assert tried == {"ts-fleet-a-gpu0"}
    load.report("a broken release at the canary")
    assert load.outcomes and not load.failures, load.failures[:3]
    assert fleet.releases() == dict.fromkeys(REPLICA_NAMES, previous)
    assert all(up for up, _ in fleet.servers().values())


@pytest.mark.docker
def test_fleet_rollback_by_tag_under_load(fleet, v2):
    v1 = fleet.built.env["IMAGE_TAG"]
    with Load(fleet.endpoint()) as load:
        result = fleet.playbook("rollback.yml", "-e", f"release_tag={v1}")
        time.sleep(3)
    assert result.returncode == 0, result.stdout[-6000:]
    load.report("fleet rollback by tag")
    assert load.outcomes and not load.failures, load.failures[:3]
    assert fleet.releases() == dict.fromkeys(REPLICA_NAMES, v1)


# From a host's death until the gateway has cut what was in flight there: a failed connection
# marks it down at once; else two health checks (2 s apart, 5 s connect timeout each).
MARK_DOWN_BOUND_S = 60


@pytest.mark.docker
def test_a_host_that_dies_mid_load_is_taken_out_by_the_health_check(fleet):
    """ts-fleet-b is killed (the whole host) under load: what was in flight there fails and is
    counted; the first connection that fails (or the health check: 2 checks, 2 s apart) marks it
    down, which cuts its streams at once, and from then on every request succeeds on
    ts-fleet-a's replicas. Judged from the moment the gateway itself says the server is down,
    not from a guessed window: every request started after it must succeed."""
    with Load(fleet.endpoint(), clients=3, period=0.3) as load:
        time.sleep(5)
        died = time.monotonic()
        docker.from_env().containers.get("ts-fleet-b").kill()
        while fleet.servers()["ts-fleet-b-gpu0"][0]:
            assert time.monotonic() - died < MARK_DOWN_BOUND_S, "the gateway never marked it down"
            time.sleep(0.2)
        down = time.monotonic()
        time.sleep(15)
    after = [failure for started, failure in load.outcomes if started > down]
    load.report(
        "ts-fleet-b killed mid-load (3 clients)",
        **{
            "marked down after": f"{down - died:.1f} s",
            "after that": f"{len(after)} requests, {sum(map(bool, after))} failed",
        },
    )
    assert after and not any(after), [failure for failure in after if failure][:3]
    servers = fleet.servers()
    assert not servers["ts-fleet-b-gpu0"][0] and servers["ts-fleet-a-gpu0"][0]
