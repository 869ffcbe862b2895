"""Model checks: each bad file is refused with one line that names the fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ternary_serve import weights
from ternary_serve.weights import WeightsError, require_ternary_gguf


def write_gguf_with(path: Path, qtype_name: str, block_bytes: int, block_weights: int) -> Path:
    gguf = require_ternary_gguf()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    rows, cols = 4, 256
    raw = np.zeros((rows, cols // block_weights * block_bytes), dtype=np.uint8)
    writer.add_tensor(
        "blk.0.attn_q.weight", raw, raw_dtype=getattr(gguf.GGMLQuantizationType, qtype_name)
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_synthetic_model_passes(tiny_model):
    summary = weights.verify(tiny_model, "cuda")
    assert summary["architecture"] == "llama"
    assert "Q2_0" in summary["tensor_types"]


def test_missing_file(tmp_path):
    with pytest.raises(WeightsError, match="not found: put the GGUF there"):
        weights.verify(tmp_path / "absent.gguf", "cpu")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"<html>404 Not Found</html>")
    with pytest.raises(WeightsError, match="not a GGUF file: its content is HTML.*fetch the model"):
        weights.verify(path, "cpu")


def safetensors_bytes() -> bytes:
    header = json.dumps({"w": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\x00" * 4


@pytest.mark.parametrize(
    "content, found, fix",
    [
        (None, "gguf", None),  # the tiny model under another name: served as what it is
        (safetensors_bytes(), "safetensors", "convert the Hugging Face checkpoint"),
        (b"PK\x03\x04" + b"\x00" * 60, "zip", "fetch the model again"),
        (b"\x8f\x13\x00\x42" * 16, "unknown \\(first bytes 8f 13 00 42", "fetch the model again"),
    ],
)
def test_model_ptq_is_judged_by_content(tiny_model, tmp_path, content, found, fix):
    """Operators receive `model.ptq` files: no such format exists; the bytes say what it is."""
    path = tmp_path / "model.ptq"
    path.write_bytes(tiny_model.read_bytes() if content is None else content)
    if fix is None:
        assert weights.verify(path, "cuda")["architecture"] == "llama"
        return
    with pytest.raises(WeightsError, match=f"its content is {found}.*{fix}"):
        weights.verify(path, "cuda")


@pytest.mark.parametrize("keep", [100, 0.5, 0.999])
def test_truncated_files(tiny_model, tmp_path, keep):
    data = tiny_model.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(WeightsError, match="truncated"):
        weights.verify(cut, "cpu")


def test_tq2_0_refused_on_cuda_but_allowed_on_cpu(tmp_path):
    path = write_gguf_with(tmp_path / "tq.gguf", "TQ2_0", block_bytes=66, block_weights=256)
    with pytest.raises(WeightsError, match="no CUDA kernels.*Q2_0 packing"):
        weights.verify(path, "cuda")
    assert weights.verify(path, "cpu")["tensor_types"] == ["TQ2_0"]


def test_unknown_tensor_type_points_at_the_prismml_engine(tiny_model, tmp_path):
    """A PTQ1_0/PQ2_0 tensor carries a type id mainline gguf-py does not know."""
    data = bytearray(tiny_model.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.index(name) + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    type_at = at + 4 + 8 * n_dims
    struct.pack_into("<I", data, type_at, 200)
    path = tmp_path / "bonsai2-ptq.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="PrismML engine"):
        weights.verify(path, "cuda")


def test_cli_prints_one_line_and_fails(tmp_path, capsys):
    assert weights.main([str(tmp_path / "absent.gguf"), "--backend", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("verify: ")
