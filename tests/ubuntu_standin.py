#!/usr/bin/env python3
"""STAND-IN for Ubuntu 22.04's NVIDIA driver packaging: two local apt repositories that behave,
towards apt, the way jammy's archive and NVIDIA's CUDA repository do today.

Neither real repository can be reached from the test machine, so the provisioning roles' choices
(which branch, which origin, what is held, what a version check sees) are tested against this:

ubuntu/  Canonical's jammy-updates/restricted (Release: Origin and Label "Ubuntu", Suite
         jammy-updates, Codename jammy), signed by a throwaway "archive" key:
         - the 580 branch at 580.142-0ubuntu0.22.04.1, server and desktop flavours, with the
           dependency shape of the real metapackages (nvidia-headless-580-server ->
           nvidia-headless-no-dkms-580-server + nvidia-dkms-580-server; the former ->
           libnvidia-compute-580-server, nvidia-kernel-common-580-server,
           nvidia-compute-utils-580-server, libnvidia-cfg1-580-server; the desktop names the
           same, nvidia-driver-580 -> nvidia-headless-580 + nvidia-utils-580), every
           dependency at the exact same version (= v);
         - the transitional packages jammy carries now: nvidia-{driver,headless,utils}-550[-server]
           at 550.163.01-0ubuntu0.22.04.2 depend on the 570 ones (570.195.03-0ubuntu0.22.04.1),
           which depend on the 580 ones: asking for 550 installs 580;
         - nvidia-utils-580[-server] ships a stand-in /usr/bin/nvidia-smi that reports the version
           of the libnvidia-compute package dpkg has installed (upstream part), and fails as the
           real one does ("Driver/library version mismatch") when the library and the kernel
           module package (nvidia-dkms) differ, so a mixed install shows.
cuda/    NVIDIA's CUDA repository (flat, `suites: /`; Release: Origin "NVIDIA", Label "NVIDIA
         CUDA"), InRelease and Release.gpg signed by a throwaway key exported as 3bf863cc.pub, the
         name the role's key URL uses (and as cuda-archive-keyring.gpg, cuda-keyring's file):
         cuda-toolkit-12-4 12.4.1-1 with a stand-in /usr/local/cuda-12.4/bin/nvcc, and the
         conflicting driver packages NVIDIA carries under Canonical's names: the same 580
         packages at 580.142-0ubuntu1 (sorts above 0ubuntu0.22.04.1: without origin preferences
         apt takes NVIDIA's) and at 580.159-0ubuntu1 (a newer upstream, to tempt upgrades).

Every package's Description says STAND-IN. What this does not prove: the real packages' contents
(no kernel module, no libraries, no DKMS build, no X), maintainer scripts, Canonical's exact
version strings and dependency lists of the day (these are modelled on them, fixed in this file),
the real signing keys, and apt's own version: the Molecule container runs Debian 13's apt 3.0,
jammy has apt 2.4 (same pinning and version rules; simulation output in the same format).

Usage: python3 tests/ubuntu_standin.py DIR   (builds DIR/ubuntu, DIR/cuda and DIR/standin.json)
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from email.utils import formatdate
from itertools import pairwise
from pathlib import Path

ARCH = "amd64"
ARCHIVE_HOST = "ubuntu-archive.standin"
CUDA_HOST = "cuda-repo.standin"
PORT = 8765
SUITE = "jammy-updates"
COMPONENT = "restricted"

BRANCH = "580"  # what jammy's transitional packages lead to today
ARCHIVE_VERSION = "580.142-0ubuntu0.22.04.1"
TRANSITIONAL = {"550": "550.163.01-0ubuntu0.22.04.2", "570": "570.195.03-0ubuntu0.22.04.1"}
NVIDIA_VERSIONS = ("580.142-0ubuntu1", "580.159-0ubuntu1")
CUDA_TOOLKIT = ("cuda-toolkit-12-4", "12.4.1-1")
NVCC_VERSION = "Cuda compilation tools, release 12.4, V12.4.131"
FLAVOURS = {"headless": "-server", "desktop": ""}
# Each flavour's leaf packages (no dependencies), then the metapackages above them.
LEAVES = ["libnvidia-compute", "libnvidia-cfg1", "nvidia-kernel-common", "nvidia-compute-utils",
          "nvidia-dkms"]  # fmt: skip

MAINTAINER = "ternary-serve tests <tests@invalid>"


@dataclass
class Package:
    name: str
    version: str
    summary: str
    depends: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # path -> content (made executable)
    section: str = "restricted/libs"


NVIDIA_SMI = r"""#!/bin/sh
# STAND-IN for nvidia-smi (ternary-serve tests, tests/ubuntu_standin.py): no GPU here. The
# "library" is the installed libnvidia-compute package, the "loaded module" the installed
# nvidia-dkms package: their versions are what a real nvidia-smi would see after a reboot.
installed() {
    dpkg-query -W -f '${db:Status-Status} ${Version}\n' "$1" 2>/dev/null \
        | awk '$1 == "installed" { sub(/^[0-9]+:/, "", $2); sub(/-[^-]*$/, "", $2); print $2 }'
}
lib=$(installed libnvidia-compute-@BRANCH@@SUFFIX@)
module=$(installed nvidia-dkms-@BRANCH@@SUFFIX@)
if [ -z "$lib" ] || [ -z "$module" ]; then
    echo "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver." \
        "Make sure that the latest NVIDIA driver is installed and running."
    exit 9
