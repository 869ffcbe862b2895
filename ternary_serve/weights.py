"""Model files: check a GGUF before the server loads it, hash it, and put it in place atomically.

A file is judged with the configured engine's knowledge: the PrismML fork's private tensor types
(PQ2_0, PTQ1_0) are read structurally from their block layouts, since no gguf-py knows them, and
are refused only where the engine is mainline. Every refusal is one line that names the fix
(raised as WeightsError).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ternary_serve import errors
from ternary_serve.versions import configured_engine_repo

GGUF_MAGIC = b"GGUF"
CHUNK = 8 * 2**20
# Room left free on the disk beyond the file itself (logs, the server's temporary files).
DISK_MARGIN = 2 * 2**30
# Ternary types with CPU kernels only: with -ngl 99 their matmuls silently fall back to the CPU.
CPU_ONLY_TYPES = {"TQ1_0", "TQ2_0"}


# Early Prism "Q2_0" files packed 128-weight groups under type id 42: smaller than the official
# 64-weight layout, so they read as truncated.
LEGACY_Q2_0_HINT = "(or it is a pre-release group-128 Q2_0 file: get the model's Q2_0_g64 release)"


# Written into every synthetic model (ternary-serve synth): its weights are random, so the smoke
# test's quality gate, which asks questions with known answers, is skipped for it, visibly.
SYNTHETIC_MARKER = "ternary_serve.synthetic"


@dataclass(frozen=True)
class TypeLayout:
    """A ggml tensor type as the engine lays it out: `block_size` weights in `type_size` bytes."""

    name: str
    block_size: int
    type_size: int


# Types only the PrismML fork knows (its ggml.h: GGML_TYPE_PQ2_0 = 142, GGML_TYPE_PTQ1_0 = 143;
# block layouts from its ggml-common.h). Neither mainline's gguf-py nor the fork's own knows them.
# PQ2_0: fp16 d, then qs[32]: weight j = (((qs[j/4] >> 2*(j%4)) & 3) - 1) * d.
# PTQ1_0: qs[24] and qh[2] of base-3 digits, then fp16 d.
FORK_TYPES = {
    142: TypeLayout("PQ2_0", 128, 34),
    143: TypeLayout("PTQ1_0", 128, 28),
}
# What each engine knows beyond gguf-py's own GGMLQuantizationType.
ENGINES = {"prismml": FORK_TYPES, "mainline": {}}


def engine_family(engine_repo: str) -> str:
    """The engine an ENGINE_REPO builds: the PrismML fork, or mainline llama.cpp."""
    return "prismml" if "prismml" in engine_repo.lower() else "mainline"


class WeightsError(errors.ServeError):
    """A model file the stack must not serve; the message says what to do."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + DISK_MARGIN:
        raise WeightsError(
            f"{directory} has {free / 2**30:.1f} GiB free, the download needs "
            f"{(needed + DISK_MARGIN) / 2**30:.1f} GiB: free space there or set MODEL_DIR elsewhere"
        )


def manifest_path(target: Path) -> Path:
    return target.with_name(target.name + ".manifest.json")


def require_ternary_gguf():
    """The gguf module from the engine source; PyPI's gguf predates the ternary Q2_0 type."""
    import gguf

    if not hasattr(gguf.GGMLQuantizationType, "Q2_0"):
        raise WeightsError(
            f"the installed gguf {getattr(gguf, '__version__', '?')} lacks the Q2_0 type: "
            "install the engine's copy (pip install vendor/llama.cpp/gguf-py)"
        )
    return gguf


@dataclass(frozen=True)
class TensorEntry:
    """One row of a GGUF's tensor table, whatever the tensor's type."""

    name: str
    type_name: str
    n_elements: int
    n_bytes: int
    data_offset: int


class UnknownTensorType(ValueError):
    def __init__(self, tensor: str, type_id: int):
        super().__init__(f"tensor {tensor} has ggml type id {type_id}")
        self.tensor, self.type_id = tensor, type_id


