"""A fleet: serving hosts with one replica per GPU, behind one HAProxy gateway host.

`ternary-serve fleet key --out DIR` generates the fleet's API key once (DIR/api-key); every
replica serves with it (`ternary-serve config --api-key-from`).

`ternary-serve fleet gateway --out DIR --replicas FILE [FILE ...] --address ADDR --tls-file PATH
--stats-socket PATH --api-key-file PATH [NAME=value ...]` writes, on the controller, what the
gateway host gets (the llm_gateway role copies it there; the PATHs are where it puts them):
  haproxy.cfg     templates/haproxy.cfg.j2 with every replica as a backend server: the frontend of
                  a single host's gateway (TLS, limits per client, CORS, the API's paths only),
                  least-connections balancing, active /health checks, the runtime API for draining
                  and a Prometheus exporter
  gateway.pem     its TLS certificate and key: TLS_CERT/TLS_KEY, or one generated once for ADDR
  prometheus.yml  a Prometheus scrape configuration for every replica and the gateway
Each FILE is a serving host's replicas.json, JSON: [{"name": "gpu-box-1-gpu0", "address":
"10.0.0.11", "port": 8080, "slots": 4}, ...] (the llm_gateway role fetches one from every host).
The settings are the stack's (`ternary-serve settings`).
Every file is written in one rename, and only when it changes.

`ternary-serve fleet replicas --host NAME --dir DIR --gpu-count N [--gpus N ...] [--fleet]
[--manifest --address ADDR] [NAME=value ...]` prints, as JSON, a serving host's replicas (one
per GPU) as the llm_stack role deploys them: name, directory, env file, state directory, Compose
project, port and settings of each. With --manifest, what replicas.json holds for the gateway and
the rollouts: name, address, port, planned slots (from each replica's .env), project, files.

`ternary-serve fleet deployed --host NAME --dir DIR [--env-file E --state-dir S]` prints, as JSON,
the replicas deployed on this host (DIR/replicas.json), or on a host set up by hand (`make up`)
the checkout's one project (its .env and state/, or E and S): what a rollout and the fleet's
`releases.yml` walk through.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ternary_serve import config, credentials, envfile, errors, settings
from ternary_serve.files import write_atomic

HAPROXY_CONFIG = "haproxy.cfg"
TLS_FILE = "gateway.pem"
PROMETHEUS_CONFIG = "prometheus.yml"
PROMETHEUS_TEMPLATE = "prometheus.yml.j2"
REPLICAS_FILE = "replicas.json"
HAPROXY_USER = "haproxy"
METRICS_PORT = 8405
SERVER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FleetError(errors.ServeError):
    """An inventory or setting the fleet's gateway cannot be rendered from; names the fix."""


def backends(replicas: list[dict]) -> list[config.Backend]:
    """The replicas as the gateway's servers, checked: unique names HAProxy accepts, a port, an
    address other than IPv6 (HAProxy and Prometheus would need it bracketed)."""
    found, seen = [], set()
    for replica in replicas:
        try:
            name, address, port = replica["name"], str(replica["address"]), int(replica["port"])
            slots = int(replica["slots"]) if replica.get("slots") else None
        except (KeyError, TypeError, ValueError) as exc:
            raise FleetError(
                f"replica {replica!r}: needs name, address, port (and slots) ({exc})"
            ) from None
        if not SERVER_NAME.fullmatch(name) or name in seen:
            raise FleetError(
                f"replica name {name!r}: use letters, digits, '.', '-', '_', once each "
                "(inventory host names)"
            )
        try:
            if ipaddress.ip_address(address).version == 6:
                raise FleetError(
                    f"replica {name}: {address} is IPv6; set the host's ansible_host to its "
                    "name or IPv4 address"
                )
        except ValueError:
            pass  # a host name
        if not 0 < port < 65536:
            raise FleetError(f"replica {name}: port {port} is not a TCP port")
        seen.add(name)
        found.append(config.Backend(name, address, port, slots))
    if not found:
        raise FleetError("no replicas: the inventory's llm_servers group is empty")
    return found


@dataclass(frozen=True)
class GatewayHost:
    """The gateway host as its configuration names it: address, port, and where the llm_gateway
    role puts the certificate, the runtime API's socket and the scrape's key file."""

    address: str
    port: int
    tls_file: str
    stats_socket: str
    api_key_file: str


