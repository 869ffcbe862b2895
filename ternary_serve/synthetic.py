"""Synthetic ternary models: llama-architecture GGUFs whose linear weights are exactly ternary Q2_0,
and Hugging Face checkpoints of the same shapes for the conversion path.

Used by the tests (a tiny model the real llama-server loads in a second) and by the benchmarks
(27B-class shapes with the memory traffic of the real thing). Weights are random ternary values
{-s, 0, +s} per 64-weight group, so Q2_0 packs them losslessly.
"""

from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ternary_serve.weights import require_ternary_gguf

Q2_0_GROUP = 64

# ChatML: what the Qwen-family Bonsai models use; llama-server recognises it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    context_length: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def linear_params(self) -> int:
        kv = self.n_head_kv * self.head_dim
        per_layer = (
            2 * self.n_embd * self.n_embd + 2 * self.n_embd * kv + 3 * self.n_embd * self.n_ff
        )
        return per_layer * self.n_layer


PROFILES = {
    # Loads in well under a second on a CPU; big enough to exercise every code path.
    "tiny": Shape(n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, context_length=4096),
    # 26.9B ternary linear weights (7.06 GiB as Q2_0): the memory traffic of a 27B model per token.
    "27b": Shape(n_layer=64, n_embd=5120, n_ff=23296, n_head=40, n_head_kv=8, context_length=32768),
}


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


def write_model(
    path: Path,
    profile: str = "tiny",
    seed: int = 0,
    share_layers: bool = False,
    packed: bool = True,
) -> Path:
    """Write a synthetic llama GGUF; linear weights Q2_0, norms F32, embeddings and output F16.

    share_layers reuses one layer's weights for every layer: same bytes read per token, so the same
    speed, at a fraction of the generation time (for the 27B benchmark model). packed=False writes
    the same ternary weights as F32, for the engine's own llama-quantize to pack.
    """
    gguf = require_ternary_gguf()
    shape = PROFILES[profile]
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    n_vocab = len(tokens)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"ternary-serve synthetic {profile}")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q2_0 if packed else gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    def norm() -> np.ndarray:
        return np.ones(shape.n_embd, dtype=np.float32)

    def linear(rows: int, cols: int) -> np.ndarray:
        weights = ternary_matrix(rng, rows, cols)
        return pack_q2_0(weights) if packed else weights

    kv = shape.n_head_kv * shape.head_dim
    linear_type = gguf.GGMLQuantizationType.Q2_0 if packed else None
    writer.add_tensor(
        "token_embd.weight", rng.normal(0, 0.02, size=(n_vocab, shape.n_embd)).astype(np.float16)
    )
    layer = None
    for i in range(shape.n_layer):
        if layer is None or not share_layers:
            layer = {
                "attn_q": linear(shape.n_embd, shape.n_embd),
                "attn_k": linear(kv, shape.n_embd),
                "attn_v": linear(kv, shape.n_embd),
                "attn_output": linear(shape.n_embd, shape.n_embd),
                "ffn_gate": linear(shape.n_ff, shape.n_embd),
                "ffn_up": linear(shape.n_ff, shape.n_embd),
                "ffn_down": linear(shape.n_embd, shape.n_ff),
            }
        writer.add_tensor(f"blk.{i}.attn_norm.weight", norm())
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm())
        for name, tensor in layer.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", tensor, raw_dtype=linear_type)
    writer.add_tensor("output_norm.weight", norm())
    writer.add_tensor(
        "output.weight", rng.normal(0, 0.02, size=(n_vocab, shape.n_embd)).astype(np.float16)
    )

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=profile != "tiny")
    writer.close()
    return path


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
    profile: str = "tiny",
    seed: int = 0,
    n_layer: int | None = None,
    n_vocab: int | None = None,
) -> Path:
    """Write a Hugging Face Llama checkpoint (fp16 safetensors, one shard per layer, a trained
    tokenizer) whose linear weights are exactly ternary per 64-weight group.

    n_layer overrides the profile's depth (benchmarks use a few layers of the 27B shape); n_vocab
    widens the embedding and output matrices to a real vocabulary's size (the converter pads the
    token list to match). Memory stays at about one layer's weights.
    """
    from safetensors.numpy import save_file

    shape = PROFILES[profile]
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
    ap.add_argument("--profile", choices=sorted(PROFILES), default="tiny")
    ap.add_argument(
        "--checkpoint",
        action="store_true",
        help="write a Hugging Face checkpoint (safetensors + tokenizer) instead of a GGUF",
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
        write_checkpoint(args.output, args.profile, args.seed, args.layers, args.vocab)
        size = sum(p.stat().st_size for p in args.output.glob("*.safetensors"))
        print(f"wrote {args.output} ({size / 2**30:.2f} GiB of safetensors)", flush=True)
        return 0
    print(
        f"writing {args.output}: {args.profile}, {shape.linear_params() / 1e9:.2f}B ternary "
        f"linear weights as Q2_0",
        flush=True,
    )
    write_model(args.output, args.profile, args.seed, args.share_layers)
    print(f"wrote {args.output} ({args.output.stat().st_size / 2**30:.2f} GiB)", flush=True)
    return 0
