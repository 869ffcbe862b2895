"""The locked endpoint, probed from outside as an attacker or a careless client would: the API key,
the gateway (TLS, the API's paths only, CORS, body and per-client limits), the containers'
restrictions, and no secret in an image, a container's configuration, a log or a file but its own.

The real stack (CPU variant, tiny synthetic model) as deployed by default: GATEWAY and
PUBLISH_ADDRESS unset, so the gateway on loopback, the real HAProxy from Debian's package in front
of the real llama-server. Stand-ins: the base images (a debootstrapped Debian instead of
nvidia/cuda and debian-slim); the certificate is the generated one, as on a box without TLS_CERT.
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import time

import pytest
import requests
from harness import deployed, free_port

from ternary_serve import client, credentials, release
from ternary_serve.versions import PROJECT_ROOT

pytestmark = pytest.mark.docker

ORIGIN = "https://app.example.test"
CLIENT_RATE = 60
CLIENT_CONNECTIONS = 6


@pytest.fixture(scope="module")
def gateway(built, tiny_model, tmp_path_factory):
    with deployed(
        tmp_path_factory.mktemp("endpoint"),
        tiny_model,
        "ts-endpoint",
        GATEWAY=None,  # the default deployment: the gateway, on loopback too
        CORS_ORIGINS=ORIGIN,
        BODY_LIMIT_KIB="64",
        CLIENT_RATE=str(CLIENT_RATE),
        CLIENT_CONNECTIONS=str(CLIENT_CONNECTIONS),
        SLOTS="2",
        CONTEXT="1024",
    ) as stack:
        yield stack


def chat(stack, headers=None, **body):
    return requests.post(
        f"{stack.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        headers=headers if headers is not None else stack.api().headers,
        verify=stack.env["GATEWAY_TLS_FILE"],
        timeout=60,
    )


def test_the_deploy_names_the_url_the_key_and_the_certificate(gateway):
    listed = gateway.release("list")
    assert listed.returncode == 0
    again = gateway.release("deploy")  # the same release: no change, the same message
    assert again.returncode == 0, again.stderr
    said = again.stdout
    assert f"https://127.0.0.1:{gateway.env['PUBLISH_PORT']}/v1" in said
    assert gateway.env["API_KEY_FILE"] in said and gateway.env["GATEWAY_TLS_FILE"] in said
    assert "make down" in said


def test_every_endpoint_but_health_needs_the_key(gateway):
    tls = gateway.env["GATEWAY_TLS_FILE"]
    health = requests.get(f"{gateway.url}/health", verify=tls, timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    for path in ("/v1/models", "/metrics"):
        assert requests.get(f"{gateway.url}{path}", verify=tls, timeout=10).status_code == 401
        assert gateway.api().get(f"{gateway.url}{path}", timeout=10).status_code == 200
    assert chat(gateway, headers={}).status_code == 401
    assert chat(gateway, headers={"Authorization": "Bearer ts-not-the-key"}).status_code == 401
    reply = chat(gateway)
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["role"]
    # Prometheus scrapes /metrics with the key as its bearer token (README).
    metrics = gateway.api().get(f"{gateway.url}/metrics", timeout=10)
    assert "llamacpp:prompt_tokens_total" in metrics.text


def test_only_tls_on_the_published_port_and_the_server_is_not_published(gateway):
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{gateway.env['PUBLISH_PORT']}/health", timeout=10)
    with pytest.raises(requests.exceptions.SSLError):  # an untrusted certificate is refused
        requests.get(f"{gateway.url}/health", timeout=10)
    ports = subprocess.run(
        ["docker", "port", gateway.container("llama-server")], capture_output=True, text=True
    )
    assert ports.stdout.strip() == "", f"llama-server publishes {ports.stdout}"


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/slots"),
        ("GET", "/slots?fail_on_no_slot=1"),
        ("POST", "/props"),
        ("GET", "/props"),
        ("GET", "/"),
        ("GET", "/lora-adapters"),
        ("POST", "/slots/0?action=save"),
    ],
)
def test_nothing_but_the_api_is_reachable_even_with_the_key(gateway, method, path):
    reply = gateway.api().request(method, f"{gateway.url}{path}", json={}, timeout=10)
    assert reply.status_code == 404, reply.text[:200]
    assert reply.json()["error"]["message"] == "not an API path"


def test_the_engine_itself_keeps_slots_props_and_the_web_ui_off(gateway):
    """Behind the gateway too (defence in depth): the engine's own flags, asked from inside the
    server's container with the key."""
    key = credentials.read_api_key(gateway.workdir / "api-key")

    def inside(method: str, path: str) -> str:
        return subprocess.run(
            ["docker", "exec", gateway.container("llama-server"), "curl", "-s", "-o",
             "/dev/null", "-w", "%{http_code}", "-X", method, "-H", f"Authorization: Bearer {key}",
             "-H", "Content-Type: application/json", "-d", "{}" if method == "POST" else "",
             f"http://127.0.0.1:8080{path}"],
            capture_output=True, text=True,
        ).stdout  # fmt: skip

    assert inside("GET", "/v1/models") == "200"  # the control: the probe itself works
    assert inside("GET", "/slots") != "200"
    assert inside("POST", "/props") != "200"
    assert inside("GET", "/") != "200"


