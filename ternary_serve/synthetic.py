"""Synthetic ternary models: qwen35 and llama GGUFs whose weight matrices are exactly ternary.

Also Hugging Face checkpoints of the llama shapes, for the conversion path.

Two architectures. qwen35 (profiles `tiny`, `27b`) is the one Ternary-Bonsai-2-27B has: Gated
DeltaNet layers with a full-attention layer every fourth, every weight matrix (embeddings and
output included) ternary Q2_0, like the real ~2 bpw file. llama (`llama-tiny`, `llama-27b`) is the
shape the conversion path and the first GPU numbers used; `llama-tiny`'s embeddings and output
are F16, `llama-27b` has qwen35's vocabulary and ternary ones (the control for the 27B).

Used by the tests (a tiny model the real llama-server loads in a second) and by the benchmarks
(27B shapes with the memory traffic of the real thing). Weights are random ternary values {-s, 0,
+s} per group, so Q2_0 packs them losslessly. Every file carries the SYNTHETIC_MARKER key: its
answers are noise, so the smoke test's quality gate skips it.
"""

from __future__ import annotations

import argparse
import io
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ternary_serve.weights import FORK_TYPES, SYNTHETIC_MARKER, require_ternary_gguf

Q2_0_GROUP = 64
Q2_0_BLOCK_BYTES = 2 + Q2_0_GROUP // 4

# ChatML: what the Qwen-family Bonsai models use; llama-server recognises it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The PrismML fork's private tensor types, by name: type id and block layout.
FORK_PACKINGS = {layout.name: type_id for type_id, layout in FORK_TYPES.items()}


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    context_length: int
    # None: the base vocabulary(), unpadded, embeddings and output F16. A real vocabulary's size
    # (the 27B control) pads it, and those two matrices are ternary Q2_0 like qwen35's: the
    # control then differs from Bonsai 2's shape in its architecture only, not in what sampling
    # and the output matrix cost per token.
    n_vocab: int | None = None
    architecture = "llama"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def linear_params(self) -> int:
        kv = self.n_head_kv * self.head_dim
        per_layer = (
            2 * self.n_embd * self.n_embd + 2 * self.n_embd * kv + 3 * self.n_embd * self.n_ff
        )
        return per_layer * self.n_layer


