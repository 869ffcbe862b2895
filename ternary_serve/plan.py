"""Turn versions.env plus the operator's choices into what Compose reads.

Writes two files, each atomically (temp file + rename), so a crash never leaves half a config:
  .env                    Compose's project environment: build args, image names and tag, files
  state/llama-server.env  llama-server flags, rendered from templates/llama-server.env.j2
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jinja2

from ternary_serve.versions import PROJECT_ROOT, load_versions

SERVER_TEMPLATE = "llama-server.env.j2"
COMPOSE_FILES = {"cuda": "compose.yaml", "cpu": "compose.yaml:compose.cpu.yaml"}
ENGINE_SOURCES = ("git", "local")
TAG_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class ConfigError(Exception):
    """A choice that cannot produce a working stack; the message names the fix."""


@dataclass(frozen=True)
class Choices:
    backend: str = "cuda"
    engine_source: str = "git"
    project_name: str = "ternary-serve"
    model_dir: Path = PROJECT_ROOT / "models"
    model_file: str = "model.gguf"
    model_source: str = ""
    model_sha256: str = ""
    model_type: str = "Q2_0"
    # The smoke test's quality gate: auto (the model's catalog entry; none for synthetic models),
    # none, or a gate name from models.yaml.
    quality_gate: str = "auto"
    publish_address: str = "127.0.0.1"
    publish_port: int = 8080
    build_base_image: str | None = None
    runtime_base_image: str | None = None
    smoke_base_image: str | None = None
    # The project's commit for the image tag; default: this checkout's (git). Provisioning passes
    # the controller's, since the copy on the host is no git checkout.
    revision: str | None = None


def engine_pins(pins: dict[str, str], engine_source: str) -> dict[str, str]:
    """Repo/ref/commit of the engine: the pinned fork from git, or the vendored mainline tree."""
    if engine_source == "local":
        return {
            "ENGINE_REPO": pins["MAINLINE_ENGINE_REPO"],
            "ENGINE_REF": pins["OFFLINE_ENGINE_REF"],
            "ENGINE_COMMIT": pins["OFFLINE_ENGINE_COMMIT"],
        }
    return {key: pins[key] for key in ("ENGINE_REPO", "ENGINE_REF", "ENGINE_COMMIT")}


def image_tag(
    project_version: str, revision: str, engine_ref: str, backend: str, cuda_architectures: str
) -> str:
    """<version>-<commit>-<engine ref>-<backend>[-sm<archs>]: `docker images` tells what it is."""
    parts = [project_version, revision, engine_ref, backend]
    if backend == "cuda":
        parts.append("sm" + "-".join(cuda_architectures.split(";")))
    return TAG_UNSAFE.sub("-", "-".join(parts))[:128]


def project_revision() -> str:
    """Short commit of this checkout, with -dirty when tracked files differ from it."""
    git = ["git", "-C", str(PROJECT_ROOT)]
    head = subprocess.run([*git, "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    clean = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True).returncode == 0
    return head.stdout.strip() + ("" if clean else "-dirty")


def compose_env(pins: dict[str, str], choices: Choices, server_env: Path) -> dict[str, str]:
    backend = choices.backend
    if backend not in COMPOSE_FILES:
        raise ConfigError(f"unknown backend {backend!r}: choose cuda or cpu")
    if choices.engine_source not in ENGINE_SOURCES:
        raise ConfigError(f"unknown engine source {choices.engine_source!r}: choose git or local")
    if (
        choices.engine_source == "local"
        and not (PROJECT_ROOT / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file()
    ):
        raise ConfigError(
            "engine source 'local' needs vendor/llama.cpp: run "
            "`python3 tests/bootstrap.py engine-source`"
        )
    engine = engine_pins(pins, choices.engine_source)
    prefix = backend.upper()
    revision = choices.revision or project_revision()
    return {
        "COMPOSE_PROJECT_NAME": choices.project_name,
        "COMPOSE_FILE": COMPOSE_FILES[backend],
        "BACKEND": backend,
        "ENGINE_SOURCE": choices.engine_source,
        **engine,
        "CUDA_ARCHITECTURES": pins["CUDA_ARCHITECTURES"],
        "GCC_VERSION": pins["GCC_VERSION"],
        "PROJECT_VERSION": pins["PROJECT_VERSION"],
        "PROJECT_REVISION": revision,
        "BUILD_BASE_IMAGE": choices.build_base_image or pins[f"{prefix}_BUILD_IMAGE"],
        "RUNTIME_BASE_IMAGE": choices.runtime_base_image or pins[f"{prefix}_RUNTIME_IMAGE"],
        "SMOKE_BASE_IMAGE": choices.smoke_base_image or pins["SMOKE_BASE_IMAGE"],
        "SERVER_IMAGE": pins["SERVER_IMAGE"],
        "SMOKE_IMAGE": pins["SMOKE_IMAGE"],
        "MODEL_INIT_IMAGE": pins["MODEL_INIT_IMAGE"],
        "TORCH_VERSION": pins["TORCH_VERSION"],
        "TORCH_INDEX_URL": pins["TORCH_INDEX_URL"],
        "IMAGE_TAG": image_tag(
            pins["PROJECT_VERSION"],
            revision,
            engine["ENGINE_REF"],
            backend,
            pins["CUDA_ARCHITECTURES"],
        ),
        "MODEL_DIR": str(choices.model_dir.resolve()),
        "MODEL_FILE": choices.model_file,
        "MODEL_SOURCE": choices.model_source,
        "MODEL_SHA256": choices.model_sha256,
        "MODEL_TYPE": choices.model_type,
        "QUALITY_GATE": choices.quality_gate,
        "SERVER_PORT": "8080",
        "PUBLISH_ADDRESS": choices.publish_address,
        "PUBLISH_PORT": str(choices.publish_port),
        "SERVER_ENV_FILE": str(server_env),
    }


def render_server_env(variables: dict) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(PROJECT_ROOT / "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return env.get_template(SERVER_TEMPLATE).render(**variables)


def write_atomic(path: Path, text: str) -> bool:
    """Replace path with text in one rename; returns False (and leaves it alone) if unchanged."""
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def configure(
    choices: Choices,
    env_file: Path = PROJECT_ROOT / ".env",
    state_dir: Path = PROJECT_ROOT / "state",
) -> dict[str, str]:
    """Write the Compose env file and the rendered server flags; returns the Compose variables."""
    server_env = state_dir.resolve() / "llama-server.env"
    env = compose_env(load_versions(), choices, server_env)
    header = (
        "# Generated by `ternary-serve config` from versions.env; rerun it rather than editing.\n"
    )
    changed = write_atomic(env_file, header + "".join(f"{k}={v}\n" for k, v in env.items()))
    changed |= write_atomic(
        server_env,
        render_server_env(
            {
                "backend": choices.backend,
                "model_file": choices.model_file,
                "server_port": int(env["SERVER_PORT"]),
            }
        ),
    )
    if not changed:
        print("config: unchanged", file=sys.stderr)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve config", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=sorted(COMPOSE_FILES), default="cuda")
    ap.add_argument(
        "--engine-source",
        choices=ENGINE_SOURCES,
        default="git",
        help="git: clone the pinned engine; local: build vendor/llama.cpp (offline)",
    )
    ap.add_argument(
        "--project-name",
        default=Choices.project_name,
        help="Compose project name (one per stack on a host)",
    )
    ap.add_argument("--model-dir", type=Path, default=Choices.model_dir)
    ap.add_argument("--model-file", default=Choices.model_file)
    ap.add_argument(
        "--model-source",
        default="",
        help="what model-init fetches when the file is not in place (a models.yaml "
        "name, https://, hf://, a path)",
    )
    ap.add_argument("--model-sha256", default="", help="the model's expected SHA-256")
    ap.add_argument(
        "--model-type",
        default=Choices.model_type,
        help="the type model-init converts a checkpoint source to (default Q2_0)",
    )
    ap.add_argument(
        "--quality-gate",
        default=Choices.quality_gate,
        help="the smoke test's questions: auto (from the model), none, or a models.yaml gate",
    )
    ap.add_argument("--publish-address", default=Choices.publish_address)
    ap.add_argument("--publish-port", type=int, default=Choices.publish_port)
    ap.add_argument("--build-base-image", help="override the pinned build base image")
    ap.add_argument("--runtime-base-image", help="override the pinned runtime base image")
    ap.add_argument("--smoke-base-image", help="override the pinned smoke base image")
    ap.add_argument("--revision", help="the project's commit for the image tag (default: git's)")
    ap.add_argument(
        "--env-file",
        type=Path,
        default=PROJECT_ROOT / ".env",
        help="where to write Compose's env file (default: .env)",
    )
    ap.add_argument(
        "--state-dir",
        type=Path,
        default=PROJECT_ROOT / "state",
        help="where to write llama-server.env (default: state/)",
    )
    args = vars(ap.parse_args(argv))
    env_file, state_dir = args.pop("env_file"), args.pop("state_dir")
    try:
        env = configure(Choices(**args), env_file, state_dir)
    except ConfigError as exc:
        print(f"config: {exc}", file=sys.stderr)
        return 1
    print(
        f"config: {env['BACKEND']} stack, image tag {env['IMAGE_TAG']}, "
        f"model {env['MODEL_DIR']}/{env['MODEL_FILE']}"
    )
    return 0
