"""Provisioning: site.yml on a systemd Debian 13 container with Molecule (converge, idempotence,
check mode, testinfra), and early failures on broken input.

The Molecule scenario (ansible/molecule/default) installs the real Debian packages (gcc-11, the
550.163 driver, CUDA 12.4.131, docker.io) and deploys the real CPU stack inside the container on
the images this test session built. What cannot run in a container or be reached from here is
replaced by stand-ins named in molecule.yml; the README lists what is verified only on a real box.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import readable_by_containers

from ternary_serve import release
from ternary_serve.versions import PROJECT_ROOT, load_versions

ANSIBLE_DIR = PROJECT_ROOT / "ansible"
MOLECULE_DOCKER_VOLUME = "ts-molecule-docker"  # ansible/molecule/default/molecule.yml
VENV_BIN = Path(sys.executable).parent


def ansible_env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        "ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles"),
        **extra,
    }


def playbook(*args: str, cwd: Path = ANSIBLE_DIR) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV_BIN / "ansible-playbook"), *args],
        cwd=cwd,
        env=ansible_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def local_inventory(tmp_path) -> Path:
    inventory = tmp_path / "inventory"
    inventory.write_text(
        "[llm_servers]\n"
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n"
    )
    return inventory


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"nvidia_driver_secure_boot": "maybe"},
         "value of nvidia_driver_secure_boot must be one of: fail, sign"),
        ({"llm_stack_settings": {"BACKEND": "rocm"}},
         "settings: BACKEND=rocm: choose cuda or cpu"),
        ({"llm_stack_settings": {"CONTXT": 4096}},
         "CONTXT is not a setting: did you mean CONTEXT?"),
        ({"docker_daemon_options": "not-a-dict"}, "docker_daemon_options"),
    ],
)  # fmt: skip
def test_site_yml_stops_on_a_wrong_variable_before_changing_anything(
    local_inventory, extra, message
):
    args = ["-e", json.dumps(extra)]
    result = playbook("--check", "-i", str(local_inventory), "site.yml", *args)
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-2000:]
    # The pre-task failed: no role ran.
    assert "TASK [nvidia_driver" not in result.stdout


def test_a_role_without_its_required_pin_stops_with_the_argument_specs_message(
    tmp_path, local_inventory
):
    play = tmp_path / "play.yml"
    play.write_text("- hosts: llm_servers\n  gather_facts: false\n  roles:\n    - role: gcc\n")
    result = playbook("--check", "-i", str(local_inventory), str(play))
    assert result.returncode != 0
    assert "missing required arguments: gcc_version" in result.stdout, result.stdout[-2000:]


def test_a_broken_inventory_stops_the_run(tmp_path):
    inventory = tmp_path / "inventory"
    inventory.write_text("[llm_servers\ngpu-box ansible_host=\n")
    result = playbook("-i", str(inventory), "site.yml")
    assert result.returncode != 0
    assert "unable to parse" in (result.stdout + result.stderr).lower()


@pytest.fixture
def molecule_fixtures(built, tiny_model, tmp_path_factory):
    """What the test host gets instead of a registry: the release images and the tiny model."""
    fixtures = tmp_path_factory.mktemp("molecule-fixtures")
    shutil.copy(tiny_model, fixtures / "tiny-ternary.gguf")
    images = [f"{repo}:{built.env['IMAGE_TAG']}" for repo in release.release_images(built.env)]
    subprocess.run(
        ["docker", "save", "-o", str(fixtures / "release-images.tar"), *images],
        check=True,
        timeout=900,
    )
    readable_by_containers(fixtures / "release-images.tar")
    readable_by_containers(fixtures / "tiny-ternary.gguf")
    yield fixtures
    (fixtures / "release-images.tar").unlink()  # gigabytes: not left in pytest's kept temp dirs


@pytest.mark.docker
def test_site_yml_converges_idempotently_and_serves(molecule_fixtures):
    """molecule test: create, prepare, converge, idempotence (zero changed), check mode,
    testinfra verify, destroy."""
    # The nested dockerd's data volume outlives the instance: start and end without it.
    subprocess.run(["docker", "volume", "rm", "-f", MOLECULE_DOCKER_VOLUME], capture_output=True)
    result = subprocess.run(
        [str(VENV_BIN / "molecule"), "test"],
        cwd=ANSIBLE_DIR,
        env=ansible_env(TS_MOLECULE_FIXTURES=str(molecule_fixtures)),
        capture_output=True,
        text=True,
        timeout=3000,
    )
    subprocess.run(["docker", "volume", "rm", "-f", MOLECULE_DOCKER_VOLUME], capture_output=True)
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
    # Phase timings for the README (ansible.posix.profile_roles).
    print("\n".join(line for line in result.stdout.splitlines() if " ---" in line))


def test_ubuntu_sources_and_packages_render_from_the_pins(tmp_path, local_inventory):
    """Rendering test, a stand-in for Ubuntu 22.04 (no Ubuntu or NVIDIA apt repository is
    reachable here): the Ubuntu variables of the roles, rendered by Ansible with the pins from
    versions.env, name NVIDIA's and Docker's real repositories and the pinned packages."""
    out = tmp_path / "rendered.json"
    play = tmp_path / "render.yml"
    roles = ANSIBLE_DIR / "roles"
    play.write_text(
        f"""
