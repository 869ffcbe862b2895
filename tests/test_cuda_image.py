"""The CUDA server image, built without a GPU: `ternary-serve config BACKEND=cuda` and
`docker compose build llama-server`, the path `make build` takes on the 4090 box, so the same
Dockerfile stages, docker/build_engine.py and ccache mount compile the engine for
CUDA_ARCHITECTURES from versions.env.

Stand-ins, because this machine reaches no registry: the base images are Debian 13's non-free
CUDA 12.4 packages (tests/bootstrap.py cuda-images; what differs from nvidia/cuda is in its
docstring), and the engine is the vendored mainline tree (ENGINE_SOURCE=local). With no GPU and no
driver, the image is checked as far as it goes without one: every library resolves but the
driver's libcuda.so.1 (the NVIDIA runtime injects it on a GPU host), the binary starts on the
toolkit's stub libcuda, and it carries device code for exactly the pinned architectures.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from bootstrap import CUDA_DEVEL_IMAGE, CUDA_RUNTIME_IMAGE
from harness import (
    REPORT_LINES,
    keep_tested_cuda_image,
    readable_by_containers,
    remove_replaced_images,
)

from ternary_serve.versions import load_versions

pytestmark = pytest.mark.docker

DEVEL_IMAGE, RUNTIME_IMAGE = CUDA_DEVEL_IMAGE, CUDA_RUNTIME_IMAGE
# The toolkit's libcuda stub (Debian's nvidia-cuda-dev; NVIDIA's: /usr/local/cuda/lib64/stubs).
STUB_LIBCUDA = "/usr/lib/x86_64-linux-gnu/stubs/libcuda.so"
SERVER_BINARY = "/usr/local/bin/llama-server"


def docker(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def copy_out(image: str, path: str, dest: Path) -> Path:
    """One file of an image (links followed), without running it (the command is never run;
    the imported stand-ins have none)."""
    created = docker("create", image, "true")
    assert created.returncode == 0, created.stderr
    container = created.stdout.strip()
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        copied = docker("cp", "-L", f"{container}:{path}", str(dest))
        assert copied.returncode == 0, copied.stderr
    finally:
        docker("rm", container)
    return dest


def expected_sm(architectures: str) -> set[str]:
    """CMake's CUDA_ARCHITECTURES list ("89", "89;90", "89-real") as cuobjdump names the ELFs."""
    return {"sm_" + arch.split("-")[0] for arch in architectures.split(";")}


@pytest.fixture(scope="module")
def cuda_image(docker_required, cuda_build, request):
    """The server image built for CUDA by Compose, beside the rest of the suite (conftest's
    cuda_build), or the one kept from an earlier run whose inputs were the same; kept under its
    inputs' key when the module's tests all passed; its tag here removed after the module (the
    layer cache and the ccache mount stay, so a rebuild is warm)."""
    failed_before = request.session.testsfailed
    for base in (DEVEL_IMAGE, RUNTIME_IMAGE):
        if docker("image", "inspect", base).returncode != 0:
            pytest.fail(f"no {base}: run `python3 tests/bootstrap.py cuda-images`")
    stack = cuda_build.stack
    image = f"{stack.env['SERVER_IMAGE']}:{stack.env['IMAGE_TAG']}"
    code, output = cuda_build.wait()
    REPORT_LINES.append(
        f"CUDA server image {image} (inputs' key {cuda_build.key}): "
        f"ready in {cuda_build.seconds:.0f} s"
    )
    try:
        assert code == 0, output
        yield {"image": image, "env": stack.env, "workdir": stack.workdir.parent}
        if request.session.testsfailed == failed_before:
            keep_tested_cuda_image(image, cuda_build.key)
    finally:
        docker("image", "rm", image)
        remove_replaced_images(stack.name)


