"""Provisioning: site.yml on a systemd Debian 13 container with Molecule (converge, idempotence,
check mode, testinfra), and early failures on broken input.

The Molecule scenario (ansible/molecule/default) installs the real Debian packages (gcc-11, the
550.163 driver, CUDA 12.4.131, docker.io) and deploys the real CPU stack inside the container on
the images this test session built. What cannot run in a container or be reached from here is
replaced by stand-ins named in molecule.yml; docs/testing.md lists what is verified only on a real
box.
"""

from __future__ import annotations

import configparser
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import ANSIBLE_DIR, VENV_BIN, ansible_env

from ternary_serve import settings
from ternary_serve.versions import PROJECT_ROOT, load_versions

MOLECULE_DOCKER_VOLUME = "ts-molecule-docker"  # ansible/molecule/default/molecule.yml


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
         "config: BACKEND=rocm: choose cuda or cpu"),
        ({"llm_stack_settings": {"CONTXT": 4096}},
         "CONTXT is not a setting: did you mean CONTEXT?"),
        ({"llm_stack_settings": {"MODEL_SOURCE": "bonsai-8b"}},
         "bonsai-8b is not a model in models.yaml: did you mean bonsai-8b-q2_0?"),
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
    # Phase timings for docs/testing.md (ansible.posix.profile_roles).
    print("\n".join(line for line in result.stdout.splitlines() if " ---" in line))


def test_ubuntu_sources_packages_and_pins_render_from_versions_env(tmp_path, local_inventory):
    """Rendering test, a stand-in for Ubuntu 22.04 (no Ubuntu or NVIDIA apt repository is
    reachable here; tests/test_ubuntu_standin.py runs the driver role against a repository that
    behaves like jammy's): the roles' Ubuntu variables and apt preferences, rendered by Ansible
    with the pins from versions.env, name the real repositories and pin every package."""
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
    nvidia_container_toolkit_package_source: nvidia
  tasks:
    - ansible.builtin.include_vars: {ANSIBLE_DIR / "group_vars/all.yml"}
    - ansible.builtin.include_vars: {roles / "nvidia_driver/defaults/main.yml"}
    - ansible.builtin.include_vars: {roles / "nvidia_driver/vars/main.yml"}
    - ansible.builtin.include_vars: {roles / "nvidia_driver/vars/Ubuntu-22.04.yml"}
    - ansible.builtin.include_vars: {roles / "cuda_toolkit/defaults/main.yml"}
    - ansible.builtin.include_vars: {roles / "cuda_toolkit/vars/Ubuntu-22.04.yml"}
    - ansible.builtin.include_vars: {roles / "nvidia_container_toolkit/defaults/main.yml"}
    - ansible.builtin.include_vars: {roles / "nvidia_container_toolkit/vars/main.yml"}
    - ansible.builtin.include_vars: {roles / "docker/defaults/main.yml"}
    - ansible.builtin.include_vars: {roles / "docker/vars/main.yml"}
    - ansible.builtin.template:
        src: {roles / "nvidia_driver/templates/nvidia-driver.pref.j2"}
        dest: {tmp_path / "driver.pref"}
        mode: "0644"
    - ansible.builtin.template:
        src: {roles / "nvidia_container_toolkit/templates/nvidia-container-toolkit.pref.j2"}
        dest: {tmp_path / "toolkit.pref"}
        mode: "0644"
    - ansible.builtin.copy:
        dest: {out}
        content: "{{{{ rendered | to_json }}}}"
        mode: "0644"
      vars:
        rendered:
          driver: "{{{{ nvidia_driver_install_names }}}}"
          driver_version: "{{{{ nvidia_driver_installed_version }}}}"
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
    branch, version = pins["NVIDIA_DRIVER_BRANCH"], pins["NVIDIA_DRIVER_VERSION"]
    # The server branch's own packages, never a transitional nvidia-driver-550.
    assert rendered["driver"] == [
        f"nvidia-headless-{branch}-server={version}-*",
        f"nvidia-utils-{branch}-server={version}-*",
    ]
    assert rendered["driver_version"] == version
    driver_pref = (tmp_path / "driver.pref").read_text()
    records = [r for r in driver_pref.split("\n\n") if "Package:" in r]
    assert [r.split("Pin: ")[1].split("\n")[0] for r in records] == [
        "release o=Ubuntu",
        "release a=now",
        "version *",
    ]
    assert records[-1].rstrip().endswith("Pin-Priority: -1")
    # Names and one glob, never a regex: apt matches each record's patterns against every name
    # it knows whenever it loads its policy (a regex here cost every apt command 16 s a record).
    patterns = yaml.safe_load((roles / "nvidia_driver/vars/main.yml").read_text())[
        "nvidia_driver_package_patterns"
    ]
    assert all(f"Package: {' '.join(patterns)}\n" in r for r in records)
    assert sum("*" in pattern for pattern in patterns) == 1 and "/" not in " ".join(patterns)
    assert rendered["cuda_repo"] == (
        "https://developer.download.nvidia.com/compute/cuda/repos/ubuntu2204/x86_64/"
    )
    assert rendered["cuda_packages"] == ["cuda-toolkit-" + pins["CUDA_VERSION"].replace(".", "-")]
    assert rendered["cuda_home"] == f"/usr/local/cuda-{pins['CUDA_VERSION']}"
    toolkit = pins["NVIDIA_CONTAINER_TOOLKIT_VERSION"]
    toolkit_pref = (tmp_path / "toolkit.pref").read_text()
    four = (
        "Package: nvidia-container-toolkit nvidia-container-toolkit-base "
        "libnvidia-container-tools libnvidia-container1"
    )
    assert f"{four}\nPin: version {toolkit}-1\nPin-Priority: 990" in toolkit_pref
    assert f"{four}\nPin: version *\nPin-Priority: -1" in toolkit_pref
    assert 'Package: *\nPin: origin "nvidia.github.io"\nPin-Priority: -1' in toolkit_pref
    assert rendered["docker_repo"] == "https://download.docker.com/linux/ubuntu"
    assert rendered["docker_packages"] == [
        f"docker-ce=5:{pins['DOCKER_VERSION']}-*",
        f"docker-ce-cli=5:{pins['DOCKER_VERSION']}-*",
        f"containerd.io={pins['DOCKER_CONTAINERD_VERSION']}-*",
        f"docker-buildx-plugin={pins['DOCKER_BUILDX_VERSION']}-*",
        f"docker-compose-plugin={pins['DOCKER_COMPOSE_VERSION']}-*",
    ]