def test_cross_origin_requests_only_from_the_configured_origins(gateway):
    def preflight(origin: str) -> requests.Response:
        return requests.options(
            f"{gateway.url}/v1/chat/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
            verify=gateway.env["GATEWAY_TLS_FILE"],
            timeout=10,
        )

    allowed = preflight(ORIGIN)
    assert allowed.status_code == 204
    assert allowed.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Authorization" in allowed.headers["Access-Control-Allow-Headers"]
    reply = chat(gateway, headers={**gateway.api().headers, "Origin": ORIGIN})
    assert reply.status_code == 200
    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "Access-Control-Allow-Credentials" not in reply.headers
    for origin in ("https://evil.example", "null", f"{ORIGIN}.evil.example"):
        refused = preflight(origin)
        assert refused.status_code == 403
        assert "Access-Control-Allow-Origin" not in refused.headers
        assert chat(gateway, headers={**gateway.api().headers, "Origin": origin}).status_code == 403


def test_streams_pass_through_the_gateway_as_they_are_made(gateway):
    """Unbuffered: the tokens arrive spread over the time the server spent generating them (its
    own `timings`), not in one burst at the end, however fast or loaded this machine is."""
    api = client.Endpoint.of(gateway.env_now()).openai(max_retries=0, timeout=120)
    arrivals, timings = [], None
    for chunk in api.chat.completions.create(
        model="any",
        messages=[{"role": "user", "content": "Tell a story."}],
        max_tokens=300,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.monotonic())
        timings = (chunk.model_extra or {}).get("timings") or timings
    assert len(arrivals) > 100 and timings, timings
    generating_s = timings["predicted_ms"] / 1000
    spread_s = arrivals[-1] - arrivals[0]
    assert spread_s >= 0.5 * generating_s, (spread_s, generating_s)


def test_bodies_over_the_limit_or_without_a_length_are_refused(gateway):
    assert gateway.status_for_declared_body(64 * 1024 + 1) == 413
    assert gateway.status_for_declared_body(10**12) == 413
    fits = chat(gateway, messages=[{"role": "user", "content": "a" * 60 * 1024}])
    assert fits.status_code != 413
    chunked = requests.post(
        f"{gateway.url}/v1/chat/completions",
        data=iter([b'{"messages":[{"role":"user","content":"hi"}]}']),  # no length: chunked
        headers={**gateway.api().headers, "Content-Type": "application/json"},
        verify=gateway.env["GATEWAY_TLS_FILE"],
        timeout=10,
    )
    assert chunked.status_code == 411
    assert chat(gateway).status_code == 200  # and the server is fine


def test_a_declared_body_that_never_comes_is_refused_in_seconds(gateway):
    """llama-server alone waits forever for a body whose declared length never arrives, one of
    its threads held per such request: the gateway answers 408 within its 10 s."""
    started = time.monotonic()
    assert gateway.status_for_declared_body(1000) == 408
    waited_s = time.monotonic() - started
    assert waited_s < 15, f"the gateway waited {waited_s:.0f} s for the missing body"
    assert chat(gateway).status_code == 200


def inspect(container: str) -> dict:
    done = subprocess.run(["docker", "inspect", container], capture_output=True, text=True)
    return json.loads(done.stdout)[0]


def test_the_containers_are_locked_down(gateway):
    for service in ("llama-server", "gateway"):
        inspected = inspect(gateway.container(service))
        host = inspected["HostConfig"]
        assert host["ReadonlyRootfs"] is True, service
        assert host["CapDrop"] == ["ALL"] and not host["CapAdd"], service
        assert "no-new-privileges:true" in host["SecurityOpt"], service
        assert host["Memory"] > 0 and host["PidsLimit"] > 0, service
        assert inspected["Config"]["User"] == "10001:10001", service
    server = inspect(gateway.container("llama-server"))
    # llama-server's memory limit is the plan's (config wrote it into .env).
    limit = int(gateway.env_now()["SERVER_MEMORY_LIMIT"].removesuffix("m"))
    assert server["HostConfig"]["Memory"] == limit * 2**20
    written = subprocess.run(
        ["docker", "exec", gateway.container("llama-server"), "touch", "/usr/local/bin/x"],
        capture_output=True,
        text=True,
    )
    assert written.returncode != 0 and "Read-only file system" in written.stderr


