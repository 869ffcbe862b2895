"""What site.yml left on the Debian 13 test host, read back through testinfra.

Real Debian packages throughout; stand-ins (see molecule.yml) only where the real part cannot
exist in a container or be reached from here. Checked only on a real box: the kernel module
loading after the reboot, nvidia-smi's version, persistence mode, the GPU reservation.
"""

import json

from ternary_serve.versions import load_versions

PINS = load_versions()


def test_gcc_is_the_pinned_default(host):
    assert host.check_output("gcc -dumpversion").split(".")[0] == PINS["GCC_VERSION"]
    assert host.check_output("g++ -dumpversion").split(".")[0] == PINS["GCC_VERSION"]


def test_nvcc_is_cuda_12_4_for_login_shells(host):
    out = host.check_output("bash -lc 'nvcc --version'")
    assert f"release {PINS['CUDA_VERSION']}," in out


def test_driver_packages_are_pinned_and_held(host):
    for name in ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi"):
        package = host.package(name)
        assert package.is_installed
        assert package.version.startswith(PINS["NVIDIA_DRIVER_VERSION"])
    held = host.check_output("apt-mark showhold").split()
    assert {"nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi"} <= set(held)
    assert "nvidia-container-toolkit" in held


def test_nouveau_is_blacklisted_and_unattended_upgrades_skip_the_driver(host):
    assert host.file("/etc/modprobe.d/blacklist-nouveau.conf").contains("^blacklist nouveau")
    assert host.file("/etc/apt/apt.conf.d/51ternary-serve-nvidia").contains('"nvidia-";')


def test_dockerd_runs_with_the_nvidia_runtime(host):
    assert host.service("docker").is_running and host.service("docker").is_enabled
    daemon = json.loads(host.file("/etc/docker/daemon.json").content_string)
    assert daemon["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"
    assert "native.cgroupdriver=cgroupfs" in daemon["exec-opts"]
    runtimes = json.loads(host.check_output("docker info --format '{{json .Runtimes}}'"))
    assert "nvidia" in runtimes


def test_the_stack_is_live_healthy_and_passes_smoke(host):
    history = host.file("/opt/ternary-serve/state/releases.jsonl").content_string.splitlines()
    assert json.loads(history[-1])["status"] == "live"
    health = host.check_output(
        "python3 -c 'import urllib.request as u; "
        'print(u.urlopen("http://127.0.0.1:8080/health", timeout=10).read().decode())\''
    )
    assert json.loads(health) == {"status": "ok"}
    smoke = host.run("cd /opt/ternary-serve && docker compose run --rm smoke")
    assert smoke.rc == 0, smoke.stdout + smoke.stderr
    assert "smoke: PASS" in smoke.stdout
