#!/usr/bin/env python3
"""Configure, build and stage the ternary llama.cpp engine.

This is the one place the engine's CMake flags live. docker/Dockerfile runs it in the engine-build
stage, and a native build (a GPU box without Docker) runs the very same file:

    python3 docker/build_engine.py --source llama.cpp --build-dir build --prefix out \
        --backend cuda --cuda-architectures "89;90"

Standard library only: it runs on the CUDA devel image's stock python3.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Only what the product ships: the server, the quantizer the weights tools use, and the two
# benchmarks `ternary-serve bench` runs in the server image.
TARGETS = ("llama-server", "llama-quantize", "llama-bench", "llama-batched-bench")
BACKENDS = ("cuda", "cpu")


def cmake_flags(backend: str, cuda_architectures: str) -> list[str]:
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        # Portable binaries: the image runs on other CPUs than the one that built it.
        "-DGGML_NATIVE=OFF",
        # Self-contained executables: the runtime image carries no engine shared libraries.
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        # The prebuilt web UI is downloaded at configure time; builds must work offline.
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        # The server speaks plain HTTP on a private port; HTTPS terminates in front of it.
        "-DLLAMA_OPENSSL=OFF",
    ]
    if backend == "cuda":
        flags += ["-DGGML_CUDA=ON", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_architectures}"]
    return flags


def run(cmd: list[str], cwd: Path | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def source_commit(source: Path) -> str | None:
    """HEAD of a git checkout; None for a plain source tree (an archive, an sdist)."""
    if not (source / ".git").is_dir():
        return None
    out = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def resolve_commit(source: Path, expected: str) -> str:
    """The engine commit: read from git when the source is a checkout, else the pinned value.

    A checkout whose HEAD does not start with the pinned commit means the ref moved upstream.
    """
    actual = source_commit(source)
    if actual is None:
        return expected or "unknown"
    if expected and not actual.startswith(expected):
        sys.exit(
            f"error: engine source is at {actual[:12]} but ENGINE_COMMIT pins {expected}: "
            "the ref moved; update ENGINE_REF/ENGINE_COMMIT in versions.env together"
        )
    return actual


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, required=True, help="llama.cpp source tree")
    ap.add_argument("--build-dir", type=Path, required=True)
    ap.add_argument("--prefix", type=Path, required=True, help="where bin/ and build-info.json go")
    ap.add_argument("--backend", choices=BACKENDS, default="cuda")
    ap.add_argument("--cuda-architectures", default="89", help='CMake list, e.g. "89;90"')
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--engine-repo", default="unknown")
    ap.add_argument("--engine-ref", default="unknown")
    ap.add_argument(
        "--engine-commit", default="", help="pinned commit (prefix) the source must be at"
    )
    ap.add_argument("--project-version", default="unknown")
    args = ap.parse_args(argv)

    if not (args.source / "CMakeLists.txt").is_file():
        sys.exit(f"error: {args.source} is not a llama.cpp source tree (no CMakeLists.txt)")
    commit = resolve_commit(args.source, args.engine_commit)

    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    flags = cmake_flags(args.backend, args.cuda_architectures)
    started = time.monotonic()
    run(["cmake", "-S", str(args.source), "-B", str(args.build_dir), *generator, *flags])
    configured = time.monotonic()
    run(
        [
            "cmake",
            "--build",
            str(args.build_dir),
            "--config",
            "Release",
            "--parallel",
            str(args.jobs),
            "--target",
            *TARGETS,
        ]
    )
    built = time.monotonic()

    bin_dir = args.prefix / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for target in TARGETS:
        shutil.copy2(args.build_dir / "bin" / target, bin_dir / target)

    info = {
        "engine_repo": args.engine_repo,
        "engine_ref": args.engine_ref,
        "engine_commit": commit,
        "backend": args.backend,
        "cuda_architectures": args.cuda_architectures if args.backend == "cuda" else None,
        "project_version": args.project_version,
        "cmake_flags": flags,
        "targets": list(TARGETS),
        "configure_seconds": round(configured - started, 1),
        "build_seconds": round(built - configured, 1),
        "jobs": args.jobs,
    }
    (args.prefix / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