def test_no_secret_in_images_container_configuration_logs_or_other_files(gateway):
    key = credentials.read_api_key(gateway.workdir / "api-key")
    pem = (gateway.workdir / "gateway.pem").read_text()
    private = pem[pem.index("-----BEGIN PRIVATE KEY-----") :].splitlines()[1]
    assert len(key) > 40 and len(private) > 40
    for name in ("api-key", "gateway.pem"):
        found = (gateway.workdir / name).stat()
        assert oct(found.st_mode & 0o777) == "0o640" and found.st_gid == credentials.SERVICE_UID
    env = gateway.env_now()
    images = [f"{repo}:{env['IMAGE_TAG']}" for repo in release.release_images(env)]
    places = {
        "docker inspect (images)": subprocess.run(
            ["docker", "image", "inspect", *images], capture_output=True, text=True
        ).stdout,
        "docker inspect (containers)": subprocess.run(
            ["docker", "inspect", *gateway.compose("ps", "-aq").stdout.split()],
            capture_output=True,
            text=True,
        ).stdout,
        "logs": gateway.compose("logs", "--no-color").stdout,
    }
    for image in images:
        places[f"history {image}"] = subprocess.run(
            ["docker", "history", "--no-trunc", image], capture_output=True, text=True
        ).stdout
    for path in gateway.workdir.iterdir():
        if path.is_file() and path.name not in ("api-key", "gateway.pem"):
            places[path.name] = path.read_text(errors="replace")
    assert "releases.jsonl" in places and ".env" in places
    for where, text in places.items():
        assert key not in text, f"the API key is in {where}"
        assert private not in text, f"the TLS private key is in {where}"


def test_rotate_key_goes_through_the_release_gate(gateway):
    old = credentials.read_api_key(gateway.workdir / "api-key")
    rotated = gateway.release("rotate-key")
    assert rotated.returncode == 0, rotated.stdout[-2000:] + rotated.stderr[-2000:]
    assert "smoke passed" in rotated.stdout
    new = credentials.read_api_key(gateway.workdir / "api-key")
    assert new != old
    assert chat(gateway, headers={"Authorization": f"Bearer {old}"}).status_code == 401
    assert chat(gateway, headers={"Authorization": f"Bearer {new}"}).status_code == 200
    history = [json.loads(line) for line in (gateway.workdir / "releases.jsonl").open()]
    assert history[-1]["event"] == "rotate-key" and history[-1]["status"] == "live"


def test_a_busy_port_is_refused_before_anything_is_built(gateway, tiny_model, tmp_path):
    with socket.socket() as holder:
        port = free_port()
        holder.bind(("127.0.0.1", port))
        holder.listen()
        refused = subprocess.run(
            [sys.executable, "-m", "ternary_serve.cli", "config", f"PUBLISH_PORT={port}",
             "--env-file", str(tmp_path / ".env"), "--state-dir", str(tmp_path)],
            capture_output=True, text=True, cwd=PROJECT_ROOT,
        )  # fmt: skip
    assert refused.returncode == 1
    assert refused.stderr.strip().count("\n") == 0, refused.stderr
    assert f"PUBLISH_PORT={port}" in refused.stderr and "in use" in refused.stderr
    assert not (tmp_path / ".env").exists()
    # The stack's own port, held by its own gateway, is no reason to refuse a redeploy.
    again = gateway.release("deploy")
    assert again.returncode == 0, again.stderr


def test_per_client_connection_and_request_limits(gateway):
    """Last in this module: it spends the client's request budget."""
    context = ssl.create_default_context(cafile=gateway.env["GATEWAY_TLS_FILE"])
    port = int(gateway.env["PUBLISH_PORT"])
    held = []
    try:
        for _ in range(CLIENT_CONNECTIONS):
            held.append(context.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                                            server_hostname="localhost"))  # fmt: skip
        extra = socket.create_connection(("127.0.0.1", port), timeout=10)
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            context.wrap_socket(extra, server_hostname="localhost").recv(1)
    finally:
        for conn in held:
            conn.close()
    time.sleep(1)
    codes = [
        requests.get(
            f"{gateway.url}/health", verify=gateway.env["GATEWAY_TLS_FILE"], timeout=10
        ).status_code
        for _ in range(CLIENT_RATE + 5)
    ]
    assert 429 in codes and codes[0] == 200, codes