def render(values: dict[str, str], servers: list[config.Backend], host: GatewayHost) -> dict:
    """The gateway host's configuration files (not the secrets), by file name."""
    placement = config.GatewayPlacement(
        port=host.port,
        run_as=HAPROXY_USER,
        tls_file=host.tls_file,
        stats_socket=host.stats_socket,
        docker_dns=False,
        metrics_bind=f"{host.address}:{METRICS_PORT}",
    )
    prometheus = (
        config.templates()
        .get_template(PROMETHEUS_TEMPLATE)
        .render(
            servers=servers,
            api_key_file=host.api_key_file,
            metrics_target=f"{host.address}:{METRICS_PORT}",
        )
    )
    return {
        HAPROXY_CONFIG: config.render_gateway(values, servers, placement),
        PROMETHEUS_CONFIG: prometheus,
    }


def gateway(out: Path, replicas: list[dict], host: GatewayHost, given: dict[str, str]) -> bool:
    """Write the gateway's files into out; True when any of them changed."""
    values = settings.resolve({}, given)
    files = render(values, backends(replicas), host)
    changed = False
    for name, text in files.items():
        changed |= write_atomic(out / name, text, 0o644)
    # A controller-side copy, readable by its owner only; the role sets owners on the host.
    changed |= credentials.ensure_tls(
        out / TLS_FILE,
        values["TLS_CERT"],
        values["TLS_KEY"],
        host.address,
        names=["localhost"],
        group=None,
    )
    return changed


def replica_gpus(backend: str, gpu_count: int, asked: list[int] | None) -> list[int]:
    """The GPUs that get a replica: those asked for, else every GPU found; one on a cpu stack."""
    if asked:
        if len(set(asked)) < len(asked):
            raise FleetError(f"llm_stack_gpus {asked}: each GPU once")
        missing = [gpu for gpu in asked if backend == "cuda" and not 0 <= gpu < gpu_count]
        if missing:
            raise FleetError(
                f"llm_stack_gpus asks for GPU {', '.join(map(str, missing))}; this host has "
                f"{gpu_count} (nvidia-smi index 0 to {gpu_count - 1})"
            )
        return asked
    if backend == "cpu":
        return [0]
    if gpu_count < 1:
        raise FleetError("no NVIDIA GPU visible: run the nvidia_driver role and reboot")
    return list(range(gpu_count))


def replicas(
    host: str,
    base_dir: Path,
    given: dict[str, str],
    gpu_count: int,
    gpus: list[int] | None = None,
    fleet: bool = False,
) -> list[dict]:
    """A serving host's replicas, one per GPU: the first keeps the checkout's own .env, state/
    and Compose project (`make` on the host works on it), the others live in replicas/gpuN/
    under a project of their own; ports count up from PUBLISH_PORT. In a fleet each serves
    without a gateway of its own, on an address the fleet's gateway reaches."""
    values = settings.resolve({}, given)
    port, project = int(values["PUBLISH_PORT"]), values["PROJECT_NAME"]
    fleet_settings = {"GATEWAY": "off", "PUBLISH_ADDRESS": given.get("PUBLISH_ADDRESS", "0.0.0.0")}
    found = []
    for index, gpu in enumerate(replica_gpus(values["BACKEND"], gpu_count, gpus)):
        first = index == 0
        directory = base_dir if first else base_dir / "replicas" / f"gpu{gpu}"
        name = project if first else f"{project}-gpu{gpu}"
        if port + index > 65535:
            raise FleetError(
                f"PUBLISH_PORT={port}: replica {index + 1} would need port {port + index}"
            )
        found.append(
            {
                "name": f"{host}-gpu{gpu}",
                "dir": str(directory),
                "env_file": str(directory / ".env"),
                "state_dir": str(directory / "state"),
                "project": name,
                "port": port + index,
                "settings": {
                    **given,
                    "GPU": str(gpu),
                    "PUBLISH_PORT": str(port + index),
                    "PROJECT_NAME": name,
                    **(fleet_settings if fleet else {}),
                },
            }
        )
    return found


def manifest(found: list[dict], address: str) -> list[dict]:
    """replicas.json: what the fleet's gateway and a rollout know of the replicas, with the
    slots each one's memory plan gave it (empty while it has not planned)."""
    rows = []
    for replica in found:
        env_file = Path(replica["env_file"])
        env = envfile.read(env_file) if env_file.is_file() else {}
        rows.append(
            {
                "name": replica["name"],
                "address": address,
                "port": replica["port"],
                "slots": env.get("SERVER_SLOTS", ""),
                "project": replica["project"],
                "env_file": replica["env_file"],
                "state_dir": replica["state_dir"],
            }
        )
    return rows


