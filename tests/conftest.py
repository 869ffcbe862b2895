"""Shared fixtures: a synthetic tiny ternary model, Docker, and the stack's images built once."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from bootstrap import CUDA_DEVEL_IMAGE, CUDA_RUNTIME_IMAGE
from harness import (
    BUILD_PROJECT,
    BUILD_TIMEOUT,
    CUDA_KEPT_REPO,
    CUDA_PROJECT,
    REPORT_LINES,
    RUN_DIR,
    BackgroundBuild,
    KeptBuild,
    Stack,
    configure,
    cuda_image_key,
    exclusive,
    readable_by_containers,
    remove_earlier_sessions_images,
    remove_replaced_images,
)

from ternary_serve import release, synthetic

# The CUDA image's tests (their build runs beside the whole suite) and the one suite that must not
# run while it builds (test_chaos restarts dockerd, which would cut a build).
CUDA_IMAGE_TESTS = "test_cuda_image.py"
CHAOS_TESTS = "test_chaos.py"


# A test that uses one of these needs dockerd: marked `docker` whether or not its module says so,
# so that `make check` (-m "not docker") never starts one.
DOCKER_FIXTURES = {"docker_required", "built", "stack_for", "molecule_fixtures"}


def pytest_collection_modifyitems(items):
    """The chaos suite and then the CUDA image's tests run last (see cuda_build)."""
    last = {CHAOS_TESTS: 1, CUDA_IMAGE_TESTS: 2}
    items.sort(key=lambda item: last.get(item.path.name, 0))
    for item in items:
        if DOCKER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.docker)


def pytest_terminal_summary(terminalreporter):
    for line in REPORT_LINES:
        terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def cuda_build(request, tmp_path_factory):
    """The CUDA server image's build (tests/test_cuda_image.py), started with the session when
    those tests are selected and run beside all the others at the lowest CPU priority: cold, it is
    about 40 minutes of CPU on 2 cores, most of which the rest of the suite leaves idle while it
    waits for health checks and timeouts. None when it is not needed."""
    selected = any(item.path.name == CUDA_IMAGE_TESTS for item in request.session.items)
    if not selected or not docker_available():
        yield None
        return
    workdir = tmp_path_factory.mktemp("cuda")
    (workdir / "models").mkdir()
    # No model in place: the config plans nothing, so it needs no nvidia-smi.
    stack = configure(
        workdir / "stack",
        workdir / "models" / "absent.gguf",
        CUDA_PROJECT,
        BACKEND="cuda",
        BUILD_BASE_IMAGE=CUDA_DEVEL_IMAGE,
        RUNTIME_BASE_IMAGE=CUDA_RUNTIME_IMAGE,
    )
    key = cuda_image_key(stack.env)
    kept = f"{CUDA_KEPT_REPO}:{key}"
    if subprocess.run(["docker", "image", "inspect", kept], capture_output=True).returncode == 0:
        REPORT_LINES.append(f"CUDA server image: inputs unchanged (key {key}), tested {kept}")
        build = KeptBuild(stack, kept)
    else:
        REPORT_LINES.append(f"CUDA server image: built for key {key}, beside the suite")
        build = BackgroundBuild(stack, ["llama-server"], marker=b"--backend\x00cuda\x00")
    build.key = key
    yield build
    build.stop()


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
    stack = configure(tmp_path_factory.mktemp("build"), tiny_model, BUILD_PROJECT)
    # Lanes share these images: the first lane of the run builds them; the others use them as they
    # are (a second clean-up would remove the tags the first lane's tests have added since).
    done = RUN_DIR / f"built-{stack.env['IMAGE_TAG']}"
    with exclusive("build"):
        if not done.exists():
            result = stack.compose("--profile", "gateway", "build", timeout=BUILD_TIMEOUT)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            remove_replaced_images(stack.name)
            remove_earlier_sessions_images(stack.name, stack.env["IMAGE_TAG"])
            done.touch()
    return stack


@pytest.fixture
def stack_for(built, tmp_path, request):
    """A fresh Compose project on the built images, serving the given model; always torn down."""
    made: list[Stack] = []

    def make(model: Path, **settings: str | None) -> Stack:
        name = "ts-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-")
        stack = configure(tmp_path / "stack", model, name, **settings)
        assert stack.env["IMAGE_TAG"] == built.env["IMAGE_TAG"]
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.down()


@pytest.fixture(scope="session")
def molecule_fixtures(built, tiny_model) -> Path:
    """What the Molecule hosts get instead of a registry: the release's images bundle (what `make
    images-bundle` writes; the llm_stack role copies and loads it) and the tiny model. Written once
    per run into the run's directory, for every lane that converges hosts; tests/lanes.py removes
    it with the run (gigabytes)."""
    fixtures = RUN_DIR / "molecule-fixtures"
    with exclusive("molecule-fixtures"):
        if not (fixtures / "release-images.tar").is_file():
            fixtures.mkdir(parents=True, exist_ok=True)
            shutil.copy(tiny_model, fixtures / "tiny-ternary.gguf")
            readable_by_containers(fixtures / "tiny-ternary.gguf")
            release.bundle(built.env, built.env["IMAGE_TAG"], fixtures / "release-images.tar")
    readable_by_containers(fixtures / "tiny-ternary.gguf")
    return fixtures