def engine_reader(gguf, extra_types: dict[int, TypeLayout]):
    """gguf-py's GGUFReader, taught the engine's extra tensor types: their tensors are sized from
    the block layout (no data view), the rest are read by gguf-py as usual."""

    class EngineReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            known = set(gguf.GGMLQuantizationType)
            ours, extra = [], []
            for field in fields:
                (ours if int(field.parts[4][0]) in known else extra).append(field)
            super()._build_tensors(start_offs, ours)
            self.extra_tensors = []
            for field in extra:
                name = bytes(field.parts[1]).decode("utf-8", "replace")
                type_id = int(field.parts[4][0])
                layout = extra_types.get(type_id)
                if layout is None:
                    raise UnknownTensorType(name, type_id)
                n_elements = 1
                for dim in field.parts[3].tolist():
                    n_elements *= int(dim)
                if int(field.parts[3][0]) % layout.block_size:
                    raise ValueError(
                        f"tensor {name}: rows of {int(field.parts[3][0])} weights do not fill "
                        f"{layout.name} blocks of {layout.block_size}"
                    )
                self.extra_tensors.append(
                    TensorEntry(
                        name,
                        layout.name,
                        n_elements,
                        n_elements // layout.block_size * layout.type_size,
                        int(start_offs + field.parts[5][0]),
                    )
                )

    return EngineReader


def is_synthetic(path: Path) -> bool:
    """Whether the model says it is synthetic (SYNTHETIC_MARKER); files of any engine are read."""
    try:
        reader = engine_reader(require_ternary_gguf(), FORK_TYPES)(path)
    except (OSError, ValueError, IndexError) as exc:
        raise WeightsError(f"{path} cannot be read ({exc}): check MODEL_FILE") from exc
    marker = reader.get_field(SYNTHETIC_MARKER)
    return bool(marker is not None and marker.contents())


def tensor_table(reader) -> list[TensorEntry]:
    table = [
        TensorEntry(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes), t.data_offset)
        for t in reader.tensors
    ]
    return sorted(table + reader.extra_tensors, key=lambda t: t.data_offset)


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


def verify(path: Path, backend: str, expect: dict | None = None, engine: str = "mainline") -> dict:
    """Check that path is a complete GGUF whose tensor types `engine` (ENGINES) knows and the
    backend runs, and, given expect ({"architecture", "block_count", "embedding_length"}, any
    subset), the model's shape. Returns a summary."""
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
        reader = engine_reader(gguf, ENGINES[engine])(path)
    except UnknownTensorType as exc:
        other = [name for name, types in ENGINES.items() if exc.type_id in types]
        if other:
            raise WeightsError(
                f"{path} uses {ENGINES[other[0]][exc.type_id].name} tensors ({exc}), which only "
                f"the {other[0]} engine runs, and the configured engine is {engine}: "
                "Bonsai 2 PTQ1_0/PQ2_0 files need the PrismML engine (ENGINE_REPO in versions.env)"
            ) from exc
        raise WeightsError(
            f"{path} uses a tensor type the {engine} engine does not know ({exc}): "
            "use a packing this engine runs, or fetch the model again if the file is damaged"
        ) from exc
    except ValueError as exc:
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
    table = tensor_table(reader)
    types = sorted({t.type_name for t in table})
    check_extents(path, table, size, int(reader.alignment), types)
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
        "tensors": len(table),
        "bytes": size,
        "backend": backend,
        "engine": engine,
    }


def check_extents(path: Path, table: list[TensorEntry], size: int, alignment: int, types) -> None:
    """Every tensor's data starts aligned, after the one before it, and ends inside the file."""
    end = 0
    for tensor in table:
        if tensor.data_offset % alignment or tensor.data_offset < end:
            where = "unaligned" if tensor.data_offset % alignment else "inside the tensor before"
            raise WeightsError(
                f"{path} is corrupt: tensor {tensor.name}'s data starts at {tensor.data_offset}, "
                f"{where}: fetch the model again"
            )
        end = tensor.data_offset + tensor.n_bytes
    if end > size:
        legacy = f" {LEGACY_Q2_0_HINT}" if "Q2_0" in types else ""
        raise WeightsError(
            f"{path} is truncated: tensor data needs {end} bytes, the file has {size}{legacy}: "
            "fetch the model again"
        )


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
    ap.add_argument(
        "--engine-repo", help="judge with this engine's types (default: the configured engine)"
    )
    args = ap.parse_args(argv)
    expect = {"architecture": args.architecture} if args.architecture else {}
    engine = engine_family(args.engine_repo or configured_engine_repo())

    def verify_and_report() -> int:
        wanted = expect | shape_from_config(args.config) if args.config else expect
        summary = verify(args.model, args.backend, wanted, engine)
        print(
            f"verify: ok: {summary['path']}: {summary['architecture']}, {summary['tensors']} "
            f"tensors ({', '.join(summary['tensor_types'])}), {summary['bytes'] / 2**30:.2f} GiB"
        )
        return 0

    return errors.run("verify", verify_and_report)