def deployed(
    host: str, base_dir: Path, env_file: Path | None, state_dir: Path | None
) -> list[dict]:
    """The replicas the llm_stack role deployed on this host (its replicas.json), else the
    checkout's one project (a host set up by hand)."""
    path = base_dir / REPLICAS_FILE
    if path.is_file():
        return read_replicas(path)
    env_file, state_dir = env_file or base_dir / ".env", state_dir or base_dir / "state"
    return [{"name": host, "env_file": str(env_file), "state_dir": str(state_dir)}]


def replicas_main(args: argparse.Namespace) -> int:
    given = settings.parse_assignments(args.assignments)
    found = replicas(args.host, args.dir, given, args.gpu_count, args.gpus, args.fleet)
    if args.manifest:
        if not args.address:
            raise FleetError("--manifest needs --address (where the gateway reaches the host)")
        found = manifest(found, args.address)
    print(json.dumps(found))
    return 0


def add_replicas(sub) -> None:
    rep = sub.add_parser("replicas", help="a serving host's replicas, one per GPU, as JSON")
    rep.add_argument("assignments", nargs="*", metavar="NAME=value", help="the stack's settings")
    rep.add_argument("--host", required=True, help="the host's inventory name")
    rep.add_argument("--dir", type=Path, required=True, help="the project's directory there")
    rep.add_argument("--gpu-count", type=int, default=0, help="GPUs nvidia-smi lists there")
    rep.add_argument("--gpus", type=int, nargs="*", help="GPU indices (default: every GPU)")
    rep.add_argument("--fleet", action="store_true", help="behind a fleet's gateway")
    rep.add_argument("--manifest", action="store_true", help="replicas.json, with planned slots")
    rep.add_argument("--address", help="where the fleet's gateway reaches the host (--manifest)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve fleet", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="action", required=True)
    key = sub.add_parser("key", help="the fleet's API key on the controller, generated once")
    key.add_argument("--out", type=Path, required=True, help="directory for the key file")
    gw = sub.add_parser("gateway", help="render the fleet gateway's files on the controller")
    gw.add_argument("assignments", nargs="*", metavar="NAME=value", help="the stack's settings")
    gw.add_argument("--out", type=Path, required=True, help="directory for the files")
    gw.add_argument(
        "--replicas", type=Path, nargs="+", required=True, help="each serving host's replicas.json"
    )
    gw.add_argument("--address", required=True, help="the gateway's address (certificate, metrics)")
    gw.add_argument("--port", type=int, default=443, help="the port clients connect to")
    gw.add_argument("--tls-file", required=True, help="the certificate's path on the gateway")
    gw.add_argument("--stats-socket", required=True, help="the runtime API's socket there")
    gw.add_argument("--api-key-file", required=True, help="the scrape's key file there")
    add_replicas(sub)
    here = sub.add_parser("deployed", help="the replicas deployed on this host, as JSON")
    here.add_argument("--host", required=True, help="the host's inventory name")
    here.add_argument("--dir", type=Path, required=True, help="the project's directory here")
    here.add_argument("--env-file", type=Path, help="without replicas.json (default DIR/.env)")
    here.add_argument("--state-dir", type=Path, help="without replicas.json (default DIR/state)")
    args = ap.parse_args(argv)
    return errors.run("fleet", lambda: act(args))


def act(args: argparse.Namespace) -> int:
    if args.action == "replicas":
        return replicas_main(args)
    if args.action == "deployed":
        print(json.dumps(deployed(args.host, args.dir, args.env_file, args.state_dir)))
        return 0
    if args.action == "key":
        path = args.out / credentials.API_KEY_FILE
        changed = credentials.ensure_api_key(path, group=None)
        print(f"fleet: {'generated' if changed else 'unchanged'}: {path}")
        return 0
    replicas = [replica for path in args.replicas for replica in read_replicas(path)]
    host = GatewayHost(args.address, args.port, args.tls_file, args.stats_socket, args.api_key_file)
    changed = gateway(args.out, replicas, host, settings.parse_assignments(args.assignments))
    print(f"fleet: {'written' if changed else 'unchanged'}: {args.out} ({len(replicas)} replicas)")
    return 0


def read_replicas(path: Path) -> list[dict]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FleetError(f"cannot read the replicas in {path} ({exc})") from None
    if not isinstance(found, list):
        raise FleetError(f"{path}: not a list of replicas (`fleet replicas --manifest` writes one)")
    return found
