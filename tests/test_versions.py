"""versions.env is the one source of pins: the Dockerfile's defaults (a bare `docker build`) are
the same values (tests/test_config.py: what `make config` hands the build is pinned by digest)."""

from __future__ import annotations

import re

import pytest

from ternary_serve import credentials
from ternary_serve.versions import PROJECT_ROOT, load_versions

# The Dockerfile's build args and the versions.env key each default stands for.
DOCKERFILE_PINS = {
    "BUILD_BASE_IMAGE": "CUDA_BUILD_IMAGE",
    "RUNTIME_BASE_IMAGE": "CUDA_RUNTIME_IMAGE",
    "GATEWAY_BASE_IMAGE": "GATEWAY_BASE_IMAGE",
    "GCC_VERSION": "GCC_VERSION",
    "ENGINE_REPO": "ENGINE_REPO",
    "ENGINE_REF": "ENGINE_REF",
    "ENGINE_COMMIT": "ENGINE_COMMIT",
    "CUDA_ARCHITECTURES": "CUDA_ARCHITECTURES",
    "TORCH_VERSION": "TORCH_VERSION",
    "TORCH_INDEX_URL": "TORCH_INDEX_URL",
}
PINS = load_versions()


def dockerfile_defaults() -> dict[str, str]:
    text = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG ([A-Z_]+)=(\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize("arg, key", sorted(DOCKERFILE_PINS.items()))
def test_the_dockerfile_defaults_are_the_pins(arg, key):
    assert dockerfile_defaults()[arg] == PINS[key]


def test_the_dockerfile_builds_its_users_with_the_service_uid_the_secrets_are_shared_with():
    """credentials.SERVICE_UID owns the state directory's secrets; the images' user must match."""
    assert dockerfile_defaults()["SERVICE_UID"] == str(credentials.SERVICE_UID)