@pytest.mark.parametrize(
    "simulation, conflicts",
    [
        # jammy today: the 550 name is a transitional package to 570, and 570 to 580.
        ("Inst nvidia-headless-550-server (550.163.01-0ubuntu0.22.04.2 Ubuntu:22.04 [amd64])\n"
         "Inst nvidia-headless-580-server (580.142-0ubuntu0.22.04.1 Ubuntu:22.04 [amd64])\n",
         ["nvidia-headless-580-server 580.142-0ubuntu0.22.04.1 (Ubuntu:22.04 [amd64])"]),
        # A branch package at another version (NVIDIA's CUDA repository's build).
        ("Inst libnvidia-compute-550-server [550.100-0ubuntu1] (550.163.02-0ubuntu1 NVIDIA)\n",
         ["libnvidia-compute-550-server 550.163.02-0ubuntu1 (NVIDIA)"]),
        # The archive moved on: the candidate is not the pinned version.
        ("Inst nvidia-headless-550-server (550.163.05-0ubuntu0.22.04.1 Ubuntu [amd64])\n",
         ["nvidia-headless-550-server 550.163.05-0ubuntu0.22.04.1 (Ubuntu [amd64])"]),
        # Unversioned names (Debian's) are checked when they are the ones asked for.
        ("Inst nvidia-driver (550.163.05-1 Debian [amd64])\n"
         "Inst nvidia-smi (550.54.14-1 Debian [amd64])\n",
         ["nvidia-driver 550.163.05-1 (Debian [amd64])"]),
        # The pinned branch and version, the container toolkit and unrelated packages pass.
        ("Inst nvidia-headless-550-server (550.163.01-0ubuntu0.22.04.2 Ubuntu [amd64])\n"
         "Inst nvidia-firmware-550-server-550.163.01 (550.163.01-0ubuntu0.22.04.2 Ubuntu [amd64])\n"
         "Inst libnvidia-container1 (1.17.8-1 nvidia [amd64])\n"
         "Inst linux-modules-nvidia-550-server-generic (5.15.0-126.136 Ubuntu [amd64])\n"
         "Inst libnvidia-egl-wayland1 (1:1.1.9-1.1 Ubuntu [amd64])\n"
         "Inst dkms (2.8.7-2ubuntu2.2 Ubuntu [all])\n", []),
    ],
)  # fmt: skip
def test_the_driver_plan_check_finds_packages_off_the_pinned_branch(simulation, conflicts):
    """The nvidia_driver role's reading of `apt-get --simulate` (its filter plugin)."""
    sys.path.insert(0, str(ANSIBLE_DIR / "roles/nvidia_driver/filter_plugins"))
    try:
        from driver_plan import driver_plan_conflicts, package_regex
    finally:
        sys.path.pop(0)
    role_vars = yaml.safe_load((ANSIBLE_DIR / "roles/nvidia_driver/vars/main.yml").read_text())
    found = driver_plan_conflicts(
        simulation,
        ["nvidia-headless-550-server", "nvidia-utils-550-server", "nvidia-driver"],
        package_regex(role_vars["nvidia_driver_package_patterns"]),
        role_vars["nvidia_driver_not_driver_regex"],
        "550",
        "550.163.01",
    )
    assert found == conflicts


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