def test_compose_builds_for_cuda_from_versions_env(cuda_image):
    pins = load_versions()
    env = cuda_image["env"]
    assert env["BACKEND"] == "cuda"
    assert env["CUDA_ARCHITECTURES"] == pins["CUDA_ARCHITECTURES"]
    assert "compose.cpu.yaml" not in env["COMPOSE_FILE"]  # the GPU stack's Compose files
    info = json.loads(
        docker("run", "--rm", "--entrypoint", "cat", cuda_image["image"],
               "/etc/llama-server/build-info.json").stdout
    )  # fmt: skip
    assert info["backend"] == "cuda"
    assert info["cuda_architectures"] == pins["CUDA_ARCHITECTURES"]
    assert "-DGGML_CUDA=ON" in info["cmake_flags"]
    assert f"-DCMAKE_CUDA_ARCHITECTURES={pins['CUDA_ARCHITECTURES']}" in info["cmake_flags"]
    labels = json.loads(docker("image", "inspect", cuda_image["image"]).stdout)[0]["Config"][
        "Labels"
    ]
    assert labels["io.ternary-serve.backend"] == "cuda"
    assert labels["io.ternary-serve.cuda-architectures"] == pins["CUDA_ARCHITECTURES"]


def test_every_library_but_the_drivers_resolves(cuda_image):
    """The engine is linked statically but for the CUDA runtime, cuBLAS and the driver API:
    the runtime image must carry the first two; libcuda.so.1 comes from the host's driver."""
    ldd = docker("run", "--rm", "--entrypoint", "ldd", cuda_image["image"], SERVER_BINARY)
    assert ldd.returncode == 0, ldd.stderr
    missing = set(re.findall(r"^\s*(\S+) => not found", ldd.stdout, re.MULTILINE))
    assert missing == {"libcuda.so.1"}, ldd.stdout
    resolved = set(re.findall(r"^\s*(\S+) => /", ldd.stdout, re.MULTILINE))
    assert {"libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12"} <= resolved, ldd.stdout


def test_starts_on_the_stub_driver(cuda_image):
    """Without a driver the loader stops it; with the toolkit's stub libcuda in its place, it
    prints its version, and its CUDA backend reaches the driver API (which the stub refuses)."""
    bare = docker("run", "--rm", cuda_image["image"], "--version")
    assert bare.returncode != 0
    assert "libcuda.so.1" in bare.stdout + bare.stderr

    stub = copy_out(DEVEL_IMAGE, STUB_LIBCUDA, cuda_image["workdir"] / "stub" / "libcuda.so.1")
    readable_by_containers(stub)
    with_stub = [
        "run", "--rm", "-v", f"{stub.parent}:/opt/cuda-stub:ro",
        "-e", "LD_LIBRARY_PATH=/opt/cuda-stub", cuda_image["image"],
    ]  # fmt: skip
    run = docker(*with_stub, "--version")
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert re.search(r"^version: \S+ \(build \d+, commit \S+\)$", output, re.MULTILINE), output
    # Built by the toolchain stage's gcc, the version versions.env pins (nvcc's host compiler too).
    gcc = load_versions()["GCC_VERSION"]
    assert re.search(rf"^built with GNU {gcc}\.\S* for ", output, re.MULTILINE), output

    devices = docker(*with_stub, "--list-devices")
    output = devices.stdout + devices.stderr
    assert devices.returncode == 0, output
    assert "ggml_cuda_init: failed to initialize CUDA: CUDA driver is a stub library" in output


def test_carries_device_code_for_the_pinned_architectures(cuda_image):
    """cuobjdump (the devel stand-in's) lists the binary's embedded cubins: one per kernel file,
    every one for the architectures versions.env pins, and PTX only for those as well."""
    binary = copy_out(cuda_image["image"], SERVER_BINARY, cuda_image["workdir"] / "llama-server")
    mount = ["-v", f"{binary}:/x/llama-server:ro", DEVEL_IMAGE, "cuobjdump"]
    elf = docker("run", "--rm", *mount, "--list-elf", "/x/llama-server")
    assert elf.returncode == 0, elf.stderr
    archs = re.findall(r"\.(sm_\d+a?)\.cubin$", elf.stdout, re.MULTILINE)
    assert archs, elf.stdout[-2000:]
    assert set(archs) == expected_sm(load_versions()["CUDA_ARCHITECTURES"]), elf.stdout[-2000:]
    ptx = docker("run", "--rm", *mount, "--list-ptx", "/x/llama-server")
    assert ptx.returncode == 0, ptx.stderr
    virtual = re.findall(r"\.(sm_\d+a?)\.ptx$", ptx.stdout, re.MULTILINE)
    assert set(virtual) <= expected_sm(load_versions()["CUDA_ARCHITECTURES"]), ptx.stdout[-2000:]
