"""Synthetic models: Q2_0 packing checked against ggml's bit layout, the qwen35 profiles against
the engine's required tensors and Bonsai 2 27B's hyperparameters, and the fork-packed stand-ins
against the GGUF layout, read back from the raw bytes."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from ternary_serve import synthetic
from ternary_serve.weights import FORK_TYPES, SYNTHETIC_MARKER, require_ternary_gguf

# --- a GGUF header reader of our own: independent of gguf-py, and it reads the fork's type ids ----

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q"}
SCALARS[12] = "d"
# ggml type id -> (weights per block, bytes per block)
LAYOUTS = {0: (1, 4), 1: (1, 2), 24: (1, 1), 42: (64, 18)}
LAYOUTS |= {type_id: (t.block_size, t.type_size) for type_id, t in FORK_TYPES.items()}


def read_header(path: Path) -> tuple[dict, list[dict], int]:
    """(metadata, tensor records, data start) from the file's first 32 MiB."""
    with path.open("rb") as fh:
        data = fh.read(32 * 2**20)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n : pos].decode()

    def value(kind: int):
        if kind == 8:
            return string()
        if kind == 9:
            item, count = take("I"), take("Q")
            return [value(item) for _ in range(count)]
        return take(SCALARS[kind])

    assert data[:4] == b"GGUF"
    pos = 4
    assert take("I") == 3
    n_tensors, n_kv = take("Q"), take("Q")
    kv = {}
    for _ in range(n_kv):
        key = string()
        kv[key] = value(take("I"))
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        tensors.append({"name": name, "dims": dims, "type": take("I"), "offset": take("Q")})
    alignment = kv.get("general.alignment", 32)
    return kv, tensors, -(-pos // alignment) * alignment


def n_bytes(record: dict) -> int:
    block, size = LAYOUTS[record["type"]]
    assert record["dims"][0] % block == 0, record
    return int(np.prod(record["dims"])) // block * size


def assert_layout(path: Path, tensors: list[dict], data_start: int) -> None:
    """Offsets aligned, tensors back to back (padding only), the last one ending the file."""
    end = 0
    for record in tensors:
        assert record["offset"] % 32 == 0, record
        assert end <= record["offset"] < end + 32, record
        end = record["offset"] + n_bytes(record)
    assert data_start + -(-end // 32) * 32 == path.stat().st_size


# --- Q2_0 packing ---------------------------------------------------------------------------------


def dequantize_q2_0(packed: np.ndarray, cols: int, group: int = 64) -> np.ndarray:
    """ggml's dequantize_row_q2_0: per block, fp16 d then 2-bit codes, 00=-1 .. 10=+1 (the fork's
    PQ2_0 is the same with 128-weight groups)."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, cols // group, 2 + group // 4)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 2:]
    codes = np.stack([(qs >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1)
    assert (codes != 3).all()
    codes = codes.reshape(rows, -1, group)
    return ((codes.astype(np.float32) - 1) * d).reshape(rows, cols)


def test_ternary_weights_round_trip_exactly():
    rng = np.random.default_rng(1)
    weights = synthetic.ternary_matrix(rng, 8, 256)
    packed = synthetic.pack_q2_0(weights)
    assert packed.shape == (8, 256 // 64 * 18)
    np.testing.assert_array_equal(dequantize_q2_0(packed, 256), weights)


def test_all_zero_group_packs_to_zero_scale():
    packed = synthetic.pack_q2_0(np.zeros((1, 64), dtype=np.float32))
    np.testing.assert_array_equal(dequantize_q2_0(packed, 64), 0)


def test_rows_must_be_whole_groups():
    with pytest.raises(ValueError, match="multiple of 64"):
        synthetic.pack_q2_0(np.zeros((1, 100), dtype=np.float32))


def test_random_blocks_are_what_pack_q2_0_makes_of_their_weights():
    """The writer packs straight from random codes; llama-quantize (like pack_q2_0) must give back
    the same bytes from the weights, or packed=False models would not round-trip."""
    rng = np.random.default_rng(3)
    blocks = synthetic.random_ternary_blocks(rng, 64, 512, 64)
    blocks[0, 2:18] = 0b01010101  # an all-zero group: d must be 0, as the quantizer writes it
    blocks[0, :2] = 0
    weights = synthetic.dequantize_blocks(blocks, 512)
    np.testing.assert_array_equal(weights, dequantize_q2_0(blocks, 512))
    np.testing.assert_array_equal(synthetic.pack_q2_0(weights), blocks)
    # Ternary per group: one magnitude in each 64-weight group, both signs and zeros overall.
    for group in np.abs(weights).reshape(-1, 64):
        assert len(np.unique(group[group > 0])) <= 1
    np.testing.assert_array_equal(np.unique(np.sign(weights)), [-1, 0, 1])


def test_llama_27b_profile_is_27b_class():
    params = synthetic.PROFILES["llama-27b"].linear_params()
    assert 26e9 < params < 28e9


def test_the_llama_control_has_bonsai_2s_vocabulary_and_ternary_ends(tmp_path, header_27b):
    """The 27B comparison's control: the same 248,320 tokens to sample and the same Q2_0 token
    embeddings and output matrix as the qwen35 file, so that only the architecture differs."""
    _, q27, q27_tensors, _ = header_27b
    path = synthetic.write_model(tmp_path / "l27.gguf", "llama-27b", header_only=True)
    kv, tensors, _ = read_header(path)
    assert kv["llama.vocab_size"] == q27["qwen35.vocab_size"] == len(kv["tokenizer.ggml.tokens"])

    def ends(records):
        return {r["name"]: (r["type"], r["dims"]) for r in records
                if r["name"] in ("token_embd.weight", "output.weight")}  # fmt: skip

    assert ends(tensors) == ends(q27_tensors)


# --- qwen35: Bonsai 2 27B's hyperparameters -------------------------------------------------------

BONSAI_2_27B = {
    "general.architecture": "qwen35",
    "qwen35.block_count": 64,
    "qwen35.embedding_length": 5120,
    "qwen35.feed_forward_length": 17408,
    "qwen35.attention.head_count": 24,
    "qwen35.attention.head_count_kv": 4,
    "qwen35.attention.key_length": 256,
    "qwen35.attention.value_length": 256,
    "qwen35.full_attention_interval": 4,
    "qwen35.ssm.conv_kernel": 4,
    "qwen35.ssm.state_size": 128,
    "qwen35.ssm.group_count": 16,
    "qwen35.ssm.time_step_rank": 48,
    "qwen35.ssm.inner_size": 6144,
    "qwen35.rope.dimension_count": 64,
    "qwen35.rope.dimension_sections": [11, 11, 10, 0],
    "qwen35.rope.freq_base": 1e7,
    "qwen35.context_length": 262144,
    "qwen35.vocab_size": 248320,
}


@pytest.fixture(scope="module")
def header_27b(tmp_path_factory):
    """The 27b model's header and tensor table; its data is a hole of the right size."""
    path = tmp_path_factory.mktemp("q27") / "27b.gguf"
    synthetic.write_model(path, "27b", share_layers=True, header_only=True)
    assert path.stat().st_blocks * 512 < 64 * 2**20  # sparse: no 7 GiB written here
    return path, *read_header(path)


def test_27b_metadata_is_bonsai_2_27b(header_27b):
    _, kv, tensors, _ = header_27b
    assert {key: kv.get(key) for key in BONSAI_2_27B} == BONSAI_2_27B
    assert kv[SYNTHETIC_MARKER] is True
    assert len(kv["tokenizer.ggml.tokens"]) == 248320
    assert len(kv["tokenizer.ggml.token_type"]) == 248320
    assert kv["tokenizer.chat_template"] == synthetic.CHAT_TEMPLATE
    # 16 full-attention blocks (3, 7, ..., 63), the other 48 Gated DeltaNet.
    attention = {int(t["name"].split(".")[1]) for t in tensors if ".attn_q.weight" in t["name"]}
    delta_net = {int(t["name"].split(".")[1]) for t in tensors if ".attn_qkv." in t["name"]}
    assert attention == set(range(3, 64, 4))
    assert delta_net == set(range(64)) - attention and len(delta_net) == 48


def test_27b_has_the_real_files_size_in_parameters_and_tensors(header_27b):
    path, _, tensors, data_start = header_27b
    assert len(tensors) == 851  # the real Ternary-Bonsai-2-27B file's count
    params = sum(int(np.prod(t["dims"])) for t in tensors)
    assert params == synthetic.n_params("27b")
    assert abs(params - 26.90e9) < 0.05e9, params
    assert_layout(path, tensors, data_start)
    # ~2.25 bits per weight: every matrix Q2_0 (the real PQ2_0 file is 7.2 GB at 2.125).
    assert 7.4e9 < path.stat().st_size < 7.7e9


# --- qwen35 tiny: what the engine requires --------------------------------------------------------

TINY_GLOBAL = {
    "token_embd.weight": [256, 512],
    "output_norm.weight": [256],
    "output.weight": [256, 512],
}
# llama_model_qwen35::load_arch_tensors (vendor/llama.cpp/src/models/qwen35.cpp), in ggml order
# for the tiny profile (n_embd 256, n_ff 512, 2 heads / 1 KV head of 256, DeltaNet state 128,
# 1 key group, 3 value heads, conv kernel 4, vocab 512). Every block: norms and the FFN.
TINY_BLOCK = {
    "attn_norm.weight": [256],
    "post_attention_norm.weight": [256],
    "ffn_gate.weight": [256, 512],
    "ffn_down.weight": [512, 256],
    "ffn_up.weight": [256, 512],
}
# Full-attention blocks ((il + 1) % 4 == 0): create_tensor_qkv with no fused attn_qkv takes
# separate q/k/v, q with the output gate (n_embd_head_k * n_head * 2), then wo and q/k norms.
TINY_ATTENTION = {
    "attn_q.weight": [256, 1024],
    "attn_k.weight": [256, 256],
    "attn_v.weight": [256, 256],
    "attn_output.weight": [512, 256],
    "attn_q_norm.weight": [256],
    "attn_k_norm.weight": [256],
}
# Gated DeltaNet blocks: attn_qkv and attn_gate are TENSOR_NOT_REQUIRED at load, but build_qkvz
# multiplies by both, so a model without them cannot run.
TINY_DELTA_NET = {
    "attn_qkv.weight": [256, 640],  # key_dim * 2 + value_dim
    "attn_gate.weight": [256, 384],
    "ssm_conv1d.weight": [4, 640],
    "ssm_dt.bias": [3],
    "ssm_a": [3],
    "ssm_beta.weight": [256, 3],
    "ssm_alpha.weight": [256, 3],
    "ssm_norm.weight": [128],
    "ssm_out.weight": [384, 256],
}


def tiny_expected() -> dict[str, list[int]]:
    expected = dict(TINY_GLOBAL)
    for i in range(4):
        mixer = TINY_ATTENTION if i == 3 else TINY_DELTA_NET
        expected |= {f"blk.{i}.{name}": dims for name, dims in (TINY_BLOCK | mixer).items()}
    return expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return synthetic.write_model(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "tiny")


def test_tiny_is_qwen35_with_every_tensor_the_engine_requires(tiny):
    kv, tensors, data_start = read_header(tiny)
    assert kv["general.architecture"] == "qwen35"
    assert kv[SYNTHETIC_MARKER] is True
    assert kv["qwen35.context_length"] == 32768
    # Random weights pick padding tokens too: each must render as text (no unused/control ones).
    assert set(kv["tokenizer.ggml.token_type"][3:]) <= {1, 6}
    assert kv["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]
    assert {t["name"]: t["dims"] for t in tensors} == tiny_expected()
    assert_layout(tiny, tensors, data_start)
    # Every weight matrix ternary Q2_0 (42); the conv kernel, norms and vectors F32 (0).
    for record in tensors:
        matrix = len(record["dims"]) == 2 and "conv1d" not in record["name"]
        assert record["type"] == (42 if matrix else 0), record
        # Row lengths fill the fork's 128-weight blocks too.
        assert not matrix or record["dims"][0] % 128 == 0, record


def test_tiny_weights_are_exactly_ternary_and_gguf_py_reads_them(tiny):
    gguf = require_ternary_gguf()
    reader = gguf.GGUFReader(tiny)
    assert reader.get_field(SYNTHETIC_MARKER).contents() is True
    tokens = reader.get_field("tokenizer.ggml.tokens").contents()
    assert len(tokens) == 512 and tokens[:3] == ["<unk>", "<s>", "</s>"]
    for tensor in reader.tensors:
        if tensor.tensor_type.name == "Q2_0":
            cols = int(tensor.shape[0])
            weights = dequantize_q2_0(np.asarray(tensor.data), cols)
            assert np.isfinite(weights).all() and np.abs(weights).max() > 0, tensor.name


def test_header_only_is_the_same_file_less_its_data(tiny, tmp_path):
    hollow = synthetic.write_model(tmp_path / "hollow.gguf", "tiny", header_only=True)
    assert hollow.stat().st_size == tiny.stat().st_size
    _, _, data_start = read_header(tiny)
    assert hollow.read_bytes()[:data_start] == tiny.read_bytes()[:data_start]


def tensor_data(path: Path) -> dict[str, np.ndarray]:
    gguf = require_ternary_gguf()
    return {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}


def test_share_layers_reuses_one_delta_net_and_one_attention_layer(tmp_path):
    shared = tensor_data(synthetic.write_model(tmp_path / "s.gguf", "tiny", share_layers=True))
    distinct = tensor_data(synthetic.write_model(tmp_path / "d.gguf", "tiny"))
    for data, same in ((shared, True), (distinct, False)):
        for name in ("attn_qkv.weight", "ssm_out.weight", "ssm_conv1d.weight", "ffn_up.weight"):
            assert np.array_equal(data[f"blk.0.{name}"], data[f"blk.2.{name}"]) == same, name
    assert not np.array_equal(shared["blk.0.ffn_up.weight"], shared["blk.3.ffn_up.weight"])
    assert not np.array_equal(shared["token_embd.weight"], shared["output.weight"])


@pytest.mark.parametrize("profile", ["tiny", "llama-tiny"])
def test_unpacked_model_holds_the_same_ternary_weights(tmp_path, profile):
    """packed=False is for llama-quantize: F32 weights that pack to exactly our Q2_0 bytes."""
    packed = tensor_data(synthetic.write_model(tmp_path / "q.gguf", profile, seed=7))
    f32 = tensor_data(synthetic.write_model(tmp_path / "f.gguf", profile, seed=7, packed=False))
    assert packed.keys() == f32.keys()
    matrices = 0
    for name, data in packed.items():
        if data.dtype == np.uint8:
            matrices += 1
            np.testing.assert_array_equal(synthetic.pack_q2_0(f32[name]), data, err_msg=name)
        else:
            np.testing.assert_array_equal(f32[name], data, err_msg=name)
    assert matrices == (33 if profile == "tiny" else 14)


def test_llama_profiles_stay_llama(tmp_path):
    path = synthetic.write_model(tmp_path / "llama.gguf", "llama-tiny")
    kv, tensors, _ = read_header(path)
    assert kv["general.architecture"] == "llama"
    assert kv[SYNTHETIC_MARKER] is True
    assert len(tensors) == 3 + 9 * synthetic.PROFILES["llama-tiny"].n_layer
    types = {t["name"]: t["type"] for t in tensors}
    assert types["token_embd.weight"] == types["output.weight"] == 1  # F16, as before
    assert sum(t == 42 for t in types.values()) == 7 * synthetic.PROFILES["llama-tiny"].n_layer


def test_checkpoints_are_llama_only(tmp_path):
    with pytest.raises(ValueError, match="llama profiles"):
        synthetic.write_checkpoint(tmp_path / "ckpt", "tiny")


# --- fork-packed stand-ins ------------------------------------------------------------------------


@pytest.mark.parametrize("packing, type_id", [("PQ2_0", 142), ("PTQ1_0", 143)])
def test_fork_packed_file_carries_the_forks_type_ids(tmp_path, packing, type_id):
    path = synthetic.write_fork_packed(tmp_path / f"{packing}.gguf", packing)
    kv, tensors, data_start = read_header(path)
    assert kv["general.architecture"] == "qwen35" and kv[SYNTHETIC_MARKER] is True
    assert {t["name"]: t["dims"] for t in tensors} == tiny_expected()
    for record in tensors:
        matrix = len(record["dims"]) == 2 and "conv1d" not in record["name"]
        assert record["type"] == (type_id if matrix else 0), record
    assert_layout(path, tensors, data_start)

    gguf = require_ternary_gguf()
    with pytest.raises(ValueError, match="GGMLQuantizationType"):
        gguf.GGUFReader(path)

    # The blocks: fp16 d first (PQ2_0) or last (PTQ1_0), a plausible positive scale.
    record = next(t for t in tensors if t["name"] == "blk.0.ffn_up.weight")
    block, size = LAYOUTS[type_id]
    raw = np.fromfile(path, np.uint8, n_bytes(record), offset=data_start + record["offset"])
    blocks = raw.reshape(-1, size)
    d = (blocks[:, :2] if packing == "PQ2_0" else blocks[:, -2:]).copy().view(np.float16)
    assert (d > 0).all() and (d < 1).all()
    if packing == "PQ2_0":  # weight j = (((qs[j/4] >> 2*(j%4)) & 3) - 1) * d
        rows, cols = record["dims"][1], record["dims"][0]
        weights = dequantize_q2_0(raw.reshape(rows, -1), cols, group=block)
        assert set(np.unique(np.sign(weights))) == {-1.0, 0.0, 1.0}


def test_fork_packing_is_for_qwen35_profiles(tmp_path):
    with pytest.raises(ValueError, match="qwen35"):
        synthetic.write_fork_packed(tmp_path / "x.gguf", "PQ2_0", profile="llama-tiny")
    with pytest.raises(ValueError, match="packing must be one of"):
        synthetic.write_fork_packed(tmp_path / "x.gguf", "Q2_0")


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_writes_and_says_architecture_and_size(tmp_path, capsys):
    assert synthetic.main([str(tmp_path / "t.gguf")]) == 0
    out = capsys.readouterr().out
    assert "qwen35 (tiny), 4 layers" in out and "GiB" in out
    assert synthetic.main([str(tmp_path / "p.gguf"), "--packing", "PQ2_0", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "weight matrices PQ2_0" in out
    assert read_header(tmp_path / "p.gguf")[1][0]["type"] == 142


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint"], "--checkpoint writes llama checkpoints"),
        (["--checkpoint", "--profile", "27b"], "--profile llama-27b or llama-tiny"),
        (["--profile", "llama-tiny", "--packing", "PTQ1_0"], "--packing writes qwen35 models"),
    ],
)
def test_cli_refuses_mismatched_options(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        synthetic.main([str(tmp_path / "out"), *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