def test_the_roles_setting_defaults_are_the_settings_modules():
    """The llm_stack role needs two settings before the project is on the host (the GPU check,
    what the tarball carries): its fallbacks must be the defaults ternary_serve/settings.py
    declares. The replicas' ports and names are the CLI's (`ternary-serve fleet replicas`)."""
    text = "".join(
        path.read_text() for path in sorted((ANSIBLE_DIR / "roles/llm_stack").rglob("*.yml"))
    )
    fallbacks = dict(re.findall(r"llm_stack_settings\.(\w+) \| default\('?([^')]+)'?\)", text))
    assert set(fallbacks) == {"BACKEND", "ENGINE_SOURCE"}
    assert fallbacks == {name: settings.SETTINGS[name].default for name in fallbacks}


def test_the_molecule_scenarios_connect_as_ansible_cfg_does():
    """Molecule writes an ansible.cfg of its own: each scenario repeats the connection settings of
    the operator's (pipelining), so the converges run the way a real deploy does."""
    parser = configparser.ConfigParser()
    parser.read(ANSIBLE_DIR / "ansible.cfg")
    operators = {key: parser.getboolean("connection", key) for key in parser["connection"]}
    assert operators == {"pipelining": True}
    for scenario in sorted((ANSIBLE_DIR / "molecule").glob("*/molecule.yml")):
        options = yaml.safe_load(scenario.read_text())["provisioner"].get("config_options", {})
        assert options.get("connection") == operators, scenario.parent.name


RELEASES = {"jammy": ("Ubuntu", "22.04", "22"), "bookworm": ("Debian", "12.11", "12"),
            "trixie": ("Debian", "13.1", "13")}  # fmt: skip


