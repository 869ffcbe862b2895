"""Model checks: each bad file is refused with one line that names the fix."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from ternary_serve import convert, synthetic, weights
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
    assert summary["architecture"] == "qwen35"
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
        assert weights.verify(path, "cuda")["architecture"] == "qwen35"
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


def retype_tensor(model: Path, out: Path, tensor: bytes, type_id: int) -> Path:
    """A copy of model with one tensor's ggml type id changed in its tensor-table record."""
    data = bytearray(model.read_bytes())
    at = data.index(tensor) + len(tensor)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    out.write_bytes(bytes(data))
    return out


def test_a_fork_type_on_mainline_points_at_the_prismml_engine(tiny_model, tmp_path):
    path = retype_tensor(tiny_model, tmp_path / "b.gguf", b"blk.0.ffn_up.weight", 143)
    with pytest.raises(WeightsError, match="PTQ1_0 tensors .* only the prismml engine runs"):
        weights.verify(path, "cuda", engine="mainline")


def test_a_type_no_engine_knows_is_refused_by_both(tiny_model, tmp_path):
    path = retype_tensor(tiny_model, tmp_path / "x.gguf", b"blk.0.ffn_up.weight", 200)
    for engine in weights.ENGINES:
        with pytest.raises(WeightsError, match=f"the {engine} engine does not know.*id 200"):
            weights.verify(path, "cuda", engine=engine)


@pytest.mark.parametrize("packing", ["PQ2_0", "PTQ1_0"])
def test_fork_packed_files_are_checked_structurally(tmp_path, packing):
    """No gguf-py knows 142/143; the header, table, offsets and size are still checked."""
    path = synthetic.write_fork_packed(tmp_path / f"m-{packing}.gguf", packing)
    summary = weights.verify(path, "cuda", engine="prismml")
    assert packing in summary["tensor_types"] and summary["architecture"] == "qwen35"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(WeightsError, match="is truncated: tensor data needs"):
        weights.verify(cut, "cuda", engine="prismml")


def test_overlapping_tensor_data_is_refused(tmp_path):
    """A tensor-table offset that points into the tensor before it (a corrupt table)."""
    gguf = weights.require_ternary_gguf()
    path = synthetic.write_fork_packed(tmp_path / "m.gguf", "PQ2_0")
    reader = weights.engine_reader(gguf, weights.FORK_TYPES)(path)
    first, second = weights.tensor_table(reader)[:2]
    data = bytearray(path.read_bytes())
    name = second.name.encode()
    at = data.index(name) + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<Q", data, at + 4 + 8 * n_dims + 4, first.data_offset - reader.data_offset)
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="inside the tensor before"):
        weights.verify(path, "cuda", engine="prismml")


def test_cli_prints_one_line_and_fails(tmp_path, capsys):
    assert weights.main([str(tmp_path / "absent.gguf"), "--backend", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("verify: ")


@pytest.mark.parametrize(
    "expect, message",
    [
        ({"architecture": "qwen3"}, "is a qwen35 model, expected qwen3"),
        ({"block_count": 3}, "qwen35.block_count = 4, expected 3"),
        ({"embedding_length": 4096}, "qwen35.embedding_length = 256, expected 4096"),
    ],
)
def test_shape_against_the_expected_model(tiny_model, expect, message):
    with pytest.raises(WeightsError, match=message):
        weights.verify(tiny_model, "cpu", expect)
    shape = synthetic.PROFILES["tiny"]
    right = {"architecture": "qwen35", "block_count": shape.n_layer, "embedding_length": 256}
    assert weights.verify(tiny_model, "cpu", right)["architecture"] == "qwen35"


def test_verify_cli_checks_against_config_json(tiny_model, tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 40, "hidden_size": 128}))
    assert weights.main([str(tiny_model), "--backend", "cpu", "--config", str(config)]) == 1
    assert "block_count = 4, expected 40" in capsys.readouterr().err


def test_flipped_bytes_in_the_header_are_refused(tiny_model, tmp_path):
    data = bytearray(tiny_model.read_bytes())
    data[8:16] = b"\xff" * 8  # the tensor count
    path = tmp_path / "flipped.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        weights.verify(path, "cpu")


def test_group_128_q2_0_file_gets_its_own_hint(tmp_path):
    """Pre-release Prism "Q2_0" files packed 128 weights per group under type id 42."""
    # One 4x256 tensor: the official layout has four 18-byte blocks per row, group 128 two 34-byte
    # blocks, 16 bytes less in all; header and metadata are the same.
    path = write_gguf_with(tmp_path / "old.gguf", "Q2_0", block_bytes=18, block_weights=64)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(WeightsError, match="group-128 Q2_0 file: get the model's Q2_0_g64"):
        weights.verify(path, "cpu")


# --- inputs to convert: refused before any engine tool runs ---------------------------------------


@pytest.fixture
def checkpoint_copy(tmp_path) -> Path:
    return synthetic.write_checkpoint(tmp_path / "ckpt", "llama-tiny")


def drop_key(ckpt: Path) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    del config["num_hidden_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))


def truncate_shard(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])


@pytest.mark.parametrize(
    "damage, message",
    [
        (drop_key, "lacks num_hidden_layers"),
        (lambda c: (c / "config.json").unlink(), "has no config.json"),
        (lambda c: (c / "config.json").write_text("{"), "is not valid JSON"),
        (lambda c: (c / "tokenizer.model").unlink(), "has no tokenizer"),
        (lambda c: [p.unlink() for p in c.glob("*.safetensors")], "no \\*.safetensors"),
        (truncate_shard, "is truncated: its tensors need"),
        (
            lambda c: sorted(c.glob("*.safetensors"))[0].write_bytes(
                b"\x10" + b"\x00" * 7 + b"{x" + b" " * 14
            ),
            "corrupt header",
        ),
    ],
)
def test_bad_checkpoints_are_refused_with_the_fix(checkpoint_copy, tmp_path, damage, message):
    damage(checkpoint_copy)
    with pytest.raises(WeightsError, match=message):
        convert.convert(checkpoint_copy, tmp_path / "out.gguf", engine_dir=tmp_path / "no-engine")
    assert not (tmp_path / "out.gguf").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x8f\x13\x00\x42" * 16, "cannot be converted: its content is unknown"),
        (b"<html>rate limited</html>", "its content is HTML"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{}" + b" " * 14, "one safetensors file"),
    ],
)
def test_model_ptq_of_unknown_content_is_refused_by_convert(tmp_path, content, message):
    source = tmp_path / "model.ptq"
    source.write_bytes(content)
    with pytest.raises(WeightsError, match=message):
        convert.convert(source, tmp_path / "out.gguf", engine_dir=tmp_path / "no-engine")


def test_gguf_cannot_be_widened(tiny_model, tmp_path):
    with pytest.raises(WeightsError, match="already a GGUF: widening it to F16"):
        convert.convert(tiny_model, tmp_path / "out.gguf", "F16", engine_dir=tmp_path)


def test_convert_outside_the_image_names_the_fix(checkpoint_copy, tmp_path):
    with pytest.raises(WeightsError, match="run convert in the convert image \\(make convert\\)"):
        convert.convert(checkpoint_copy, tmp_path / "out.gguf", engine_dir=tmp_path / "none")