fi
if [ "$lib" != "$module" ]; then
    echo "Failed to initialize NVML: Driver/library version mismatch"
    echo "NVML library version: $lib"
    exit 18
fi
case "$*" in
    *--query-gpu=driver_version*) echo "$lib" ;;
    *) echo "| NVIDIA-SMI $lib    Driver Version: $lib    CUDA Version: 13.0 (STAND-IN) |" ;;
esac
"""

NVCC = f"""#!/bin/sh
# STAND-IN for nvcc (ternary-serve tests, tests/ubuntu_standin.py): prints the version only.
echo "nvcc: NVIDIA (R) Cuda compiler driver"
echo "Copyright (c) 2005-2024 NVIDIA Corporation"
echo "Built on Thu_Mar_28_02:18:24_PDT_2024"
echo "{NVCC_VERSION}"
echo "Build cuda_12.4.r12.4/compiler.34097967_0"
"""


def upstream(version: str) -> str:
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def branch_packages(branch: str, version: str, who: str) -> list[Package]:
    """One branch's packages in both flavours, every dependency at exactly `version`."""
    out = []
    for suffix in FLAVOURS.values():

        def name(stem: str, suffix: str = suffix) -> str:
            return f"{stem}-{branch}{suffix}"

        def exact(*stems: str) -> list[str]:
            return [f"{name(stem)} (= {version})" for stem in stems]

        out += [Package(name(stem), version, f"{stem} ({who})") for stem in LEAVES]
        utils_conflicts = {"Conflicts": "nvidia-utils", "Replaces": "nvidia-utils",
                           "Provides": "nvidia-utils"}  # fmt: skip
        script = NVIDIA_SMI.replace("@BRANCH@", branch).replace("@SUFFIX@", suffix)
        out += [
            Package(name("nvidia-utils"), version, f"NVIDIA driver support binaries ({who})",
                    fields=utils_conflicts, files={"usr/bin/nvidia-smi": script},
                    section="restricted/utils"),
            Package(name("nvidia-headless-no-dkms"), version,
                    f"NVIDIA headless metapackage - no DKMS ({who})",
                    depends=exact("libnvidia-compute", "nvidia-kernel-common",
                                  "nvidia-compute-utils", "libnvidia-cfg1"),
                    section="restricted/metapackages"),
            Package(name("nvidia-headless"), version, f"NVIDIA headless metapackage ({who})",
                    depends=exact("nvidia-headless-no-dkms", "nvidia-dkms"),
                    section="restricted/metapackages"),
            Package(name("nvidia-driver"), version, f"NVIDIA driver metapackage ({who})",
                    depends=exact("nvidia-headless", "nvidia-utils"),
                    section="restricted/metapackages"),
        ]  # fmt: skip
    return out


def transitional_packages() -> list[Package]:
    """jammy today: 550 -> 570 -> 580, unversioned, under each entry name of both flavours."""
    out = []
    chain = [*TRANSITIONAL, BRANCH]
    for old, new in pairwise(chain):
        for suffix in FLAVOURS.values():
            for stem in ("nvidia-driver", "nvidia-headless", "nvidia-utils"):
                out.append(
                    Package(f"{stem}-{old}{suffix}", TRANSITIONAL[old],
                            f"Transitional package for {stem}-{new}{suffix} (Ubuntu archive)",
                            depends=[f"{stem}-{new}{suffix}"], section="restricted/oldlibs")
                )  # fmt: skip
    return out


def archive_packages() -> list[Package]:
    return branch_packages(BRANCH, ARCHIVE_VERSION, "Ubuntu archive") + transitional_packages()


