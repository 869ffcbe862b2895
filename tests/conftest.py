"""Shared fixtures: a synthetic tiny ternary model, Docker, and the stack's images built once."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from harness import BUILD_TIMEOUT, Stack, configure, remove_replaced_images

from ternary_serve import synthetic


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A qwen35 GGUF (Bonsai 2's hybrid DeltaNet/attention architecture, scaled down) with Q2_0
    ternary weight matrices, written by the project's own generator."""
    path = tmp_path_factory.mktemp("models") / "tiny-ternary.gguf"
    return synthetic.write_model(path, "tiny", seed=0)


def docker_available() -> bool:
    return (
        bool(shutil.which("docker"))
        and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )


@pytest.fixture(scope="session")
def docker_required():
    if not docker_available():
        pytest.fail("dockerd is not running: run `make bootstrap` (make test does it for you)")


@pytest.fixture(scope="session")
def built(docker_required, tmp_path_factory, tiny_model) -> Stack:
    """Build the release's images once, as `make build` does (BuildKit and ccache make rebuilds
    cheap)."""
    stack = configure(tmp_path_factory.mktemp("build"), tiny_model, "ts-build")
    result = stack.compose("--profile", "gateway", "build", timeout=BUILD_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    remove_replaced_images(stack.name)
    return stack


@pytest.fixture
def stack_for(built, tmp_path, request):
    """A fresh Compose project on the built images, serving the given model; always torn down."""
    made: list[Stack] = []

    def make(model: Path, **settings: str) -> Stack:
        name = "ts-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
        stack = configure(tmp_path / "stack", model, name, **settings)
        assert stack.env["IMAGE_TAG"] == built.env["IMAGE_TAG"]
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.down()
