"""Convert weights into the deployable GGUF with the engine's own tools.

  Hugging Face checkpoint directory (config.json, tokenizer, *.safetensors)
      -> the engine's convert_hf_to_gguf.py (16-bit GGUF) -> llama-quantize -> target type
  GGUF in one type -> llama-quantize -> another (where the engine can requantize)

Inputs are identified by content, never by name (a `model.ptq` is handled as what it really is).
Work happens in a scratch directory beside the output; only a result that passes the model checks
is renamed into place. A manifest (`<output>.manifest.json`) records source, input and output
SHA-256, the engine and tool versions and the duration; a rerun that finds a matching manifest
does nothing. Memory stays bounded: both tools stream tensor by tensor (see docs/convert-bench.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

from ternary_serve import errors
from ternary_serve.files import place, write_json
from ternary_serve.weights import (
    WeightsError,
    check_disk,
    engine_family,
    identify,
    manifest_path,
    sha256_of,
    shape_from_config,
    verify,
)

# Where the convert image keeps the engine's tools (docker/Dockerfile, stage convert).
ENGINE_DIR = Path(os.environ.get("TERNARY_SERVE_ENGINE_DIR", "/opt/engine"))
# 16-bit and 8-bit types are written by convert_hf_to_gguf.py itself; the rest by llama-quantize.
CONVERTER_TYPES = {"F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
QUANTIZE_TYPES = ("Q2_0", "Q1_0")
TYPES = (*QUANTIZE_TYPES, *CONVERTER_TYPES)
CHECKPOINT_KEYS = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")
# The 16-bit intermediate plus the output, relative to the checkpoint's size, with headroom.
SCRATCH_FACTOR = 1.5


def read_checkpoint(directory: Path) -> dict:
    """config.json of a Hugging Face checkpoint, after checking the files convert will need."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise WeightsError(
            f"{directory} has no config.json: give the Hugging Face checkpoint directory "
            "(config.json, tokenizer files, *.safetensors)"
        )
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{config_file} is not valid JSON ({exc}): fetch it again") from exc
    missing = [key for key in CHECKPOINT_KEYS if key not in config]
    if missing:
        raise WeightsError(
            f"{config_file} lacks {', '.join(missing)}: it is not a complete model config; "
            "fetch the checkpoint's config.json again"
        )
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise WeightsError(
            f"{directory} has no tokenizer ({' or '.join(TOKENIZER_FILES)}): copy the "
            "checkpoint's tokenizer files beside config.json"
        )
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise WeightsError(
            f"{directory} has no *.safetensors files: download the weights into it "
            "(PyTorch .bin checkpoints are not accepted; they can run code when loaded)"
        )
    for shard in shards:
        check_safetensors(shard)
    return config


def check_safetensors(path: Path) -> None:
    """The header parses and the data it describes fits in the file (catches truncation)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if header_len <= 0 or 8 + header_len > size:
            raise WeightsError(f"{path} is not a complete safetensors file: fetch it again")
        try:
            header = json.loads(fh.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise WeightsError(f"{path} has a corrupt header ({exc}): fetch it again") from exc
    end = max(
        (spec["data_offsets"][1] for name, spec in header.items() if name != "__metadata__"),
        default=0,
    )
    if 8 + header_len + end > size:
        raise WeightsError(
            f"{path} is truncated: its tensors need {8 + header_len + end} bytes, the file has "
            f"{size}: fetch it again"
        )


def checkpoint_digest(directory: Path) -> str:
    """One SHA-256 over every file of the checkpoint (names and contents), in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        print(f"convert: hashing {path.name}", file=sys.stderr, flush=True)
        digest.update(f"{path.name}\0{sha256_of(path)}\n".encode())
    return digest.hexdigest()


def engine_info(engine_dir: Path) -> dict:
    info_file = engine_dir / "build-info.json"
    if not info_file.is_file():
        raise WeightsError(
            f"{info_file} not found: run convert in the convert image (make convert), or set "
            "TERNARY_SERVE_ENGINE_DIR to an engine built by docker/build_engine.py"
        )
    return json.loads(info_file.read_text())