def test_each_role_loads_the_values_of_the_releases_it_supports_and_refuses_others(
    tmp_path, local_inventory
):
    """Every role finds vars/<Distribution>-<release>.yml (first_found over the version, then the
    major version) for each release its meta/main.yml names, and stops with the list of what it
    supports on any other: a new release is one file per role."""
    roles = sorted(
        p.parent.parent.name for p in (ANSIBLE_DIR / "roles").glob("*/tasks/os_vars.yml")
    )
    assert roles == sorted(p.name for p in (ANSIBLE_DIR / "roles").iterdir()), roles
    cases = []
    for role in roles:
        meta = yaml.safe_load((ANSIBLE_DIR / "roles" / role / "meta/main.yml").read_text())
        names = [
            (platform["name"], version)
            for platform in meta["galaxy_info"]["platforms"]
            for version in platform["versions"]
        ]
        files = sorted(p.stem for p in (ANSIBLE_DIR / "roles" / role / "vars").glob("*-*.yml"))
        # Ubuntu's files name the release (22.04), Debian's the major version (13).
        named = [
            RELEASES[v][:2] if RELEASES[v][0] == "Ubuntu" else RELEASES[v][::2] for _, v in names
        ]
        assert files == sorted(f"{dist}-{release}" for dist, release in named), role
        cases += [(role, *RELEASES[version], True) for _, version in names]
        cases.append((role, "Ubuntu", "24.04", "24", False))
    play = tmp_path / "os_vars.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        + "".join(
            f"    - name: {role} {dist} {version}\n"
            "      ansible.builtin.include_role:\n"
            f"        name: {role}\n        tasks_from: os_vars\n"
            f"        apply: {{ignore_errors: {str(not supported).lower()}}}\n"
            "      vars:\n"
            f"        ansible_distribution: {dist}\n"
            f'        ansible_distribution_version: "{version}"\n'
            f'        ansible_distribution_major_version: "{major}"\n'
            for role, dist, version, major, supported in cases
        )
    )
    result = playbook("-i", str(local_inventory), str(play))
    assert result.returncode == 0, result.stdout[-3000:]
    for role in roles:
        assert (
            f'"msg": "{role} role: Ubuntu 24.04 is not supported (no vars/Ubuntu-24.04.yml)'
            in result.stdout
        ), role


# Holds dpkg's frontend lock as apt does (fcntl), for the seconds given: what unattended-upgrades
# does at a fresh box's first boot.
HOLD_APT_LOCK = (
    "import fcntl, sys, time\n"
    "lock = open('/var/lib/dpkg/lock-frontend', 'w')\n"
    "fcntl.lockf(lock, fcntl.LOCK_EX)\n"
    "time.sleep(float(sys.argv[1]))\n"
)


@pytest.mark.docker
def test_apt_waits_out_a_held_lock_and_names_the_holder_when_the_wait_runs_out(
    docker_required, tmp_path
):
    """The apt_prerequisites role (every provisioning role depends on it) in a plain container of
    the Molecule image: a lock held for 20 s is waited out; one held past the bound stops the run
    with one line naming the holder, before anything is installed."""
    name = f"ts-apt-lock-{tmp_path.name[-12:]}"
    image = "local/debian:trixie-systemd"  # tests/bootstrap.py SYSTEMD_IMAGE
    started = subprocess.run(
        ["docker", "run", "-d", "--name", name, "--entrypoint", "sleep", image, "infinity"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    inventory = tmp_path / "inventory"
    inventory.write_text(
        f"{name} ansible_connection=community.docker.docker "
        "ansible_python_interpreter=/usr/bin/python3\n"
    )
    play = tmp_path / "apt.yml"
    play.write_text(
        "- name: Provision apt\n  hosts: all\n  gather_facts: false\n  roles: [apt_prerequisites]\n"
    )

    def hold(seconds: int) -> None:
        subprocess.run(
            ["docker", "exec", "-d", name, "python3", "-c", HOLD_APT_LOCK, str(seconds)],
            check=True,
        )
        for _ in range(50):
            locks = subprocess.run(
                ["docker", "exec", name, "lslocks", "--noheadings", "--output", "PATH"],
                capture_output=True, text=True,
            ).stdout  # fmt: skip
            if "/var/lib/dpkg/lock-frontend" in locks:
                return
            time.sleep(0.2)
        raise AssertionError(f"the lock was not taken in the container: {locks}")

    try:
        hold(20)
        waited = playbook("-i", str(inventory), str(play))
        assert waited.returncode == 0, waited.stdout[-4000:]
        assert "RETRYING: [" in waited.stdout, waited.stdout[-4000:]  # it did wait
        hold(600)
        refused = playbook(
            "-i", str(inventory), str(play), "-e", "apt_prerequisites_lock_timeout=6"
        )  # fmt: skip
        assert refused.returncode != 0, refused.stdout[-4000:]
        last = [line for line in refused.stdout.splitlines() if line.startswith("fatal:")][-1]
        assert "apt is locked by python3 (pid " in last, last
        assert "apt_prerequisites_lock_timeout" in last, last
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
