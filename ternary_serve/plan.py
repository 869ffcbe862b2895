"""Plan GPU memory: slots x context x KV cache type for a model on a card, from the GGUF header.

    weights     the tensors the GPU holds (token embeddings stay in host memory, as the engine
                keeps them)
    KV cache    per token: for every attention layer, KV heads x (key + value length) elements
                of the KV type (f16 2 bytes, q8_0 34/32, q4_0 18/32); x context x slots
    recurrent   per slot: for every recurrent layer (Gated DeltaNet, Mamba), the convolution and
                SSM state in f32, (d_conv - 1)(d_inner + 2 groups d_state) + d_state d_inner
    compute     the engine's graph buffers for one micro-batch (logits dominate for a 248k vocab)
    runtime     the CUDA context and libraries' workspace
    headroom    kept free: max(512 MiB, 5% of the card)

Slots: as many as fit (up to MAX_SLOTS) with f16 first, q8_0 when f16 cannot give the asked
context. A setting that cannot fit is refused before anything changes, naming what would fit.
`ternary-serve plan MODEL.gguf [--vram-mib N] [NAME=value ...]` prints the table for the configured
settings (.env's, under the ones given); config renders the server flags from the same plan.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ternary_serve import errors, gpu, weights
from ternary_serve.files import write_json
from ternary_serve.versions import ENV_FILE

MIB = 2**20
MAX_SLOTS = 16  # aggregate decode keeps rising to 16 streams on an H200 (docs/bench.md)
DEFAULT_CONTEXT = 8192
CTX_PAD = 256  # the engine rounds the context up to a multiple of this
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
CUDA_RUNTIME_MIB = 512
COMPUTE_FIXED_MIB = 16
HEADROOM_MIN_MIB = 512
HEADROOM_SHARE = 0.05
RECURRENT_ARCHS = ("qwen35", "qwen35moe", "qwen3next")


class PlanError(errors.ServeError):
    """A plan that cannot fit or cannot be made; the message names what would fit."""


@dataclass(frozen=True)
class Shape:
    """What the memory plan needs from a model, read from its GGUF header."""

    name: str
    architecture: str
    n_layer: int
    attention_layers: int
    recurrent_layers: int
    kv_elements_per_token: int  # over all attention layers, key + value
    recurrent_bytes_per_slot: int
    weight_bytes: int  # on the GPU
    host_weight_bytes: int  # token embeddings, kept in host memory
    n_ctx_train: int
    n_vocab: int
    n_embd: int
    n_ff: int

    @classmethod
    def from_gguf(cls, path: Path) -> Shape:
        gguf = weights.require_ternary_gguf()
        try:
            reader = weights.engine_reader(gguf, weights.FORK_TYPES)(path)
        except (OSError, ValueError, IndexError) as exc:
            raise PlanError(
                f"{path} is truncated or corrupt ({exc}): fetch the model again, or check "
                "MODEL_FILE"
            ) from None

        def field(key: str, default=None):
            found = reader.get_field(key)
            if found is None:
                if default is None:
                    raise PlanError(f"{path} has no {key}: not a model GGUF the plan can read")
                return default
            return found.contents()

        arch = field("general.architecture")
        n_layer = int(field(f"{arch}.block_count"))
        n_head = field(f"{arch}.attention.head_count")
        n_head_kv = field(f"{arch}.attention.head_count_kv", n_head)
        per_layer_kv = n_head_kv if isinstance(n_head_kv, list) else [n_head_kv] * n_layer
        n_embd = int(field(f"{arch}.embedding_length"))
        head = n_embd // int(n_head if not isinstance(n_head, list) else max(n_head))
        k_len = int(field(f"{arch}.attention.key_length", head))
        v_len = int(field(f"{arch}.attention.value_length", head))
        recurrent = [False] * n_layer
        state = 0
        if arch in RECURRENT_ARCHS:
            # As the engine reads it: an explicit per-layer list, else every interval-th layer
            # is attention (qwen35.cpp load_arch_hparams).
            listed = reader.get_field(f"{arch}.attention.recurrent_layers")
            if listed is not None:
                recurrent = [bool(v) for v in listed.contents()][:n_layer]
            else:
                interval = int(field(f"{arch}.full_attention_interval", 4))
                recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
            d_conv = int(field(f"{arch}.ssm.conv_kernel"))
            d_inner = int(field(f"{arch}.ssm.inner_size"))
            d_state = int(field(f"{arch}.ssm.state_size"))
            groups = int(field(f"{arch}.ssm.group_count"))
            # llama_hparams::n_embd_r() + n_embd_s(), f32 each
            state = 4 * ((d_conv - 1) * (d_inner + 2 * groups * d_state) + d_state * d_inner)
        table = weights.tensor_table(reader)
        by_name = {t.name: t.n_bytes for t in table}
        embeddings = by_name.get("token_embd.weight", 0)
        # Without an output matrix the engine puts a copy of the embeddings on the GPU.
        host = embeddings if "output.weight" in by_name else 0
        return cls(
            name=path.name,
            architecture=arch,
            n_layer=n_layer,
            attention_layers=recurrent.count(False),
            recurrent_layers=recurrent.count(True),
            kv_elements_per_token=sum(
                int(per_layer_kv[il]) * (k_len + v_len)
                for il in range(n_layer)
                if not recurrent[il]
            ),
            recurrent_bytes_per_slot=state * recurrent.count(True),
            weight_bytes=sum(by_name.values()) - host,
            host_weight_bytes=host,
            n_ctx_train=int(field(f"{arch}.context_length")),
            n_vocab=len(field("tokenizer.ggml.tokens")),
            n_embd=n_embd,
            n_ff=int(field(f"{arch}.feed_forward_length")),
        )

    def kv_bytes_per_token(self, kv_type: str) -> float:
        return self.kv_elements_per_token * KV_BYTES[kv_type]

    def compute_mib(self, ubatch: int, context: int) -> int:
        """The engine's graph buffers for one micro-batch, as llama.cpp sizes them (docs/plan.md):
        the feed-forward activations (4 x n_ff f32 per token), the attention mask over a slot's
        context, and a fixed part."""
        return math.ceil(ubatch * (16 * self.n_ff + 4 * context) / MIB) + COMPUTE_FIXED_MIB

    def compute_per_slot_mib(self) -> float:
        """Recurrent models' graphs also grow with the sequences in a batch: about 4/3 of one
        layer's state each (measured: 140 MiB at 4 slots, 190 at 16 for the 27B)."""
        if not self.recurrent_layers:
            return 0.0
        return self.recurrent_bytes_per_slot / self.recurrent_layers * 4 / 3 / MIB


