"""What the nvidia_driver and cuda_toolkit roles left on the Ubuntu 22.04 STAND-IN host.

The host is a Debian 13 container that says it is Ubuntu 22.04, and its packages come from the
stand-in repositories of tests/ubuntu_standin.py (jammy-updates/restricted with today's
transitional packages, and NVIDIA's CUDA repository with conflicting driver versions). What this
proves is how apt and the roles choose among those packages; the packages' real contents (kernel
module, libraries, DKMS) are not here.
"""

from __future__ import annotations

import json
import re

import pytest

from ternary_serve.versions import load_versions

PINS = load_versions()
DRIVER = re.compile(r"^(lib)?nvidia-(?!container)")
# apt-cache policy's version table: " *** VERSION PRIORITY" / "     VERSION PRIORITY", then one
# line per source: "        PRIORITY URL ...".
POLICY_VERSION = re.compile(r"^ (?:\*\*\*|   ) (\S+) (-?\d+)$")
POLICY_SOURCE = re.compile(r"^ {8}(-?\d+) (\S+)")


@pytest.fixture(scope="module")
def standin(host) -> dict:
    return json.loads(host.file("/srv/standin/standin.json").content_string)


def run(host, command: str) -> str:
    return host.check_output(f"LC_ALL=C {command}")


def installed_driver_packages(host) -> dict[str, str]:
    rows = run(host, r"dpkg-query -W -f '${db:Status-Status}|${Package}|${Version}\n'")
    packages = {}
    for row in rows.splitlines():
        status, name, version = row.split("|")
        if status == "installed" and DRIVER.match(name):
            packages[name] = version
    return packages


def upstream(version: str) -> str:
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def policy(host, package: str) -> tuple[str, dict[str, tuple[int, list[str]]]]:
    """The candidate, and each version's priority and source URLs."""
    candidate, versions, current = "", {}, None
    for line in run(host, f"apt-cache policy {package}").splitlines():
        if line.strip().startswith("Candidate:"):
            candidate = line.split(":", 1)[1].strip()
        elif match := POLICY_VERSION.match(line):
            current = match.group(1)
            versions[current] = (int(match.group(2)), [])
        elif (match := POLICY_SOURCE.match(line)) and current:
            versions[current][1].append(match.group(2))
    return candidate, versions


def test_the_stand_in_models_the_pinned_branch(standin):
    """The stand-in carries the branch versions.env pins (else the rest tests nothing useful)."""
    assert standin["branch"] == PINS["NVIDIA_DRIVER_BRANCH"], (
        "versions.env pins another branch than the stand-in models: update tests/ubuntu_standin.py"
    )
    assert upstream(standin["archive_version"]) == PINS["NVIDIA_DRIVER_VERSION"]


def test_the_server_branch_is_installed_at_the_pinned_version_from_the_archive(host, standin):
    installed = installed_driver_packages(host)
    assert sorted(installed) == standin["install_closure"]["headless"]
    for name, version in installed.items():
        assert upstream(version) == PINS["NVIDIA_DRIVER_VERSION"], (name, version)
        # The archive's Debian revision: none of NVIDIA's (0ubuntu1) slipped in.
        assert version == standin["archive_version"], (name, version)


def test_no_transitional_package_is_installed_or_held(host, standin):
    held = run(host, "apt-mark showhold").split()
    for old in standin["transitional"]:
        assert not [name for name in installed_driver_packages(host) if f"-{old}" in name]
        assert not [name for name in held if f"-{old}" in name]


def test_nvidias_driver_versions_are_pinned_out(host, standin):
    """Every driver package: the archive's version is the candidate and installed; every version
    from the CUDA origin, newer or not, has priority -1 (cuda-keyring's 600 pin notwithstanding)."""
    for name, version in installed_driver_packages(host).items():
        candidate, versions = policy(host, name)
        assert candidate == version, (name, candidate, version)
        assert any("ubuntu-archive.standin" in url for url in versions[version][1]), versions
        nvidia = {v: p for v, (p, urls) in versions.items() if any("cuda-repo" in u for u in urls)}
        assert set(nvidia) == set(standin["nvidia_versions"]), (name, versions)
        assert set(nvidia.values()) == {-1}, (name, versions)


def test_exactly_the_installed_driver_packages_are_held(host):
    held = set(run(host, "apt-mark showhold").split())
    assert held == set(installed_driver_packages(host))


def test_unattended_upgrades_skip_the_driver(host):
    listed = run(host, "grep -l Package-Blacklist -r /etc/apt/apt.conf.d/ || true").split()
    blacklists = "".join(host.file(path).content_string for path in listed)
    assert '"nvidia-";' in blacklists and '"libnvidia-";' in blacklists


def test_nvidia_smi_reports_the_pinned_version(host):
    out = run(host, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    assert out.strip() == PINS["NVIDIA_DRIVER_VERSION"]


def test_nvcc_is_the_pinned_cuda_for_login_shells(host):
    assert f"release {PINS['CUDA_VERSION']}," in run(host, "bash -lc 'nvcc --version'")
    assert host.package("cuda-toolkit-" + PINS["CUDA_VERSION"].replace(".", "-")).is_installed


@pytest.mark.parametrize("ignore_hold", ["", "--ignore-hold"])
@pytest.mark.parametrize("command", ["upgrade", "dist-upgrade"])
def test_an_upgrade_changes_no_driver_package(host, command, ignore_hold):
    """Not even with the holds ignored: the origin preferences alone keep NVIDIA's versions out."""
    plan = run(host, f"apt-get -s {ignore_hold} {command}")
    changes = [
        line
        for line in plan.splitlines()
        if line.split(" ", 1)[0] in ("Inst", "Remv", "Conf") and DRIVER.match(line.split()[1])
    ]
    assert not changes, plan