def cuda_packages() -> list[Package]:
    toolkit, version = CUDA_TOOLKIT
    nvcc = {"usr/local/cuda-12.4/bin/nvcc": NVCC}
    out = [Package(toolkit, version, "CUDA Toolkit 12.4 meta-package (NVIDIA CUDA repository)",
                   files=nvcc, section="multiverse/devel")]  # fmt: skip
    for driver in NVIDIA_VERSIONS:
        out += branch_packages(BRANCH, driver, "NVIDIA CUDA repository")
    return out


def install_closure(flavour: str) -> list[str]:
    """What installing the flavour's packages (the role's list) brings: the names a correct
    install has, all at ARCHIVE_VERSION."""
    suffix = FLAVOURS[flavour]
    stems = [*LEAVES, "nvidia-headless-no-dkms", "nvidia-headless", "nvidia-utils"]
    if flavour == "desktop":
        stems.append("nvidia-driver")
    return sorted(f"{stem}-{BRANCH}{suffix}" for stem in stems)


def build_deb(package: Package, staging: Path, dest_dir: Path) -> Path:
    tree = staging / f"{package.name}_{package.version}"
    (tree / "DEBIAN").mkdir(parents=True)
    for path, content in package.files.items():
        target = tree / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
        target.chmod(0o755)
    control = {
        "Package": package.name,
        "Version": package.version,
        "Architecture": ARCH,
        "Maintainer": MAINTAINER,
        "Section": package.section,
        "Priority": "optional",
        **({"Depends": ", ".join(package.depends)} if package.depends else {}),
        **package.fields,
        "Description": f"STAND-IN: {package.summary}\n"
        " Built by ternary-serve's tests/ubuntu_standin.py; no real contents.",
    }
    (tree / "DEBIAN" / "control").write_text(
        "".join(f"{key}: {value}\n" for key, value in control.items())
    )
    deb = dest_dir / f"{package.name}_{package.version}_{ARCH}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(tree), str(deb)],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(tree)
    return deb


def packages_index(debs: list[Path], root: Path) -> str:
    """A Packages file: each deb's control fields, Filename (relative to root), size, digests."""
    stanzas = []
    for deb in sorted(debs):
        control = subprocess.run(
            ["dpkg-deb", "--field", str(deb)], check=True, capture_output=True, text=True
        ).stdout.rstrip("\n")
        data = deb.read_bytes()
        stanzas.append(
            f"{control}\nFilename: {deb.relative_to(root).as_posix()}\nSize: {len(data)}\n"
            f"MD5sum: {hashlib.md5(data).hexdigest()}\n"
            f"SHA256: {hashlib.sha256(data).hexdigest()}\n"
        )
    return "\n".join(stanzas)


def write_index(directory: Path, text: str) -> list[Path]:
    plain = directory / "Packages"
    plain.write_text(text)
    packed = directory / "Packages.gz"
    packed.write_bytes(gzip.compress(text.encode(), mtime=0))
    return [plain, packed]


def release_file(fields: dict[str, str], base: Path, indexes: list[Path]) -> str:
    """A Release file: the fields, then every index's size and digests (relative to base)."""
    text = "".join(f"{key}: {value}\n" for key, value in fields.items())
    text += f"Date: {formatdate(usegmt=True)}\n"
    for label, algo in (("MD5Sum", hashlib.md5), ("SHA256", hashlib.sha256)):
        text += f"{label}:\n"
        for path in indexes:
            data = path.read_bytes()
            text += f" {algo(data).hexdigest()} {len(data):>8} {path.relative_to(base)}\n"
    return text


class Signer:
    """A throwaway GnuPG home with one key per repository (no passphrase)."""

    def __init__(self) -> None:
        # Short path: gpg-agent's socket must fit in a sockaddr_un.
        self.home = tempfile.mkdtemp(prefix="gnupg-")
        self.env = {**os.environ, "GNUPGHOME": self.home}

    def gpg(self, *args: str) -> str:
        return subprocess.run(
            ["gpg", "--batch", "--yes", "--quiet", "--pinentry-mode", "loopback",
             "--passphrase", "", *args],
            check=True, capture_output=True, text=True, env=self.env,
        ).stdout  # fmt: skip

    def new_key(self, uid: str) -> str:
        self.gpg("--quick-gen-key", uid, "ed25519", "sign", "never")
        listing = self.gpg("--with-colons", "--list-keys", uid)
        return next(line.split(":")[9] for line in listing.splitlines() if line.startswith("fpr"))

    def sign_release(self, key: str, release: Path) -> None:
        common = ["--local-user", key, "--digest-algo", "SHA512"]
        self.gpg(*common, "--clearsign", "-o", str(release.with_name("InRelease")), str(release))
        self.gpg(*common, "--armor", "--detach-sign", "-o", str(release.with_suffix(".gpg")),
                 str(release))  # fmt: skip

    def export(self, key: str, dest: Path) -> None:
        dest.write_text(self.gpg("--armor", "--export", key))

    def export_binary(self, key: str, dest: Path) -> None:
        self.gpg("--output", str(dest), "--export", key)

    def close(self) -> None:
        subprocess.run(["gpgconf", "--kill", "all"], env=self.env, capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)