@dataclass(frozen=True)
class Plan:
    model: str
    architecture: str
    memory: str  # where the memory figure came from
    memory_mib: int
    slots: int
    context: int  # tokens per slot
    ctx_total: int
    kv_type: str
    kv_unified: str
    ubatch: int
    weights_mib: int
    host_weights_mib: int  # token embeddings, in host memory
    kv_mib: int
    recurrent_mib: int
    compute_mib: int
    runtime_mib: int
    headroom_mib: int

    @property
    def used_mib(self) -> int:
        return (
            self.weights_mib + self.kv_mib + self.recurrent_mib + self.compute_mib
            + self.runtime_mib
        )  # fmt: skip

    def as_dict(self) -> dict:
        return {**asdict(self), "used_mib": self.used_mib}

    def table(self) -> str:
        rows = [
            ("weights", self.weights_mib),
            (f"KV cache ({self.kv_type}, {self.slots} x {self.context} tokens)", self.kv_mib),
            (f"recurrent state ({self.slots} slots)", self.recurrent_mib),
            (f"compute buffers (ubatch {self.ubatch})", self.compute_mib),
            ("CUDA runtime" if self.runtime_mib else "runtime", self.runtime_mib),
            ("planned use", self.used_mib),
            ("kept free (headroom)", self.headroom_mib),
            ("unplanned", self.memory_mib - self.used_mib - self.headroom_mib),
            (f"memory ({self.memory})", self.memory_mib),
        ]
        width = max(len(label) for label, _ in rows)
        lines = [f"plan for {self.model} ({self.architecture}):"]
        lines += [f"  {label:<{width}}  {mib:>8,} MiB" for label, mib in rows]
        lines.append(
            f"  -> {self.slots} slot{'s' if self.slots > 1 else ''} x {self.context} tokens, "
            f"KV cache {self.kv_type}, "
            f"-c {self.ctx_total} -np {self.slots} -ctk/-ctv {self.kv_type} "
            f"--kv-unified {self.kv_unified}"
        )
        return "\n".join(lines)


