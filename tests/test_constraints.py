"""docker/constraints.txt: one pin for every distribution the smoke and convert images install from
PyPI (`make constraints` writes it; both Dockerfile stages install under PIP_CONSTRAINT)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from ternary_serve.versions import PROJECT_ROOT, load_versions

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

CONSTRAINTS = PROJECT_ROOT / "docker" / "constraints.txt"
ENGINE_SOURCE = PROJECT_ROOT / "vendor" / "llama.cpp"
# Installed from the build context, not PyPI: never pinned.
LOCAL = {"gguf", "ternary-serve"}
# What the images can be: Python 3.10 (Ubuntu 22.04, the CUDA runtime base) to 3.12, Linux.
PYTHONS = ("3.10.12", "3.11.2", "3.12.3")
MACHINES = ("x86_64", "aarch64")


@dataclass(frozen=True)
class Pin:
    name: str
    version: Version
    marker: Marker | None
    line: str

    def applies(self, environment: dict[str, str]) -> bool:
        return self.marker is None or self.marker.evaluate(environment)


def read_pins(path: Path = CONSTRAINTS) -> list[Pin]:
    pins = []
    for raw in path.read_text().splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw).strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert not req.url and not req.extras, f"not a plain pin: {raw!r}"
        assert len(specs) == 1 and specs[0].operator == "==", f"not an exact pin: {raw!r}"
        assert "*" not in specs[0].version, f"a wildcard is not a pin: {raw!r}"
        pins.append(Pin(canonicalize_name(req.name), Version(specs[0].version), req.marker, raw))
    return pins


def linux(python: str, machine: str = "x86_64") -> dict[str, str]:
    """The marker environment of a CPython on Linux (what packaging evaluates markers against)."""
    return {
        "implementation_name": "cpython",
        "implementation_version": python,
        "os_name": "posix",
        "platform_machine": machine,
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_system": "Linux",
        "platform_version": "",
        "python_full_version": python,
        "python_version": ".".join(python.split(".")[:2]),
        "sys_platform": "linux",
    }


def pinned(pins: list[Pin], environment: dict[str, str]) -> dict[str, Version]:
    """Name -> the one version pinned for this environment."""
    chosen: dict[str, Version] = {}
    for pin in pins:
        if pin.applies(environment):
            assert pin.name not in chosen, f"two pins of {pin.name} apply to one environment"
            chosen[pin.name] = pin.version
    return chosen


def pyproject(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def declared_requirements() -> dict[str, list[str]]:
    """What asks for each PyPI distribution the images install, by where it is declared."""
    project = pyproject(PROJECT_ROOT / "pyproject.toml")
    found = {
        "pyproject.toml [project] dependencies": project["project"]["dependencies"],
        "pyproject.toml [build-system] requires": project["build-system"]["requires"],
        "versions.env TORCH_VERSION": [f"torch=={load_versions()['TORCH_VERSION']}"],
    }
    if ENGINE_SOURCE.is_dir():  # tests/bootstrap.py engine-source (make venv) writes it
        gguf_py = pyproject(ENGINE_SOURCE / "gguf-py" / "pyproject.toml")
        found["gguf-py dependencies"] = gguf_py["project"]["dependencies"]
        found["gguf-py [build-system] requires"] = gguf_py["build-system"]["requires"]
        # What the convert stage installs, through the stage's own filter.
        found["the engine's converter requirements"] = subprocess.run(
            [
                sys.executable,
                PROJECT_ROOT / "docker" / "convert_requirements.py",
                ENGINE_SOURCE / "requirements",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
    return found


def test_every_line_is_an_exact_pin_and_no_local_package():
    pins = read_pins()
    assert pins, f"{CONSTRAINTS} pins nothing"
    assert not LOCAL & {pin.name for pin in pins}, "local packages are installed from their source"
    for python in PYTHONS:
        for machine in MACHINES:
            pinned(pins, linux(python, machine))


@pytest.mark.parametrize("python", PYTHONS)
def test_pins_satisfy_what_the_project_and_engine_declare(python):
    """A dependency added or bumped in pyproject.toml (or the engine, or TORCH_VERSION) without
    `make constraints` fails here."""
    environment = linux(python)
    versions = pinned(read_pins(), environment)
    wrong = []
    for source, requirements in declared_requirements().items():
        for text in requirements:
            req = Requirement(text)
            name = canonicalize_name(req.name)
            if name in LOCAL or (req.marker and not req.marker.evaluate(environment)):
                continue
            if name not in versions:
                wrong.append(f"{text} ({source}): not pinned")
            elif not req.specifier.contains(versions[name], prereleases=True):
                wrong.append(f"{text} ({source}): pinned at {versions[name]}")
    assert not wrong, "run `make constraints`:\n" + "\n".join(wrong)


def test_torch_pin_is_torch_version():
    torch = [pin for pin in read_pins() if pin.name == "torch"]
    assert [str(pin.version) for pin in torch] == [load_versions()["TORCH_VERSION"]]


# Run in an image by its own Python (the venv's): the marker environment, every installed
# distribution, and what a fresh venv of the base's Python holds (pip and setuptools from the base
# image, not from PyPI).
PROBE = r"""
import json, os, platform, subprocess, sys, tempfile
LIST = ("import importlib.metadata as m, json; "
        "print(json.dumps([[d.metadata['Name'], d.version] for d in m.distributions()]))")
def installed(python):
    return json.loads(subprocess.run([python, "-c", LIST], check=True, capture_output=True,
                                     text=True).stdout)
v = sys.implementation.version
seed = tempfile.mkdtemp()
subprocess.run([sys.executable, "-m", "venv", seed], check=True, capture_output=True)
print(json.dumps({
    "environment": {
        "implementation_name": sys.implementation.name,
        "implementation_version": f"{v.major}.{v.minor}.{v.micro}"
        + ("" if v.releaselevel == "final" else v.releaselevel[0] + str(v.serial)),
        "os_name": os.name,
        "platform_machine": platform.machine(),
        "platform_python_implementation": platform.python_implementation(),
        "platform_release": platform.release(),
        "platform_system": platform.system(),
        "platform_version": platform.version(),
        "python_full_version": platform.python_version(),
        "python_version": ".".join(platform.python_version_tuple()[:2]),
        "sys_platform": sys.platform,
    },
    "installed": installed(sys.executable),
    "seed": installed(os.path.join(seed, "bin", "python")),
    "constraints": open(os.environ["PIP_CONSTRAINT"]).read(),
}))
"""


@pytest.mark.docker
@pytest.mark.parametrize("image", ["SMOKE_IMAGE", "MODEL_INIT_IMAGE"])
def test_image_installs_exactly_the_pins(built, image):
    """Nothing unpinned got into the image and nothing drifted from its pin."""
    ref = f"{built.env[image]}:{built.env['IMAGE_TAG']}"
    run = subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", ref, "-c", PROBE],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout)
    assert probe["constraints"] == CONSTRAINTS.read_text(), f"{ref} was built with other pins"
    versions = pinned(read_pins(), probe["environment"])
    seed = {canonicalize_name(name): version for name, version in probe["seed"]}
    installed = {canonicalize_name(name): version for name, version in probe["installed"]}
    assert installed.keys() >= LOCAL, f"{ref} lacks the local packages"
    wrong = [
        f"{name}=={version} (pinned: {versions.get(name, 'no')})"
        for name, version in sorted(installed.items())
        if name not in LOCAL
        and not (name in versions and Version(version) == versions[name])
        and seed.get(name) != version
    ]
    assert not wrong, f"{ref} installed, against {CONSTRAINTS.name}: {wrong}"
