"""Shared fixtures: a synthetic tiny ternary model, and Docker availability."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ternary_serve import synthetic


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A llama GGUF with Q2_0 ternary linear weights, written by the project's own generator."""
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
