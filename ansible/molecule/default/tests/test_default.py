"""What site.yml left on the Debian 13 test host, read back through testinfra.

Real Debian packages throughout; stand-ins (see molecule.yml) only where the real part cannot
exist in a container or be reached from here. Checked only on a real box: the kernel module
loading after the reboot, nvidia-smi's version, persistence mode, the GPU reservation.
"""

import json
import shlex

from ternary_serve.versions import load_versions

PINS = load_versions()


def test_gcc_is_the_pinned_default(host):
    assert host.check_output("gcc -dumpversion").split(".")[0] == PINS["GCC_VERSION"]
    assert host.check_output("g++ -dumpversion").split(".")[0] == PINS["GCC_VERSION"]


def test_nvcc_is_cuda_12_4_for_login_shells(host):
    out = host.check_output("bash -lc 'nvcc --version'")
    assert f"release {PINS['CUDA_VERSION']}," in out


# Debian builds every driver library, tool, firmware and kernel-module package from this source
# package: the check does not reuse the role's name regex, so a package it misses shows up here.
DRIVER_SOURCE = "nvidia-graphics-drivers"


def test_driver_packages_are_pinned_and_held(host):
    version = PINS["NVIDIA_DRIVER_DEBIAN_VERSION"]
    for name in ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi"):
        package = host.package(name)
        assert package.is_installed
        assert package.version.startswith(f"{version}-")
    rows = host.check_output(
        "dpkg-query -W -f '${db:Status-Status} ${Package} ${Version} ${source:Package}\\n'"
    )
    from_driver_source = {
        name: pkg_version
        for name, pkg_version, source in (
            row.split()[1:] for row in rows.splitlines() if row.startswith("installed ")
        )
        if source == DRIVER_SOURCE
    }
    held = set(host.check_output("apt-mark showhold").split())
    assert {"nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi", "libcuda1"} <= set(
        from_driver_source
    )
    # Every package of the driver's source at the pinned version, and every one held.
    assert {n: v for n, v in from_driver_source.items() if not v.startswith(f"{version}-")} == {}
    assert set(from_driver_source) - held == set()


def test_apt_preferences_keep_the_driver_on_one_origin_and_the_toolkit_at_its_pin(host):
    driver = host.file("/etc/apt/preferences.d/20-ternary-serve-nvidia-driver").content_string
    assert "Pin: release o=Debian\nPin-Priority: 500" in driver
    assert "Pin: version *\nPin-Priority: -1" in driver
    toolkit = PINS["NVIDIA_CONTAINER_TOOLKIT_VERSION"]
    policy = host.check_output("apt-cache policy nvidia-container-toolkit")
    assert f"{toolkit}-1 990" in policy
    assert host.file("/lib/udev/rules.d/71-nvidia-dev-char.rules").contains(
        "create-dev-char-symlinks --create-all"
    )


def test_nouveau_is_blacklisted_and_unattended_upgrades_skip_the_driver(host):
    assert host.file("/etc/modprobe.d/blacklist-nouveau.conf").contains("^blacklist nouveau")
    assert host.file("/etc/apt/apt.conf.d/51ternary-serve-nvidia").contains('"nvidia-";')


def test_dockerd_runs_with_the_nvidia_runtime(host):
    assert host.service("docker").is_running and host.service("docker").is_enabled
    daemon = json.loads(host.file("/etc/docker/daemon.json").content_string)
    assert daemon["runtimes"]["nvidia"]["path"] == "nvidia-container-runtime"
    assert "native.cgroupdriver=cgroupfs" in daemon["exec-opts"]
    assert daemon["live-restore"] is True
    runtimes = json.loads(host.check_output("docker info --format '{{json .Runtimes}}'"))
    assert "nvidia" in runtimes


GATEWAY = "https://localhost:8080"
CERT = "/opt/ternary-serve/state/gateway.pem"


PROBE = """
import ssl, sys, urllib.error, urllib.request as u
request = u.Request("{url}")
if {key}:
    key = open("/opt/ternary-serve/state/api-key").read().strip()
    request.add_header("Authorization", "Bearer " + key)
try:
    reply = u.urlopen(request, timeout=10, context=ssl.create_default_context(cafile="{cert}"))
    print(reply.read().decode(), reply.status)
except urllib.error.HTTPError as exc:
    print(exc.read().decode(), exc.code)
"""


def get(host, path: str, key: bool = False) -> str:
    """A request through the gateway with its certificate (and the key): body and status."""
    script = PROBE.format(url=GATEWAY + path, key=key, cert=CERT)
    return host.check_output(f"python3 -c {shlex.quote(script)}")


def test_the_stack_is_live_behind_the_gateway_and_passes_smoke(host):
    history = host.file("/opt/ternary-serve/state/releases.jsonl").content_string.splitlines()
    assert json.loads(history[-1])["status"] == "live"
    assert get(host, "/health") == '{"status":"ok"} 200'
    assert get(host, "/v1/models").endswith(" 401")
    assert get(host, "/v1/models", key=True).endswith(" 200")
    key = host.file("/opt/ternary-serve/state/api-key")
    assert key.mode == 0o640 and key.gid == 10001
    smoke = host.run("cd /opt/ternary-serve && docker compose run --rm smoke")
    assert smoke.rc == 0, smoke.stdout + smoke.stderr
    assert "smoke: PASS" in smoke.stdout


def test_the_firewall_allows_the_gateway_port_and_nothing_else_new(host):
    added = host.check_output("ufw show added")
    rules = [line for line in added.splitlines() if line.startswith("ufw ")]
    assert rules == ["ufw allow 8080/tcp comment 'ternary-serve gateway'"], added
    assert "inactive" in host.check_output("ufw status")  # the role enables no firewall
