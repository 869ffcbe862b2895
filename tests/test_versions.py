"""versions.env is the one source of pins: the Dockerfile's defaults (a bare `docker build`) are
the same values, and every base image is pinned by digest."""

from __future__ import annotations

import re

import pytest

from ternary_serve.versions import PROJECT_ROOT, load_versions

# The Dockerfile's build args and the versions.env key each default stands for.
DOCKERFILE_PINS = {
    "BUILD_BASE_IMAGE": "CUDA_BUILD_IMAGE",
    "RUNTIME_BASE_IMAGE": "CUDA_RUNTIME_IMAGE",
    "SMOKE_BASE_IMAGE": "SMOKE_BASE_IMAGE",
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
# Base images carry a tag; the project's own image names (SERVER_IMAGE, ...) do not.
BASE_IMAGES = [key for key, value in PINS.items() if key.endswith("_IMAGE") and ":" in value]


def dockerfile_defaults() -> dict[str, str]:
    text = (PROJECT_ROOT / "docker" / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG ([A-Z_]+)=(\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize("arg, key", sorted(DOCKERFILE_PINS.items()))
def test_the_dockerfile_defaults_are_the_pins(arg, key):
    assert dockerfile_defaults()[arg] == PINS[key]


def test_every_base_image_is_pinned_by_digest():
    assert len(BASE_IMAGES) >= 6, BASE_IMAGES
    for key in BASE_IMAGES:
        image = PINS[key]
        assert re.fullmatch(r"[a-z0-9./_-]+:[\w.-]+@sha256:[0-9a-f]{64}", image), (
            f"{key}={image}: pin the base image by digest (TAG@sha256:...)"
        )