@dataclass(frozen=True)
class Qwen35Shape:
    """llama.cpp's LLM_ARCH_QWEN35 (src/models/qwen35.cpp): Gated DeltaNet ("recurrent") layers,
    with full (gated, IMROPE) attention in every full_attention_interval-th layer."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # attention.key_length = value_length
    full_attention_interval: int
    ssm_conv_kernel: int
    ssm_state_size: int  # head size of the DeltaNet keys and values
    ssm_group_count: int  # DeltaNet key heads
    ssm_time_step_rank: int  # DeltaNet value heads
    ssm_inner_size: int  # value heads * state size
    rope_dimension_count: int
    rope_sections: tuple[int, int, int, int]
    rope_freq_base: float
    context_length: int
    n_vocab: int
    architecture = "qwen35"

    def is_full_attention(self, layer: int) -> bool:
        # qwen35.cpp load_arch_hparams: recurrent unless (il + 1) % full_attention_interval == 0.
        return (layer + 1) % self.full_attention_interval == 0


# Ternary-Bonsai-2-27B's hyperparameters, every one: 26.90 B parameters, 851 tensors.
BONSAI_2_27B = Qwen35Shape(
    n_layer=64,
    n_embd=5120,
    n_ff=17408,
    n_head=24,
    n_head_kv=4,
    head_dim=256,
    full_attention_interval=4,
    ssm_conv_kernel=4,
    ssm_state_size=128,
    ssm_group_count=16,
    ssm_time_step_rank=48,
    ssm_inner_size=6144,
    rope_dimension_count=64,
    rope_sections=(11, 11, 10, 0),
    rope_freq_base=1e7,
    context_length=262144,
    n_vocab=248320,
)

PROFILES: dict[str, LlamaShape | Qwen35Shape] = {
    # Bonsai 2 at narrow widths, which llama-server loads in about a second on a CPU: 4 blocks,
    # block 3 full attention, the real head sizes (attention 256 with the real IMROPE setup,
    # DeltaNet 128) and the real 1:3 key:value head ratio; every matrix row a multiple of 128
    # weights, so the fork's 128-weight blocks fit too. The context covers the stack's default
    # per-slot context, so the engine has nothing to warn about.
    "tiny": replace(
        BONSAI_2_27B,
        n_layer=4,
        n_embd=256,
        n_ff=512,
        n_head=2,
        n_head_kv=1,
        ssm_group_count=1,
        ssm_time_step_rank=3,
        ssm_inner_size=384,
        context_length=32768,
        n_vocab=512,
    ),
    "27b": BONSAI_2_27B,
    # llama shapes: loads in well under a second on a CPU; the checkpoint conversion path.
    "llama-tiny": LlamaShape(
        n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, context_length=4096
    ),
    # 26.9B ternary linear weights (7.06 GiB as Q2_0): the memory traffic of a 27B model per token.
    "llama-27b": LlamaShape(
        n_layer=64,
        n_embd=5120,
        n_ff=23296,
        n_head=40,
        n_head_kv=8,
        context_length=32768,
        n_vocab=BONSAI_2_27B.n_vocab,
    ),
}
LLAMA_PROFILES = sorted(name for name, shape in PROFILES.items() if isinstance(shape, LlamaShape))


@dataclass(frozen=True)
class Planned:
    """One tensor the writer writes. shape is numpy order (rows, row length); fill says what it
    holds: "ternary" (a weight matrix), "embedding" (F16 normal), "ones", "conv", "ssm_a",
    "dt_bias". With share_layers, tensors of the same `shared` key hold the same data."""

    name: str
    shape: tuple[int, ...]
    fill: str
    shared: str | None = None

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


def tensor_plan(shape: LlamaShape | Qwen35Shape, n_vocab: int) -> list[Planned]:
    """Every tensor of the model, in file order."""
    if isinstance(shape, LlamaShape):
        return llama_plan(shape, n_vocab)
    return qwen35_plan(shape, n_vocab)


def llama_plan(shape: LlamaShape, n_vocab: int) -> list[Planned]:
    e, kv = shape.n_embd, shape.n_head_kv * shape.head_dim
    vocab_fill = "ternary" if shape.n_vocab else "embedding"
    plan = [Planned("token_embd.weight", (n_vocab, e), vocab_fill)]
    linear = {
        "attn_q": (e, e),
        "attn_k": (kv, e),
        "attn_v": (kv, e),
        "attn_output": (e, e),
        "ffn_gate": (shape.n_ff, e),
        "ffn_up": (shape.n_ff, e),
        "ffn_down": (e, shape.n_ff),
    }
    for i in range(shape.n_layer):
        plan += [
            Planned(f"blk.{i}.attn_norm.weight", (e,), "ones"),
            Planned(f"blk.{i}.ffn_norm.weight", (e,), "ones"),
        ]
        plan += [Planned(f"blk.{i}.{n}.weight", s, "ternary", n) for n, s in linear.items()]
    plan += [
        Planned("output_norm.weight", (e,), "ones"),
        Planned("output.weight", (n_vocab, e), vocab_fill),
    ]
    return plan


def qwen35_plan(shape: Qwen35Shape, n_vocab: int) -> list[Planned]:
    """The tensors llama_model_qwen35::load_arch_tensors creates (vendor/llama.cpp/src/models/
    qwen35.cpp), shapes transposed to numpy order. Attention layers use separate q/k/v (what
    create_tensor_qkv takes when there is no fused attn_qkv), q carrying the output gate (2x
    rows); DeltaNet layers the fused attn_qkv and attn_gate (z) the graph reads. With no MTP
    block this is the required set, and it gives the real file's count: 3 + 16 * 11 + 48 * 14 =
    851 tensors for 27b."""
    e, hd = shape.n_embd, shape.head_dim
    key_dim = shape.ssm_state_size * shape.ssm_group_count
    value_dim = shape.ssm_state_size * shape.ssm_time_step_rank
    if value_dim != shape.ssm_inner_size:
        raise ValueError(f"ssm inner_size {shape.ssm_inner_size} != state_size * time_step_rank")
    conv_dim = 2 * key_dim + value_dim
    v_heads = shape.ssm_time_step_rank
    attention = {
        "attn_q.weight": ((2 * shape.n_head * hd, e), "ternary"),
        "attn_k.weight": ((shape.n_head_kv * hd, e), "ternary"),
        "attn_v.weight": ((shape.n_head_kv * hd, e), "ternary"),
        "attn_output.weight": ((e, shape.n_head * hd), "ternary"),
        "attn_q_norm.weight": ((hd,), "ones"),
        "attn_k_norm.weight": ((hd,), "ones"),
    }
    delta_net = {
        "attn_qkv.weight": ((conv_dim, e), "ternary"),
        "attn_gate.weight": ((value_dim, e), "ternary"),
        "ssm_conv1d.weight": ((conv_dim, shape.ssm_conv_kernel), "conv"),
        "ssm_dt.bias": ((v_heads,), "dt_bias"),
        "ssm_a": ((v_heads,), "ssm_a"),
        "ssm_beta.weight": ((v_heads, e), "ternary"),
        "ssm_alpha.weight": ((v_heads, e), "ternary"),
        "ssm_norm.weight": ((shape.ssm_state_size,), "ones"),
        "ssm_out.weight": ((e, value_dim), "ternary"),
    }
    ffn = {
        "ffn_gate.weight": ((shape.n_ff, e), "ternary"),
        "ffn_down.weight": ((e, shape.n_ff), "ternary"),
        "ffn_up.weight": ((shape.n_ff, e), "ternary"),
    }
    plan = [
        Planned("token_embd.weight", (n_vocab, e), "ternary"),
        Planned("output_norm.weight", (e,), "ones"),
        Planned("output.weight", (n_vocab, e), "ternary"),
    ]
    for i in range(shape.n_layer):
        kind = "attention" if shape.is_full_attention(i) else "delta_net"
        mixer = attention if kind == "attention" else delta_net
        layer = {
            "attn_norm.weight": ((e,), "ones"),
            "post_attention_norm.weight": ((e,), "ones"),
            **mixer,
            **ffn,
        }
        plan += [
            Planned(f"blk.{i}.{name}", dims, fill, f"{kind}.{name}")
            for name, (dims, fill) in layer.items()
        ]
    return plan


def n_params(profile: str) -> int:
    """All the model's weights, from the tensor shapes the writer writes."""
    shape = PROFILES[profile]
    return sum(t.n_elements for t in tensor_plan(shape, vocab_size(shape)))


