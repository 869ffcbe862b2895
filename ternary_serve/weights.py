"""Model file checks: refuse a GGUF the server cannot load or would run badly, before it starts.

Every refusal is one line that names the fix (raised as WeightsError).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

GGUF_MAGIC = b"GGUF"
# Ternary types with CPU kernels only: with -ngl 99 their matmuls silently fall back to the CPU.
CPU_ONLY_TYPES = {"TQ1_0", "TQ2_0"}


# Early Prism "Q2_0" files packed 128-weight groups under type id 42: smaller than the official
# 64-weight layout, so they read as truncated.
LEGACY_Q2_0_HINT = "(or it is a pre-release group-128 Q2_0 file: get the model's Q2_0_g64 release)"


class WeightsError(Exception):
    """A model file the stack must not serve; the message says what to do."""


def require_ternary_gguf():
    """The gguf module from the engine source; PyPI's gguf predates the ternary Q2_0 type."""
    import gguf

    if not hasattr(gguf.GGMLQuantizationType, "Q2_0"):
        raise WeightsError(
            f"the installed gguf {getattr(gguf, '__version__', '?')} lacks the Q2_0 type: "
            "install the engine's copy (pip install vendor/llama.cpp/gguf-py)"
        )
    return gguf


def identify(head: bytes) -> str:
    """What a file is, from its first bytes. Operators receive weights under many names (a
    `model.ptq`, say); the content decides, never the extension."""
    if head[:4] == GGUF_MAGIC:
        return "gguf"
    if len(head) >= 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 2**27:
        return "safetensors"
    if head[:4] == b"PK\x03\x04":
        return "zip (a PyTorch .pt/.bin checkpoint or an archive)"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "zstd"
    if head[:5] == b"<?xml" or head[:1] == b"<":
        return "HTML/XML (an error page saved as the model?)"
    if head[:4] == b"ggjt" or head[:4] == b"tjgg":
        return "legacy GGJT (pre-GGUF llama.cpp)"
    return f"unknown (first bytes {head[:8].hex(' ')})"


WHAT_TO_DO = {
    "safetensors": "convert the Hugging Face checkpoint to GGUF first",
    "legacy GGJT (pre-GGUF llama.cpp)": "get the model's GGUF release",
}


def verify(path: Path, backend: str, expect: dict | None = None) -> dict:
    """Check that path is a complete GGUF whose tensor types the backend runs, and, given expect
    ({"architecture", "block_count", "embedding_length"}, any subset), the model's shape. Returns a
    summary."""
    gguf = require_ternary_gguf()
    try:
        with path.open("rb") as fh:
            head = fh.read(16)
    except FileNotFoundError:
        raise WeightsError(
            f"model file {path} not found: put the GGUF there or set MODEL_FILE (make config)"
        ) from None
    except PermissionError:
        raise WeightsError(
            f"model file {path} is not readable by uid {os.getuid()}: make the model directory "
            "world-readable (chmod a+rx on the directory, a+r on the file)"
        ) from None
    except IsADirectoryError:
        raise WeightsError(
            f"{path} is a directory: set MODEL_FILE to the .gguf file in it"
        ) from None
    kind = identify(head)
    if kind != "gguf":
        fix = WHAT_TO_DO.get(kind, "fetch the model again")
        raise WeightsError(f"{path} is not a GGUF file: its content is {kind}: {fix}")
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as exc:
        if "GGMLQuantizationType" in str(exc):
            raise WeightsError(
                f"{path} uses a tensor type this engine does not know ({exc}): Bonsai 2 "
                "PTQ1_0/PQ2_0 files need the PrismML engine (ENGINE_REPO in versions.env)"
            ) from exc
        # Data that does not fit its tensor's declared type and shape.
        legacy = f" {LEGACY_Q2_0_HINT}" if "cannot reshape" in str(exc) else ""
        raise WeightsError(
            f"{path} is truncated or corrupt ({exc}){legacy}: fetch the model again"
        ) from exc
    except (OSError, IndexError) as exc:
        raise WeightsError(
            f"{path} is truncated or corrupt ({exc}): fetch the model again"
        ) from exc

    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    types = sorted({t.tensor_type.name for t in reader.tensors})
    if end > size:
        legacy = f" {LEGACY_Q2_0_HINT}" if "Q2_0" in types else ""
        raise WeightsError(
            f"{path} is truncated: tensor data needs {end} bytes, the file has {size}{legacy}: "
            "fetch the model again"
        )
    cpu_only = sorted(CPU_ONLY_TYPES.intersection(types))
    if backend == "cuda" and cpu_only:
        raise WeightsError(
            f"{path} holds {'/'.join(cpu_only)} tensors, which have no CUDA kernels (they would "
            "run on the CPU): use the Q2_0 packing of this model"
        )
    arch_field = reader.get_field("general.architecture")
    architecture = arch_field.contents() if arch_field is not None else None
    if not architecture:
        raise WeightsError(f"{path} has no general.architecture key: it is not a model GGUF")
    check_shape(reader, path, architecture, expect or {})
    return {
        "path": str(path),
        "architecture": architecture,
        "tensor_types": types,
        "tensors": len(reader.tensors),
        "bytes": size,
        "backend": backend,
    }


def shape_from_config(config_file: Path) -> dict:
    """Block count and embedding size from a Hugging Face config.json."""
    try:
        config = json.loads(config_file.read_text())
        return {
            "block_count": config["num_hidden_layers"],
            "embedding_length": config["hidden_size"],
        }
    except (OSError, ValueError, KeyError) as exc:
        raise WeightsError(
            f"{config_file}: no model shape in it ({type(exc).__name__}: {exc}): give the "
            "checkpoint's config.json"
        ) from exc


def check_shape(reader, path: Path, architecture: str, expect: dict) -> None:
    """The model's architecture, block count and embedding size against what was expected."""
    if expect.get("architecture") not in (None, architecture):
        raise WeightsError(
            f"{path} is a {architecture} model, expected {expect['architecture']}: "
            "check MODEL_FILE / the source, or the catalog entry"
        )
    for key in ("block_count", "embedding_length"):
        if key not in expect:
            continue
        field = reader.get_field(f"{architecture}.{key}")
        found = field.contents() if field is not None else None
        if found != expect[key]:
            raise WeightsError(
                f"{path} has {architecture}.{key} = {found}, expected {expect[key]} (from the "
                "model's config.json): the file is from another model; convert or fetch again"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="ternary-serve verify", description="Check a GGUF before serving it."
    )
    ap.add_argument("model", type=Path)
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--architecture", help="expected general.architecture, e.g. llama")
    ap.add_argument(
        "--config", type=Path, help="the model's Hugging Face config.json: block count and width"
    )
    args = ap.parse_args(argv)
    expect = {"architecture": args.architecture} if args.architecture else {}
    try:
        if args.config:
            expect |= shape_from_config(args.config)
        summary = verify(args.model, args.backend, expect)
    except WeightsError as exc:
        print(f"verify: {exc}", file=sys.stderr)
        return 1
    print(
        f"verify: ok: {summary['path']}: {summary['architecture']}, {summary['tensors']} tensors "
        f"({', '.join(summary['tensor_types'])}), {summary['bytes'] / 2**30:.2f} GiB"
    )
    return 0