- hosts: localhost
  gather_facts: false
  vars:
    ansible_distribution: Ubuntu
    ansible_distribution_version: "22.04"
    ansible_distribution_release: jammy
  tasks:
    - ansible.builtin.include_vars: {ANSIBLE_DIR / "group_vars/all.yml"}
    - ansible.builtin.include_vars: {roles / "nvidia_driver/vars/Ubuntu.yml"}
    - ansible.builtin.include_vars: {roles / "cuda_toolkit/defaults/main.yml"}
    - ansible.builtin.include_vars: {roles / "cuda_toolkit/vars/Ubuntu.yml"}
    - ansible.builtin.include_vars: {roles / "docker/defaults/main.yml"}
    - ansible.builtin.include_vars: {roles / "docker/vars/main.yml"}
    - ansible.builtin.copy:
        dest: {out}
        content: "{{{{ rendered | to_json }}}}"
        mode: "0644"
      vars:
        rendered:
          driver: "{{{{ nvidia_driver_packages }}}}"
          driver_version: "{{{{ nvidia_driver_version }}}}"
          cuda_repo: "{{{{ cuda_toolkit_ubuntu_repo }}}}"
          cuda_packages: "{{{{ cuda_toolkit_packages }}}}"
          cuda_home: "{{{{ cuda_toolkit_home }}}}"
          docker_repo: "{{{{ docker_apt_repo }}}}"
          docker_packages: "{{{{ docker_packages.upstream }}}}"
"""
    )
    versions = f"ternary_serve_versions_file={PROJECT_ROOT / 'versions.env'}"
    result = playbook("-i", str(local_inventory), str(play), "-e", versions)
    assert result.returncode == 0, result.stdout[-3000:]
    rendered = json.loads(out.read_text())
    pins = load_versions()
    assert rendered["driver"][0] == f"nvidia-driver-{pins['NVIDIA_DRIVER_BRANCH']}"
    assert rendered["driver_version"] == pins["NVIDIA_DRIVER_VERSION"]
    assert rendered["cuda_repo"] == (
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/"
    )
    assert rendered["cuda_packages"] == ["cuda-toolkit-" + pins["CUDA_VERSION"].replace(".", "-")]
    assert rendered["cuda_home"] == f"/usr/local/cuda-{pins['CUDA_VERSION']}"
    assert rendered["docker_repo"] == "https://download.docker.com/linux/ubuntu"
    assert f"docker-ce=5:{pins['DOCKER_VERSION']}*" in rendered["docker_packages"]
    assert "docker-compose-plugin" in rendered["docker_packages"]


def test_the_collection_pins_are_the_versions_the_tests_run():
    """ansible/requirements.yml pins every collection the playbooks name, at the version this
    environment's `ansible` package bundles."""
    pinned = {
        c["name"]: c["version"]
        for c in yaml.safe_load((ANSIBLE_DIR / "requirements.yml").read_text())["collections"]
    }
    used = set()
    for path in ANSIBLE_DIR.rglob("*.yml"):
        used |= {
            ".".join(m) for m in re.findall(r"\b(ansible|community)\.(\w+)\.\w+", path.read_text())
        }
    used.discard("ansible.builtin")
    assert used == set(pinned), (used, pinned)
    listed = subprocess.run(
        [str(VENV_BIN / "ansible-galaxy"), "collection", "list", "--format", "json"],
        capture_output=True, text=True, check=True, env=ansible_env(),
    )  # fmt: skip
    installed = {
        name: meta["version"]
        for path in json.loads(listed.stdout).values()
        for name, meta in path.items()
    }
    for name, version in pinned.items():
        assert installed.get(name) == version, (
            f"{name}: pinned {version}, tests run {installed.get(name)}"
        )