# --- packing --------------------------------------------------------------------------------------


def pack_q2_0(weights: np.ndarray) -> np.ndarray:
    """Pack a float matrix whose 64-weight groups are ternary ({-s, 0, +s}) into Q2_0 blocks.

    Same encoding as ggml's quantize_row_q2_0_ref: d = max|w| of the group as fp16, code = w/d + 1
    in 2 bits, four codes per byte, lowest bits first. Returns uint8 of shape (rows, blocks * 18).
    """
    rows, cols = weights.shape
    if cols % Q2_0_GROUP:
        raise ValueError(f"Q2_0 needs rows of a multiple of {Q2_0_GROUP} weights, got {cols}")
    groups = weights.reshape(rows, cols // Q2_0_GROUP, Q2_0_GROUP).astype(np.float32)
    scale = np.abs(groups).max(axis=-1)
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    codes = (np.clip(np.rint(groups / safe), -1, 1) + 1).astype(np.uint8)
    codes = codes.reshape(rows, cols // Q2_0_GROUP, Q2_0_GROUP // 4, 4)
    packed = codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)
    d = scale.astype(np.float16).view(np.uint8).reshape(rows, cols // Q2_0_GROUP, 2)
    return np.concatenate([d, packed], axis=-1).reshape(rows, -1)


def ternary_matrix(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Random ternary weights, one fp16-exact scale per 64-weight group, ~1/sqrt(cols) in size."""
    codes = rng.integers(-1, 2, size=(rows, cols // Q2_0_GROUP, Q2_0_GROUP), dtype=np.int8)
    base = 1.0 / np.sqrt(cols)
    scales = (base * rng.uniform(0.5, 1.5, size=(rows, cols // Q2_0_GROUP, 1))).astype(np.float16)
    return (codes * scales.astype(np.float32)).reshape(rows, cols)


# Byte n of four 2-bit codes c0..c3 (lowest bits first) for each base-3 number 0..80 = c0 + 3 c1 +
# 9 c2 + 27 c3: drawing one number per byte gives four uniform ternary codes, none of them 3.
_FOUR_CODES = np.array(
    [sum(((n // 3**k) % 3) << (2 * k) for k in range(4)) for n in range(81)], dtype=np.uint8
)
_ALL_ZERO_DIGIT = 1 + 3 + 9 + 27  # four codes of 1 (weight 0)


def random_ternary_blocks(rng: np.random.Generator, rows: int, cols: int, group: int) -> np.ndarray:
    """Random ternary weights packed straight into blocks of fp16 d then `group`/4 bytes of 2-bit
    codes (code - 1 = the weight's sign): Q2_0 with group 64, the fork's PQ2_0 with group 128.

    The same bytes as pack_q2_0 of the weights they hold (d = max|w|, 0 for an all-zero group), at
    one random draw per four weights. Scales are ~1/sqrt(cols). Returns uint8 (rows, bytes/row).
    """
    if cols % group:
        raise ValueError(f"rows of {cols} weights are not whole {group}-weight groups")
    groups = cols // group
    digits = rng.integers(0, 81, size=(rows, groups, group // 4), dtype=np.uint8)
    base = 1.0 / np.sqrt(cols)
    scales = (base * rng.uniform(0.5, 1.5, size=(rows, groups))).astype(np.float16)
    scales[(digits == _ALL_ZERO_DIGIT).all(axis=-1)] = 0
    d = scales.view(np.uint8).reshape(rows, groups, 2)
    return np.concatenate([d, _FOUR_CODES[digits]], axis=-1).reshape(rows, -1)


def dequantize_blocks(packed: np.ndarray, cols: int, group: int = Q2_0_GROUP) -> np.ndarray:
    """The weights random_ternary_blocks packed, as float32 (rows, cols)."""
    rows = packed.shape[0]
    blocks = packed.reshape(rows, cols // group, 2 + group // 4)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    codes = np.stack([(blocks[..., 2:] >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)
    return ((codes.reshape(rows, cols // group, group).astype(np.float32) - 1) * d).reshape(
        rows, cols
    )


def random_ptq1_0_blocks(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Stand-in PTQ1_0 blocks (FORK_TYPES[143]: 128 weights in qs[24] + qh[2] of base-3 digits,
    then fp16 d): qs bytes hold values below 3^5, qh bytes below 3^4, d is a plausible scale.
    Right in size and in where d lies, which is all the stack checks; the trits are not claimed
    to follow the fork's exact encoding, and nothing here dequantizes them."""
    layout = FORK_TYPES[FORK_PACKINGS["PTQ1_0"]]
    if cols % layout.block_size:
        raise ValueError(f"rows of {cols} weights are not whole {layout.block_size}-weight blocks")
    blocks = cols // layout.block_size
    qs = rng.integers(0, 3**5, size=(rows, blocks, 24), dtype=np.uint8)
    qh = rng.integers(0, 3**4, size=(rows, blocks, 2), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.5, size=(rows, blocks)) / np.sqrt(cols)).astype(np.float16)
    out = np.concatenate([qs, qh, d.view(np.uint8).reshape(rows, blocks, 2)], axis=-1)
    assert out.shape[-1] == layout.type_size
    return out.reshape(rows, -1)


# --- tokenizer ------------------------------------------------------------------------------------


def vocabulary() -> tuple[list[str], list[int]]:
    """A SentencePiece-style vocabulary: specials, 256 byte tokens, printable ASCII and '▁'.

    Any UTF-8 text (Chinese included) tokenizes, falling back to byte tokens.
    """
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens = ["<unk>", "<s>", "</s>"]
    types = [unknown, control, control]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    pieces = ["\u2581"] + [chr(c) for c in range(0x21, 0x7F)]
    tokens += pieces
    types += [normal] * len(pieces)
    return tokens, types


def vocab_size(shape: LlamaShape | Qwen35Shape) -> int:
    return shape.n_vocab or len(vocabulary()[0])


def padded_vocabulary(n_vocab: int) -> tuple[list[str], list[int]]:
    """vocabulary() padded to n_vocab entries (a real model's vocab size) with normal word tokens:
    random weights pick mostly padding, and unused or control tokens would render as nothing."""
    tokens, types = vocabulary()
    if n_vocab < len(tokens):
        raise ValueError(f"a vocabulary of {n_vocab} is smaller than the {len(tokens)} base tokens")
    normal = 1
    pad = n_vocab - len(tokens)
    return tokens + [f"\u2581w{i}" for i in range(pad)], types + [normal] * pad


# --- GGUF writer ----------------------------------------------------------------------------------


def write_model(
    path: Path,
    profile: str = "tiny",
    seed: int = 0,
    share_layers: bool = False,
    packed: bool = True,
    *,
    header_only: bool = False,
) -> Path:
    """Write a synthetic GGUF of `profile`: weight matrices ternary Q2_0 (llama profiles: F16
    embeddings and output), norms and the DeltaNet's small tensors F32.

    share_layers reuses one layer's weights (qwen35: one DeltaNet layer's and one attention
    layer's) in every layer: same bytes read per token, so the same speed, at a fraction of the
    generation time (for the 27B benchmark model). packed=False writes the same ternary weights as
    F32, for the engine's own llama-quantize to pack. header_only writes the header and tensor
    table and leaves the data a hole of its exact size (a sparse file): the metadata of a 27B model
    without generating 7 GiB.
    """
    return _write(path, profile, seed, share_layers, "Q2_0" if packed else "F32", header_only)


def write_fork_packed(
    path: Path,
    packing: str,
    seed: int = 0,
    *,
    profile: str = "tiny",
    share_layers: bool = False,
    header_only: bool = False,
) -> Path:
    """A stand-in for a PrismML-fork file: the qwen35 `profile` (default tiny) with every weight
    matrix typed PQ2_0 (type id 142) or PTQ1_0 (143), block layouts as in weights.FORK_TYPES.

    PQ2_0 is packed for real from random ternary weights (fp16 d, then 2-bit codes of 128
    weights); PTQ1_0 blocks are only right in size with d last (random_ptq1_0_blocks), since
    nothing here dequantizes them. No gguf-py knows these type ids: each such tensor is written as
    raw I8 bytes (rows x bytes per row), then its tensor-info record is patched in place to the
    fork's type id and row length in weights (fixed-width fields: no offset moves). Mainline
    gguf-py's GGUFReader refuses the result with a ValueError about GGMLQuantizationType;
    general.file_type is left out (the fork's file type number is not known here).
    """
    if packing not in FORK_PACKINGS:
        raise ValueError(f"packing must be one of {sorted(FORK_PACKINGS)}, got {packing!r}")
    if not isinstance(PROFILES[profile], Qwen35Shape):
        raise ValueError(f"fork packing is for the qwen35 profiles, not {profile}")
    return _write(path, profile, seed, share_layers, packing, header_only)


def _encoding(gguf, tensor: Planned, fmt: str):
    """(byte shape, numpy dtype, bytes, raw ggml type or None) of a planned tensor in fmt."""
    if tensor.fill == "embedding":
        return tensor.shape, np.float16, 2 * tensor.n_elements, None
    if tensor.fill != "ternary" or fmt == "F32":
        return tensor.shape, np.float32, 4 * tensor.n_elements, None
    rows, cols = tensor.shape
    if fmt == "Q2_0":
        row_bytes = cols // Q2_0_GROUP * Q2_0_BLOCK_BYTES
        return (rows, row_bytes), np.uint8, rows * row_bytes, gguf.GGMLQuantizationType.Q2_0
    layout = FORK_TYPES[FORK_PACKINGS[fmt]]
    if cols % layout.block_size:
        raise ValueError(f"{tensor.name}: rows of {cols} weights do not fill {fmt} blocks")
    row_bytes = cols // layout.block_size * layout.type_size
    return (rows, row_bytes), np.uint8, rows * row_bytes, gguf.GGMLQuantizationType.I8


def _generate(tensor: Planned, fmt: str, rng: np.random.Generator) -> np.ndarray:
    shape = tensor.shape
    if tensor.fill == "ones":
        return np.ones(shape, dtype=np.float32)
    if tensor.fill == "dt_bias":
        return np.ones(shape, dtype=np.float32)
    if tensor.fill == "ssm_a":  # -exp(A_log), A_log ~ log U(1, 16) as at initialisation
        return -rng.uniform(1.0, 16.0, size=shape).astype(np.float32)
    if tensor.fill == "conv":
        return rng.normal(0, 1 / np.sqrt(shape[-1]), size=shape).astype(np.float32)
    if tensor.fill == "embedding":
        return rng.normal(0, 0.02, size=shape).astype(np.float16)
    rows, cols = shape
    if fmt == "PTQ1_0":
        return random_ptq1_0_blocks(rng, rows, cols)
    if fmt == "PQ2_0":
        return random_ternary_blocks(rng, rows, cols, FORK_TYPES[FORK_PACKINGS[fmt]].block_size)
    blocks = random_ternary_blocks(rng, rows, cols, Q2_0_GROUP)
    return blocks if fmt == "Q2_0" else dequantize_blocks(blocks, cols)


def _add_metadata(writer, gguf, shape: LlamaShape | Qwen35Shape, profile: str, fmt: str) -> None:
    n_vocab = vocab_size(shape)
    writer.add_name(f"ternary-serve synthetic {profile}")
    writer.add_bool(SYNTHETIC_MARKER, True)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    if isinstance(shape, LlamaShape):
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_layer_norm_rms_eps(1e-5)
    else:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_dimension_count(shape.rope_dimension_count)
        writer.add_rope_dimension_sections(list(shape.rope_sections))
        writer.add_rope_freq_base(shape.rope_freq_base)
        writer.add_full_attention_interval(shape.full_attention_interval)
        writer.add_ssm_conv_kernel(shape.ssm_conv_kernel)
        writer.add_ssm_state_size(shape.ssm_state_size)
        writer.add_ssm_group_count(shape.ssm_group_count)
        writer.add_ssm_time_step_rank(shape.ssm_time_step_rank)
        writer.add_ssm_inner_size(shape.ssm_inner_size)
    writer.add_vocab_size(n_vocab)
    if fmt in ("Q2_0", "F32"):
        ftype = gguf.LlamaFileType
        writer.add_file_type(ftype.MOSTLY_Q2_0 if fmt == "Q2_0" else ftype.ALL_F32)
    tokens, types = padded_vocabulary(n_vocab)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def _write(
    path: Path, profile: str, seed: int, share_layers: bool, fmt: str, header_only: bool
) -> Path:
    """Write the model as a stream: the tensor table first, then each tensor as it is generated,
    so memory stays at about one tensor whatever the model's size."""
    gguf = require_ternary_gguf()
    shape = PROFILES[profile]
    plan = tensor_plan(shape, vocab_size(shape))
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(path), shape.architecture)
    _add_metadata(writer, gguf, shape, profile, fmt)
    encodings = [_encoding(gguf, tensor, fmt) for tensor in plan]
    for tensor, (byte_shape, dtype, nbytes, raw) in zip(plan, encodings, strict=True):
        writer.add_tensor_info(tensor.name, byte_shape, np.dtype(dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if header_only:
        fout = writer.fout[0]
        pad = writer.ggml_pad
        size = pad(fout.tell(), writer.data_alignment)
        size += sum(pad(nbytes, writer.data_alignment) for _, _, nbytes, _ in encodings)
        fout.truncate(size)
    else:
        shared: dict[str, np.ndarray] = {}
        bar = None
        if shape.n_layer > 8:
            from tqdm import tqdm

            total = sum(nbytes for _, _, nbytes, _ in encodings)
            bar = tqdm(desc="Writing", total=total, unit="byte", unit_scale=True)
        for tensor in plan:
            key = tensor.shared if share_layers else None
            data = shared.get(key) if key else None
            if data is None:
                data = _generate(tensor, fmt, rng)
                if key:
                    shared[key] = data
            writer.write_tensor_data(data)
            if bar is not None:
                bar.update(data.nbytes)
        if bar is not None:
            bar.close()
    writer.close()
    if fmt in FORK_PACKINGS:
        _retype(path, {t.name for t in plan if t.fill == "ternary"}, FORK_PACKINGS[fmt])
    return path


def _retype(path: Path, names: set[str], type_id: int) -> None:
    """Turn the I8 byte matrices `names` into the fork's type_id in the file's tensor table:
    type (uint32) and first dimension (uint64, bytes per row -> weights per row), in place."""
    gguf = require_ternary_gguf()
    layout = FORK_TYPES[type_id]
    reader = gguf.GGUFReader(path, "r+")
    for tensor in reader.tensors:
        if tensor.name not in names:
            continue
        _, _, _, dims, ggml_type, _ = tensor.field.parts
        assert ggml_type[0] == gguf.GGMLQuantizationType.I8, tensor.name
        row_bytes = int(dims[0])
        assert row_bytes % layout.type_size == 0, tensor.name
        dims[0] = row_bytes // layout.type_size * layout.block_size
        ggml_type[0] = type_id
    reader.data.flush()
    del reader


# --- Hugging Face checkpoints (llama) -------------------------------------------------------------

# Text for training the checkpoint's tokenizer: any deterministic English will do.
TOKENIZER_TEXT = (
    "the model serves ternary weights on a graphics card and answers every request quickly "
    "while the operator reads the logs checks the health endpoint and rolls back a bad release"
)


def train_tokenizer(directory: Path, seed: int) -> int:
    """A byte-fallback BPE SentencePiece tokenizer (tokenizer.model); returns its vocab size."""
    import sentencepiece as spm

    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(TOKENIZER_TEXT.split(), size=12)) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        model_type="bpe",
        vocab_size=384,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return spm.SentencePieceProcessor(model_proto=model.getvalue()).get_piece_size()


def write_checkpoint(
    directory: Path,
    profile: str = "llama-tiny",
    seed: int = 0,
    n_layer: int | None = None,
    n_vocab: int | None = None,
) -> Path:
    """Write a Hugging Face Llama checkpoint (fp16 safetensors, one shard per layer, a trained
    tokenizer) of a llama profile, whose linear weights are exactly ternary per 64-weight group.

    n_layer overrides the profile's depth (benchmarks use a few layers of the 27B shape); n_vocab
    widens the embedding and output matrices to a real vocabulary's size (the converter pads the
    token list to match). Memory stays at about one layer's weights.
    """
    from safetensors.numpy import save_file

    shape = PROFILES[profile]
    if not isinstance(shape, LlamaShape):
        raise ValueError(
            f"checkpoints are written for the llama profiles ({', '.join(LLAMA_PROFILES)}), "
            f"not {profile} ({shape.architecture})"
        )
    layers = n_layer or shape.n_layer
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    n_vocab = max(train_tokenizer(directory, seed), n_vocab or 0)
    kv = shape.n_head_kv * shape.head_dim
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.n_embd,
        "intermediate_size": shape.n_ff,
        "num_hidden_layers": layers,
        "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_head_kv,
        "vocab_size": n_vocab,
        "max_position_embeddings": shape.context_length,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "chat_template": CHAT_TEMPLATE}) + "\n"
    )

    def f16(array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array.astype(np.float16))

    def ternary(rows: int, cols: int) -> np.ndarray:
        return f16(ternary_matrix(rng, rows, cols))

    shards = layers + 2
    weight_map: dict[str, str] = {}

    def save(index: int, tensors: dict[str, np.ndarray]) -> None:
        name = f"model-{index:05d}-of-{shards:05d}.safetensors"
        save_file(tensors, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    save(1, {"model.embed_tokens.weight": f16(rng.normal(0, 0.02, size=(n_vocab, shape.n_embd)))})
    for i in range(layers):
        prefix = f"model.layers.{i}"
        save(
            i + 2,
            {
                f"{prefix}.input_layernorm.weight": f16(np.ones(shape.n_embd)),
                f"{prefix}.post_attention_layernorm.weight": f16(np.ones(shape.n_embd)),
                f"{prefix}.self_attn.q_proj.weight": ternary(shape.n_embd, shape.n_embd),
                f"{prefix}.self_attn.k_proj.weight": ternary(kv, shape.n_embd),
                f"{prefix}.self_attn.v_proj.weight": ternary(kv, shape.n_embd),
                f"{prefix}.self_attn.o_proj.weight": ternary(shape.n_embd, shape.n_embd),
                f"{prefix}.mlp.gate_proj.weight": ternary(shape.n_ff, shape.n_embd),
                f"{prefix}.mlp.up_proj.weight": ternary(shape.n_ff, shape.n_embd),
                f"{prefix}.mlp.down_proj.weight": ternary(shape.n_embd, shape.n_ff),
            },
        )
    save(
        shards,
        {
            "model.norm.weight": f16(np.ones(shape.n_embd)),
            "lm_head.weight": f16(rng.normal(0, 0.02, size=(n_vocab, shape.n_embd))),
        },
    )
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return directory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve synth", description=__doc__.splitlines()[0])
    ap.add_argument("output", type=Path, help="a .gguf file, or a directory with --checkpoint")
    ap.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default="tiny",
        help="tiny, 27b: qwen35 (Bonsai 2's architecture); llama-tiny, llama-27b: llama",
    )
    ap.add_argument(
        "--packing",
        choices=sorted(FORK_PACKINGS),
        help="type the weight matrices with the PrismML fork's private type (a qwen35 stand-in "
        "that only the fork loads) instead of Q2_0",
    )
    ap.add_argument(
        "--checkpoint",
        action="store_true",
        help="write a Hugging Face checkpoint (safetensors + tokenizer) instead of a GGUF "
        "(llama profiles only)",
    )
    ap.add_argument("--layers", type=int, help="with --checkpoint: override the profile's depth")
    ap.add_argument("--vocab", type=int, help="with --checkpoint: embedding rows (e.g. 151936)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--share-layers",
        action="store_true",
        help="reuse one layer's weights in every layer (fast to generate, same speed)",
    )
    args = ap.parse_args(argv)
    shape = PROFILES[args.profile]
    if args.checkpoint:
        if not isinstance(shape, LlamaShape):
            ap.error(
                f"--checkpoint writes llama checkpoints: use --profile "
                f"{' or '.join(LLAMA_PROFILES)} ({args.profile} is {shape.architecture})"
            )
        if args.packing:
            ap.error("--packing is for GGUFs, not --checkpoint")
        write_checkpoint(args.output, args.profile, args.seed, args.layers, args.vocab)
        size = sum(p.stat().st_size for p in args.output.glob("*.safetensors"))
        print(f"wrote {args.output} ({size / 2**30:.2f} GiB of safetensors)", flush=True)
        return 0
    if args.packing and not isinstance(shape, Qwen35Shape):
        ap.error(f"--packing writes qwen35 models: not with --profile {args.profile}")
    packing = args.packing or "Q2_0"
    params = n_params(args.profile)
    count = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
    print(
        f"writing {args.output}: {shape.architecture} ({args.profile}), {shape.n_layer} layers, "
        f"{count} parameters, weight matrices {packing}",
        flush=True,
    )
    if args.packing:
        write_fork_packed(
            args.output,
            args.packing,
            args.seed,
            profile=args.profile,
            share_layers=args.share_layers,
        )
    else:
        write_model(args.output, args.profile, args.seed, args.share_layers)
    size = args.output.stat().st_size
    print(
        f"wrote {args.output}: {shape.architecture} {args.profile}, "
        f"{size / 2**30:.2f} GiB ({size} bytes)",
        flush=True,
    )
    return 0