def tool_versions() -> dict:
    versions = {"python": platform.python_version()}
    for package in ("torch", "transformers", "gguf", "safetensors", "sentencepiece"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return versions


def run_tool(cmd: list[str], what: str) -> dict:
    """Run one of the engine's tools, its progress passed through; a failure is one line.
    Returns its duration and the peak resident memory of the tools run so far."""
    print("convert: + " + " ".join(cmd), file=sys.stderr, flush=True)
    started = time.monotonic()
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise WeightsError(f"{what} failed (exit {result.returncode}): {last}")
    sys.stderr.write(result.stderr)
    return {
        "tool": what,
        "seconds": round(time.monotonic() - started, 2),
        # Linux reports KiB; the maximum over every child waited for so far.
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
    }


def fingerprint(source: Path) -> list:
    """Names, sizes and modification times: a rerun on unchanged input skips hashing it."""
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def input_digest(source: Path) -> str:
    return checkpoint_digest(source) if source.is_dir() else sha256_of(source)


def previous_manifest(output: Path, qtype: str, commit: str) -> dict | None:
    """The manifest of an output in place that this engine made, to this type, else None."""
    manifest_file = manifest_path(output)
    if not (output.is_file() and manifest_file.is_file()):
        return None
    manifest = json.loads(manifest_file.read_text())
    same_output = (
        manifest.get("type") == qtype
        and manifest.get("engine", {}).get("commit") == commit
        and manifest.get("bytes") == output.stat().st_size
    )
    return manifest if same_output else None


def convert(
    source: Path,
    output: Path,
    qtype: str = "Q2_0",
    backend: str = "cuda",
    engine_dir: Path = ENGINE_DIR,
    embeddings_type: str | None = None,
) -> dict:
    """Convert source into output; returns the manifest. Raises WeightsError, output untouched."""
    if qtype not in TYPES:
        raise WeightsError(f"unknown target type {qtype}: choose one of {', '.join(TYPES)}")
    if source.is_dir():
        read_checkpoint(source)
        kind, expect = "checkpoint", shape_from_config(source / "config.json")
        input_size = sum(p.stat().st_size for p in source.glob("*.safetensors"))
    elif source.is_file():
        with source.open("rb") as fh:
            kind = identify(fh.read(16))
        if kind == "safetensors":
            raise WeightsError(
                f"{source} is one safetensors file: give the checkpoint directory it came in "
                "(config.json and tokenizer files are needed too)"
            )
        if kind != "gguf":
            raise WeightsError(f"{source} cannot be converted: its content is {kind}")
        if qtype in CONVERTER_TYPES:
            raise WeightsError(
                f"{source} is already a GGUF: widening it to {qtype} gains nothing; convert "
                "the original checkpoint instead"
            )
        expect, input_size = None, source.stat().st_size
    else:
        raise WeightsError(f"{source} not found: give a checkpoint directory or a GGUF file")

    engine = engine_info(engine_dir)
    family = engine_family(engine.get("engine_repo") or "")
    if kind == "gguf":  # complete and readable; the target backend is checked on the output
        verify(source, "cpu", engine=family)

    previous = previous_manifest(output, qtype, engine["engine_commit"])
    unchanged = previous and previous.get("input_fingerprint") == fingerprint(source)
    input_sha256 = None if unchanged else input_digest(source)
    if previous and (unchanged or previous.get("input_sha256") == input_sha256):
        print(f"convert: {output} is up to date (manifest matches the input); nothing to do")
        return previous

    output.parent.mkdir(parents=True, exist_ok=True)
    check_disk(output.parent, int(input_size * SCRATCH_FACTOR))
    scratch = output.parent / f".{output.name}.convert"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    started = time.monotonic()
    steps = []
    try:
        intermediate = source
        if kind == "checkpoint":
            intermediate = scratch / ("out.gguf" if qtype in CONVERTER_TYPES else "f16.gguf")
            step = run_tool(
                [
                    sys.executable,
                    str(engine_dir / "convert" / "convert_hf_to_gguf.py"),
                    str(source),
                    "--outfile",
                    str(intermediate),
                    "--outtype",
                    CONVERTER_TYPES.get(qtype, "f16"),
                ],
                "convert_hf_to_gguf.py",
            )
            steps.append(step)
        result = intermediate
        if qtype in QUANTIZE_TYPES:
            result = scratch / "out.gguf"
            keep = (
                ["--token-embedding-type", embeddings_type, "--output-tensor-type", embeddings_type]
                if embeddings_type
                else []
            )
            requantize = ["--allow-requantize"] if kind == "gguf" else []
            step = run_tool(
                [
                    str(engine_dir / "bin" / "llama-quantize"),
                    *requantize,
                    *keep,
                    str(intermediate),
                    str(result),
                    qtype,
                    str(os.cpu_count() or 1),
                ],
                "llama-quantize",
            )
            steps.append(step)
        summary = verify(result, backend, expect, family)
        output_sha256 = sha256_of(result)
        place(result, output)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    manifest = {
        "source": str(source),
        "source_kind": kind,
        "input_sha256": input_sha256,
        "input_fingerprint": fingerprint(source),
        "path": str(output),
        "type": qtype,
        "embeddings_type": embeddings_type,
        "sha256": output_sha256,
        "bytes": output.stat().st_size,
        "architecture": summary["architecture"],
        "tensor_types": summary["tensor_types"],
        "backend_checked": backend,
        "engine": {
            "repo": engine.get("engine_repo"),
            "ref": engine.get("engine_ref"),
            "commit": engine.get("engine_commit"),
        },
        "tools": tool_versions(),
        "input_bytes": input_size,
        "steps": steps,
        "seconds": round(time.monotonic() - started, 1),
        "converted_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    manifest_file = manifest_path(output)
    write_json(manifest_file, manifest)
    print(
        f"convert: {output} in place: {qtype}, {manifest['bytes'] / 2**30:.2f} GiB, "
        f"sha256 {output_sha256}, {manifest['seconds']} s"
    )
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve convert", description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a Hugging Face checkpoint directory or a GGUF file")
    ap.add_argument("output", type=Path, help="where the GGUF goes, e.g. /models/model.gguf")
    ap.add_argument("--type", default="Q2_0", choices=TYPES, help="target type (default Q2_0)")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument(
        "--embeddings-type",
        help="type for token_embd and output (e.g. F16); default: llama-quantize's choice",
    )
    ap.add_argument("--engine-dir", type=Path, default=ENGINE_DIR)
    args = ap.parse_args(argv)

    def convert_it() -> int:
        convert(
            args.source, args.output, args.type, args.backend, args.engine_dir, args.embeddings_type
        )
        return 0

    return errors.run("convert", convert_it)