def headroom_mib(memory_mib: int) -> int:
    return max(HEADROOM_MIN_MIB, math.ceil(memory_mib * HEADROOM_SHARE))


def padded(tokens: int) -> int:
    return -(-tokens // CTX_PAD) * CTX_PAD


def make(
    shape: Shape,
    memory_mib: int,
    memory: str,
    backend: str = "cuda",
    context: int | None = None,
    slots: int | None = None,
    kv_type: str | None = None,
    kv_unified: str = "off",
    ubatch: int = 512,
) -> Plan:
    """Choose slots x context x KV type for shape in memory_mib; None means choose."""
    if context is None:
        context = min(DEFAULT_CONTEXT, shape.n_ctx_train)
    if context > shape.n_ctx_train:
        raise PlanError(
            f"CONTEXT={context} is more than the {shape.n_ctx_train} tokens {shape.name} was "
            f"trained for: set CONTEXT={shape.n_ctx_train} or less"
        )
    runtime = CUDA_RUNTIME_MIB if backend == "cuda" else 0
    fixed = {
        "weights_mib": math.ceil(shape.weight_bytes / MIB),
        "compute_mib": shape.compute_mib(ubatch, padded(context)),
        "runtime_mib": runtime,
        "headroom_mib": headroom_mib(memory_mib),
    }
    available = memory_mib - sum(fixed.values())
    if available <= 0:
        raise PlanError(
            f"{shape.name} needs {memory_mib - available:,} MiB before any context "
            f"(weights {fixed['weights_mib']:,}, compute {fixed['compute_mib']:,}, runtime and "
            f"headroom {runtime + fixed['headroom_mib']:,}) and the memory is {memory_mib:,} MiB "
            f"({memory}): use a smaller packing of the model or a larger GPU"
        )

    def per_slot(kv: str, tokens: int) -> float:
        state = shape.recurrent_bytes_per_slot / MIB + shape.compute_per_slot_mib()
        return tokens * shape.kv_bytes_per_token(kv) / MIB + state

    candidates = [kv_type] if kv_type else ["f16", "q8_0"]
    for kv in candidates:
        fitting = int(available // per_slot(kv, padded(context)))
        chosen = slots if slots else min(fitting, MAX_SLOTS)
        if chosen >= 1 and fitting >= chosen:
            total = padded(chosen * context)
            plan_fixed = {
                **fixed,
                "compute_mib": fixed["compute_mib"]
                + math.ceil(chosen * shape.compute_per_slot_mib()),
            }
            return Plan(
                model=shape.name,
                architecture=shape.architecture,
                memory=memory,
                memory_mib=memory_mib,
                slots=chosen,
                context=total // chosen,
                ctx_total=total,
                kv_type=kv,
                kv_unified=kv_unified,
                ubatch=ubatch,
                host_weights_mib=math.ceil(shape.host_weight_bytes / MIB),
                kv_mib=math.ceil(total * shape.kv_bytes_per_token(kv) / MIB),
                recurrent_mib=math.ceil(chosen * shape.recurrent_bytes_per_slot / MIB),
                **plan_fixed,
            )
    kv = candidates[-1]
    wanted = slots or 1
    state = shape.recurrent_bytes_per_slot / MIB + shape.compute_per_slot_mib()
    max_context = (available / wanted - state) * MIB
    max_context = int(max_context // shape.kv_bytes_per_token(kv)) // CTX_PAD * CTX_PAD
    max_slots = int(available // per_slot(kv, padded(context)))
    options = []
    if max_context >= CTX_PAD:
        options.append(f"SLOTS={wanted} with CONTEXT={max_context} or less")
    if max_slots >= 1:
        options.append(f"CONTEXT={context} with SLOTS={max_slots} or fewer")
    needed = math.ceil(wanted * per_slot(kv, padded(context)))
    raise PlanError(
        f"{wanted} slot{'s' if wanted > 1 else ''} x {context} tokens need {needed:,} MiB of "
        f"{kv} KV cache and state, {available:,} MiB is left after the weights and buffers "
        f"({memory}, {memory_mib:,} MiB): "
        + (" or ".join(options) if options else "use a smaller model")
        + " would fit"
    )


def gpu_memory(index: int) -> tuple[int, str]:
    """Total memory of GPU index (MiB) and its name."""
    gpus, why = gpu.query(index)
    if not gpus:
        raise PlanError(
            f"cannot read GPU {index}'s memory ({why}): install the NVIDIA driver (the "
            "nvidia_driver role), pick another GPU, or set VRAM_MIB to plan for a card elsewhere"
        )
    return gpus[0].total_mib, f"GPU {index}: {gpus[0].name}"


def host_memory() -> tuple[int, str]:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024, "host RAM"
    raise PlanError("cannot read the host's memory (/proc/meminfo): set VRAM_MIB")


def for_settings(values: dict[str, str], model: Path) -> Plan:
    """The plan the settings ask for (ternary_serve.settings), on the memory they name."""
    if values["VRAM_MIB"] != "auto":
        memory_mib, memory = int(values["VRAM_MIB"]), "VRAM_MIB"
    elif values["BACKEND"] == "cuda":
        memory_mib, memory = gpu_memory(int(values["GPU"]))
    else:
        memory_mib, memory = host_memory()

    def chosen(name: str) -> str | None:
        return None if values[name] == "auto" else values[name]

    return make(
        Shape.from_gguf(model),
        memory_mib,
        memory,
        backend=values["BACKEND"],
        context=int(chosen("CONTEXT") or 0) or None,
        slots=int(chosen("SLOTS") or 0) or None,
        kv_type=chosen("KV_TYPE"),
        kv_unified=values["KV_UNIFIED"],
        ubatch=int(values["UBATCH"]),
    )


def main(argv: list[str] | None = None) -> int:
    from ternary_serve import settings

    ap = argparse.ArgumentParser(prog="ternary-serve plan", description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="the GGUF to plan for")
    ap.add_argument("--vram-mib", help="plan for a card of this size instead of reading the GPU")
    ap.add_argument("--json", type=Path, help="also write the plan here")
    ap.add_argument(
        "--env-file", type=Path, default=ENV_FILE, help="the configured settings (default .env)"
    )
    ap.add_argument(
        "assignments", nargs="*", metavar="NAME=value",
        help="settings to plan with (CONTEXT, SLOTS, KV_TYPE, BACKEND, GPU, UBATCH...)",
    )  # fmt: skip
    args = ap.parse_intermixed_args(argv)

    def plan_and_report() -> int:
        given = settings.parse_assignments(args.assignments)
        if args.vram_mib:
            given["VRAM_MIB"] = args.vram_mib
        memory = for_settings(
            settings.resolve(settings.configured(args.env_file), given), args.model
        )
        print(memory.table())
        if args.json:
            write_json(args.json, memory.as_dict())
        return 0

    return errors.run("plan", plan_and_report)