def build_archive(root: Path, signer: Signer, staging: Path) -> None:
    repo = root / "ubuntu"
    pool = repo / "pool" / COMPONENT / "n" / f"nvidia-graphics-drivers-{BRANCH}"
    pool.mkdir(parents=True)
    debs = [build_deb(p, staging, pool) for p in archive_packages()]
    dist = repo / "dists" / SUITE
    binary = dist / COMPONENT / f"binary-{ARCH}"
    binary.mkdir(parents=True)
    indexes = write_index(binary, packages_index(debs, repo))
    component_release = binary / "Release"
    component_release.write_text(
        f"Archive: {SUITE}\nVersion: 22.04\nComponent: {COMPONENT}\nOrigin: Ubuntu\n"
        f"Label: Ubuntu\nArchitecture: {ARCH}\n"
    )
    fields = {
        "Origin": "Ubuntu",
        "Label": "Ubuntu",
        "Suite": SUITE,
        "Version": "22.04",
        "Codename": "jammy",
        "Architectures": ARCH,
        "Components": COMPONENT,
        "Description": "STAND-IN for Ubuntu Jammy Updates (ternary-serve tests)",
    }
    release = dist / "Release"
    release.write_text(release_file(fields, dist, [*indexes, component_release]))
    key = signer.new_key("Ubuntu Archive STAND-IN (ternary-serve tests) <tests@invalid>")
    signer.sign_release(key, release)
    signer.export(key, repo / "ubuntu-archive-standin.asc")


def build_cuda(root: Path, signer: Signer, staging: Path) -> None:
    repo = root / "cuda"
    repo.mkdir(parents=True)
    debs = [build_deb(p, staging, repo) for p in cuda_packages()]
    indexes = write_index(repo, packages_index(debs, repo))
    fields = {
        "Origin": "NVIDIA",
        "Label": "NVIDIA CUDA",
        "Architecture": ARCH,
        "Description": "STAND-IN for NVIDIA's CUDA repository, ubuntu2204/x86_64 (ternary-serve "
        "tests)",
    }
    release = repo / "Release"
    release.write_text(release_file(fields, repo, indexes))
    key = signer.new_key("NVIDIA CUDA repository STAND-IN (ternary-serve tests) <tests@invalid>")
    signer.sign_release(key, release)
    signer.export(key, repo / "3bf863cc.pub")
    # As the cuda-keyring package installs it (/usr/share/keyrings/cuda-archive-keyring.gpg).
    signer.export_binary(key, repo / "cuda-archive-keyring.gpg")


def build(root: Path) -> dict:
    """Build both repositories under root (which must not hold them yet); the manifest the
    Molecule verifier reads (root/standin.json) is returned too."""
    root.mkdir(parents=True, exist_ok=True)
    signer = Signer()
    try:
        with tempfile.TemporaryDirectory() as staging:
            build_archive(root, signer, Path(staging))
            build_cuda(root, signer, Path(staging))
    finally:
        signer.close()
    manifest = {
        "branch": BRANCH,
        "archive_version": ARCHIVE_VERSION,
        "nvidia_versions": list(NVIDIA_VERSIONS),
        "transitional": TRANSITIONAL,
        "install_closure": {flavour: install_closure(flavour) for flavour in FLAVOURS},
        "archive_url": f"http://{ARCHIVE_HOST}:{PORT}/ubuntu",
        "cuda_url": f"http://{CUDA_HOST}:{PORT}/cuda/",
    }
    (root / "standin.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for path in [root, *root.rglob("*")]:  # served by an unprivileged reader in the container
        path.chmod(0o755 if path.is_dir() else 0o644)
    return manifest


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.rsplit("Usage: ", 1)[1])
    print(json.dumps(build(Path(sys.argv[1])), indent=2))
