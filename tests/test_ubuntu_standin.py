"""The nvidia_driver and cuda_toolkit roles against a STAND-IN for Ubuntu 22.04's driver packaging
(Molecule scenario ansible/molecule/ubuntu-standin; the repositories from tests/ubuntu_standin.py).

No Ubuntu or NVIDIA repository is reachable here, so what jammy does today is reproduced locally:
the 550 and 570 packages are transitional to 580, and NVIDIA's CUDA repository offers the same
driver package names at other versions under a 600 pin. Against that, the roles must install the
pinned branch from the archive only, hold exactly what they installed, pass their version checks,
and refuse an outdated pin with a message that names the transitional package and the fix.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import ubuntu_standin
from harness import ANSIBLE_DIR, VENV_BIN, ansible_env, readable_by_containers

from ternary_serve.versions import load_versions

SCENARIO = "ubuntu-standin"
INSTANCE = "ts-molecule-ubuntu-standin"  # ansible/molecule/ubuntu-standin/molecule.yml
# What jammy offered before its driver packages became transitional (the pins before 580).
OLD_PINS = {"nvidia_driver_branch": "550", "nvidia_driver_version": "550.163.01"}


@pytest.fixture(scope="module")
def standin_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ubuntu-standin") / "repo"
    ubuntu_standin.build(root)
    readable_by_containers(root / "standin.json")
    return root


def molecule(repo: Path, *args: str, timeout: float = 600, **extra_env: str):
    return subprocess.run(
        [str(VENV_BIN / "molecule"), *args],
        cwd=ANSIBLE_DIR,
        env=ansible_env(TS_UBUNTU_STANDIN_REPO=str(repo), **extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def installed_driver_packages() -> list[str]:
    rows = subprocess.run(
        ["docker", "exec", INSTANCE, "dpkg-query", "-W", "-f",
         "${db:Status-Status} ${Package} ${Version}\n", "nvidia-*", "libnvidia-*"],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    return [row for row in rows.splitlines() if row.startswith("installed ")]


def test_the_stand_in_carries_the_pinned_branch():
    """The stand-in models jammy at one moment; a new pin in versions.env needs it updated."""
    pins = load_versions()
    assert pins["NVIDIA_DRIVER_BRANCH"] == ubuntu_standin.BRANCH
    assert ubuntu_standin.upstream(ubuntu_standin.ARCHIVE_VERSION) == pins["NVIDIA_DRIVER_VERSION"]
    # NVIDIA's versions sort above the archive's: without origin preferences apt takes them.
    newest = subprocess.run(
        ["dpkg", "--compare-versions", ubuntu_standin.NVIDIA_VERSIONS[0], "gt",
         ubuntu_standin.ARCHIVE_VERSION],
    )  # fmt: skip
    assert newest.returncode == 0


@pytest.mark.docker
def test_the_roles_install_the_pinned_branch_from_one_origin(docker_required, standin_repo):
    """molecule test: create, prepare, converge, idempotence (the second run finds NVIDIA's
    repository added), testinfra verify (tests/test_default.py of the scenario), destroy."""
    result = molecule(standin_repo, "test", "-s", SCENARIO)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-12000:]
    print("\n".join(line for line in result.stdout.splitlines() if " ---" in line))


@pytest.mark.docker
def test_an_outdated_pin_stops_before_installing_anything(docker_required, standin_repo):
    """The pins of before (550, transitional in jammy today), on a host where cuda-keyring has
    already added NVIDIA's repository: the run fails with the role's message naming the
    transitional package and versions.env, and installs nothing; with versions.env's pins the
    rerun installs the branch from the archive."""
    extra = [arg for name, value in OLD_PINS.items() for arg in ("-e", f"{name}={value}")]
    keyring = {"TS_UBUNTU_STANDIN_CUDA_KEYRING": "1"}
    try:
        for step in ("destroy", "create"):  # create runs prepare.yml too
            done = molecule(standin_repo, step, "-s", SCENARIO, **keyring)
            assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
        result = molecule(standin_repo, "converge", "-s", SCENARIO, "--", *extra)
        output = result.stdout + result.stderr
        fatal = "\n".join(line for line in output.splitlines() if "fatal:" in line)
        print(fatal)
        assert result.returncode != 0, output[-6000:]
        assert fatal, output[-6000:]
        for word in ("transitional", "versions.env", "nvidia-headless-550-server"):
            assert word in fatal, word
        assert installed_driver_packages() == []
        # With the pins fixed the same host goes through, its cuda-keyring source reused as it
        # is (a second source for that repository with another key would stop apt), and the
        # driver still comes from the archive only.
        fixed = molecule(standin_repo, "converge", "-s", SCENARIO)
        assert fixed.returncode == 0, (fixed.stdout + fixed.stderr)[-6000:]
        archive = ubuntu_standin.ARCHIVE_VERSION
        installed = installed_driver_packages()
        assert installed and all(row.endswith(f" {archive}") for row in installed), installed
    finally:
        molecule(standin_repo, "destroy", "-s", SCENARIO)
