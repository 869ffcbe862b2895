#!/usr/bin/env python3
"""Install and start what the test suite needs on a bare Debian 12 machine with no registry access.

Each step checks first and does nothing when its result is already there, so reruns are cheap:
  docker        Debian's docker.io engine (dockerd started here if it is not running), Compose v2
                and buildx from trixie's docker-compose and docker-buildx packages
  compose       Compose v2 and buildx only, no dockerd: `make check` renders compose.yaml
  base-images   the stand-in for the registry base images: a debootstrapped Debian rootfs
                imported as local/debian:bookworm-test (the real builds use the nvidia/cuda images)
  molecule-image  a Debian 13 image that boots systemd, local/debian:trixie-systemd, for Molecule
  cuda-images   stand-ins for the nvidia/cuda:12.4.1 devel and runtime images, from Debian 13's
                non-free CUDA 12.4 packages: local/cuda-standin:12.4-devel and :12.4-runtime
  engine-source mainline llama.cpp from the pinned llama-cpp-python sdist on PyPI
                -> vendor/llama.cpp
  wheels        the pinned PyTorch CPU wheel this machine keeps in /opt/wheels, linked into
                docker/wheels/ for the convert image (PyTorch's own index is unreachable here)

Usage: python3 tests/bootstrap.py
         [docker|compose|base-images|molecule-image|cuda-images|engine-source|wheels|all]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ternary_serve.versions import load_versions  # noqa: E402

DEBIAN_MIRROR = "http://deb.debian.org/debian"
STAND_IN_IMAGE = "local/debian:bookworm-test"
# python3-venv: the stand-in also replaces the python base of the smoke image.
STAND_IN_PACKAGES = "python3,python3-venv,ca-certificates"
# The Molecule test host: a Debian 13 "machine" that boots systemd in a container.
SYSTEMD_IMAGE = "local/debian:trixie-systemd"
SYSTEMD_PACKAGES = "systemd,systemd-sysv,dbus,sudo,python3,python3-apt,ca-certificates,iproute2"
# Stand-ins for nvidia/cuda:12.4.1-{devel,runtime}-ubuntu22.04 (see ensure_cuda_images).
CUDA_DEVEL_IMAGE = "local/cuda-standin:12.4-devel"
CUDA_RUNTIME_IMAGE = "local/cuda-standin:12.4-runtime"
# nvcc, its headers and libraries (nvidia-cuda-dev, with the stub libcuda.so) and cuobjdump.
CUDA_DEVEL_PACKAGES = "nvidia-cuda-toolkit"
# What a CUDA build of the engine loads besides the driver's libcuda.so.1 (`ldd llama-server`).
CUDA_RUNTIME_PACKAGES = "libcudart12,libcublas12,libcublaslt12"
CUDA_COMPONENTS = "main,contrib,non-free"
DOCKERD_LOG = Path("/var/log/dockerd-tests.log")
# Parts of the sdist's llama.cpp tree no build or test reads (vocab fixtures, docs, media).
# .git is a submodule pointer into the sdist author's checkout: dangling here.
ENGINE_SOURCE_SKIP = ("models", "docs", "media", "benches", ".devops", ".github", ".git")


def say(msg: str) -> None:
    print(f"[bootstrap] {msg}", flush=True)


def sh(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=True, **kw)


def ok(*cmd: str) -> bool:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def apt_install(*packages: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh("apt-get", "update", "-q", env=env)
    sh("apt-get", "install", "-y", "-q", "--no-install-recommends", *packages, env=env)


def ensure_dockerd() -> None:
    if not shutil.which("dockerd"):
        say("installing Debian's docker.io")
        apt_install("docker.io")
    if ok("docker", "info"):
        return
    say(f"starting dockerd (log: {DOCKERD_LOG})")
    with DOCKERD_LOG.open("ab") as log:
        # live-restore as the Ansible docker role sets it: containers outlive a dockerd restart.
        subprocess.Popen(
            ["dockerd", "--live-restore"], stdout=log, stderr=log, start_new_session=True
        )
    for _ in range(60):
        if ok("docker", "info"):
            return
        time.sleep(1)
    sys.exit(f"error: dockerd did not come up in 60 s; see {DOCKERD_LOG}")


def ensure_compose_and_buildx() -> None:
    missing = [
        pkg
        for pkg, probe in (("docker-compose", "compose"), ("docker-buildx", "buildx"))
        if not ok("docker", probe, "version")
    ]
    if not missing:
        return
    say(f"installing {', '.join(missing)} from Debian trixie")
    with tempfile.TemporaryDirectory() as tmp:
        lists = Path(tmp, "lists")
        (lists / "partial").mkdir(parents=True)
        sources = Path(tmp, "sources.list")
        sources.write_text(f"deb {DEBIAN_MIRROR} trixie main\n")
        # A private apt configuration: the host's sources stay untouched.
        private = [
            f"-oDir::Etc::SourceList={sources}",
            "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={lists}",
        ]
        sh("apt-get", *private, "update", "-q")
        sh("apt-get", *private, "download", *missing, cwd=tmp)
        sh("dpkg", "-i", *map(str, Path(tmp).glob("*.deb")))


# The label a stand-in base carries: the key of the inputs it was made from.
KEY_LABEL = "io.ternary-serve.standin-key"


def input_key(*inputs: object) -> str:
    """A short content key over inputs (their JSON): equal inputs, equal key."""
    text = json.dumps(inputs, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def debootstrap_image(
    image: str,
    suite: str,
    packages: str,
    *import_changes: str,
    components: str = "main",
    extra_files: dict[str, str] | None = None,
) -> None:
    """A minbase rootfs of `suite` with `packages`, plus `extra_files` (path in the rootfs:
    content), imported as `image` and labelled with the key of those inputs: kept while the key
    matches (a rebuild gives a new image ID, and every image built on it starts cold), rebuilt
    when an input changed."""
    key = input_key(DEBIAN_MIRROR, suite, packages, components, import_changes, extra_files or {})
    found = subprocess.run(
        ["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{KEY_LABEL}"}}}}',
         image],
        capture_output=True, text=True,
    )  # fmt: skip
    if found.returncode == 0 and found.stdout.strip() == key:
        say(f"{image}: kept (key {key})")
        return
    if found.returncode == 0:
        say(f"{image}: its inputs changed (key {found.stdout.strip() or 'none'} -> {key})")
    if not shutil.which("debootstrap"):
        apt_install("debootstrap")
    say(f"debootstrapping {image} (about a minute)")
    with tempfile.TemporaryDirectory() as rootfs:
        sh(
            "debootstrap",
            "--variant=minbase",
            f"--include={packages}",
            f"--components={components}",
            suite,
            rootfs,
            DEBIAN_MIRROR,
            stdout=subprocess.DEVNULL,
        )
        for rel, content in (extra_files or {}).items():
            Path(rootfs, rel).write_text(content)
        # debootstrap leaves its downloads in the rootfs (2 GB for the CUDA toolkit).
        for deb in Path(rootfs, "var/cache/apt/archives").glob("*.deb"):
            deb.unlink()
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        changes = [
            arg
            for change in (*import_changes, f"LABEL {KEY_LABEL}={key}")
            for arg in ("--change", change)
        ]
        sh("docker", "import", *changes, "-", image, stdin=tar.stdout)
        if tar.wait() != 0:
            sys.exit("error: packing the debootstrapped rootfs failed")


def ensure_base_images() -> None:
    debootstrap_image(STAND_IN_IMAGE, "bookworm", STAND_IN_PACKAGES)


def ensure_molecule_image() -> None:
    debootstrap_image(
        SYSTEMD_IMAGE,
        "trixie",
        SYSTEMD_PACKAGES,
        'CMD ["/lib/systemd/systemd"]',
        "ENV container=docker",
    )


def ensure_cuda_images() -> None:
    """Stand-ins for the CUDA base images, so that CI builds the CUDA server image through the
    same Dockerfile stages (tests/test_cuda_image.py). Debian 13's non-free CUDA 12.4.1 packages
    (nvcc 12.4.131) on a Debian 13 userland, where the real ones are NVIDIA's packages on Ubuntu
    22.04. What differs from nvidia/cuda:12.4.1-devel/-runtime-ubuntu22.04:
      - the toolkit lives where Debian puts it (/usr/bin/nvcc, /usr/lib/nvidia-cuda-toolkit,
        libraries and stubs/ in /usr/lib/x86_64-linux-gnu), not in /usr/local/cuda-12.4, and
        none of NVIDIA's ENV (CUDA_VERSION, NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES,
        PATH, LD_LIBRARY_PATH) is set;
      - glibc 2.41 and Debian 13's packages, not Ubuntu 22.04's glibc 2.35 (what the devel
        stand-in builds needs glibc 2.38: it runs on the runtime stand-in, not on bookworm);
      - gcc-11 is not in Debian 13: the devel stand-in carries a Debian 12 apt source, from
        which the Dockerfile's toolchain stage installs gcc-11/g++-11 (Ubuntu 22.04's own);
        Debian's toolkit package also pulls in g++-13;
      - Debian's nvidia-cuda-dev depends on the driver's libcuda1 (550.163.01), so the devel
        stand-in carries a real libcuda.so.1 (NVIDIA's devel image has only the stub); the
        runtime stand-in has none, as on a GPU host where the NVIDIA runtime injects it;
      - the runtime stand-in holds only cudart, cuBLAS and cuBLASLt (what the engine loads),
        not the runtime image's other libraries (cuFFT, cuRAND, cuSPARSE, NPP, NCCL).
    """
    extra = {"etc/apt/sources.list.d/bookworm.list": f"deb {DEBIAN_MIRROR} bookworm main\n"}
    debootstrap_image(
        CUDA_DEVEL_IMAGE,
        "trixie",
        CUDA_DEVEL_PACKAGES,
        components=CUDA_COMPONENTS,
        extra_files=extra,
    )
    debootstrap_image(
        CUDA_RUNTIME_IMAGE, "trixie", CUDA_RUNTIME_PACKAGES, components=CUDA_COMPONENTS
    )


def ensure_engine_source() -> None:
    dest = ROOT / "vendor" / "llama.cpp"
    if (dest / "CMakeLists.txt").is_file():
        return
    version = load_versions()["OFFLINE_ENGINE_SDIST_VERSION"]
    say(f"fetching mainline llama.cpp from the llama-cpp-python {version} sdist")
    with tempfile.TemporaryDirectory() as tmp:
        sh(
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={version}",
            "-d",
            tmp,
        )
        (sdist,) = Path(tmp).glob("*.tar.gz")
        prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
        staging = dest.with_name("llama.cpp.partial")
        shutil.rmtree(staging, ignore_errors=True)
        with tarfile.open(sdist) as tf:
            for member in tf.getmembers():
                if not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix) :]
                if not rel or rel.split("/", 1)[0] in ENGINE_SOURCE_SKIP:
                    continue
                member.name = rel
                tf.extract(member, staging, filter="data")
        staging.rename(dest)  # atomic: a half-extracted tree never sits at vendor/llama.cpp


LOCAL_WHEELS = Path("/opt/wheels")


def ensure_wheels() -> None:
    version = load_versions()["TORCH_VERSION"]
    wheelhouse = ROOT / "docker" / "wheels"
    if list(wheelhouse.glob(f"torch-{version}-*.whl")):
        return
    found = sorted(LOCAL_WHEELS.glob(f"torch-{version}-*.whl"))
    if not found:
        say(f"no torch {version} wheel in {LOCAL_WHEELS}: the convert image uses TORCH_INDEX_URL")
        return
    say(f"linking {found[0].name} into docker/wheels/")
    try:
        os.link(found[0], wheelhouse / found[0].name)
    except OSError:  # another filesystem
        shutil.copy2(found[0], wheelhouse / found[0].name)


STEPS = {
    "docker": (ensure_dockerd, ensure_compose_and_buildx),
    "compose": (ensure_compose_and_buildx,),
    "base-images": (ensure_dockerd, ensure_base_images),
    "molecule-image": (ensure_dockerd, ensure_molecule_image),
    "cuda-images": (ensure_dockerd, ensure_cuda_images),
    "engine-source": (ensure_engine_source,),
    "wheels": (ensure_wheels,),
}


def main(argv: list[str]) -> int:
    names = argv or ["all"]
    if names == ["all"]:
        names = list(STEPS)
    for name in names:
        if name not in STEPS:
            sys.exit(f"error: unknown step {name!r}; choose from {', '.join(STEPS)} or all")
        for step in STEPS[name]:
            step()
    say("ready")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
