"""Benchmark serving: llama-bench, llama-batched-bench at the planned slot count, a concurrency
sweep through the server (1, slots and 2x slots clients, streaming, with the official `openai`
client, so it also proves the API's compatibility), and multi-turn chats (1 and slots users, each
turn the whole growing history: TTFT and the prompt tokens evaluated and reused per turn). The
settings' workload profile (WORKLOAD) and the server flags are recorded with every result.

Against the deployed stack (default): the server at PUBLISH_ADDRESS:PUBLISH_PORT, the engine's
benchmarks in the release's server image. Where there is no Docker (`--bin`, the GPU machine):
llama-server started natively with the env file the renderer writes, the same flags Compose passes.
Tokens are counted from the server's own usage and timings, never from stream chunks. Writes
bench.json and bench.png (matplotlib) to --out, each run recorded with the release, GPU, model and
settings.

`ternary-serve bench-convert` measures conversion instead: a synthetic checkpoint of 27B-class
layers through the model-init image's `convert` (engine converter + llama-quantize), reporting
throughput and the tools' peak memory from the conversion manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import requests
import requests.adapters
import urllib3.util

from ternary_serve import config, dockerd, envfile, errors, gpu, probe, settings
from ternary_serve.client import Endpoint
from ternary_serve.files import write_json
from ternary_serve.versions import PROJECT_ROOT


class BenchError(errors.ServeError):
    """A benchmark step that could not run; the message says which and why."""


def gpu_name() -> str:
    gpus, _ = gpu.query()
    if not gpus:
        return f"no NVIDIA GPU; CPU: {platform.processor() or platform.machine()}"
    return "; ".join(map(str, gpus))


def gpu_memory_used(index: int = 0) -> dict:
    """What the whole GPU has in use (MiB), by nvidia-smi; empty without one."""
    gpus, _ = gpu.query(index)
    if not gpus:
        return {}
    return {"nvidia_smi_used_mib": gpus[0].used_mib, "nvidia_smi_total_mib": gpus[0].total_mib}


def engine_room(flags: dict[str, str], env: dict[str, str]) -> str | None:
    """Why the engine's benchmarks cannot run beside the live server on its GPU (None: they can).
    On a 24 GB card the planned server leaves less than a second copy of a 27B model needs."""
    if flags.get("LLAMA_ARG_N_GPU_LAYERS", "0") == "0":
        return None
    memory = gpu_memory_used(int(env.get("GPU", "0")))
    if not memory:
        return None
    free = memory["nvidia_smi_total_mib"] - memory["nvidia_smi_used_mib"]
    model = Path(env["MODEL_DIR"]) / env["MODEL_FILE"]
    needed = model.stat().st_size // 2**20 + 1024
    if free >= needed:
        return None
    return (
        f"{free} MiB of GPU memory is free beside the live server and a second copy of the model "
        f"needs about {needed}: stop the stack and run `ternary-serve bench --bin` for them"
    )


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


@dataclass
class Engine:
    """How to run the engine's tools: natively from a bin/ directory, or in the server image."""

    bin_dir: Path | None
    model: Path  # as the tools see it
    env: dict[str, str] | None = None  # the deployed stack's .env (image runs)

    def run(self, tool: str, args: list[str], timeout: float) -> str:
        if self.bin_dir is not None:
            cmd = [str(self.bin_dir / tool), *args]
            log("+ " + " ".join(cmd))
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, cwd=PROJECT_ROOT
            )
        else:
            done = self.run_in_image(tool, args, timeout)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise BenchError(f"{tool} exited with {done.returncode}: {' | '.join(tail)}")
        return done.stdout + done.stderr

    def run_in_image(self, tool: str, args: list[str], timeout: float):
        """The tool in the release's server image, detached, its output read from `docker logs`
        once it has exited: one CI run lost batched-bench's last row through an attached
        `compose run`, most likely the attach ending before the output did."""
        compose = ["docker", "compose", "--env-file", self.env["ENV_FILE"]]
        cmd = [*compose, "run", "-d", "--no-deps", "--entrypoint", f"/usr/local/bin/{tool}",
               "llama-server", *args]  # fmt: skip
        log("+ " + " ".join(cmd))
        started = subprocess.run(cmd, capture_output=True, text=True, cwd=PROJECT_ROOT)
        if started.returncode != 0:
            dockerd.answers()
            return started
        container = started.stdout.strip().splitlines()[-1]
        try:
            waited = subprocess.run(
                ["docker", "wait", container], capture_output=True, text=True, timeout=timeout
            )
            logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
        finally:
            subprocess.run(["docker", "rm", "-f", container], capture_output=True)
        code = int(waited.stdout.strip() or 1)
        return subprocess.CompletedProcess(cmd, code, logs.stdout, logs.stderr)


def engine_args(flags: dict[str, str]) -> list[str]:
    """The server's memory and offload flags, for the engine's benchmarks."""
    ngl = flags.get("LLAMA_ARG_N_GPU_LAYERS", "0")
    fa = flags.get("LLAMA_ARG_FLASH_ATTN", "auto")
    kv = flags.get("LLAMA_ARG_CACHE_TYPE_K", "f16")
    return [
        "-ngl",
        ngl,
        "-fa",
        fa,
        "-ctk",
        kv,
        "-ctv",
        kv,
        "-b",
        flags["LLAMA_ARG_BATCH"],
        "-ub",
        flags["LLAMA_ARG_UBATCH"],
    ]


def llama_bench(engine: Engine, flags: dict[str, str], pp: int, tg: int, reps: int) -> list[dict]:
    args = engine_args(flags)
    # llama-bench spells flash attention 0/1 and does not take auto.
    args[args.index("-fa") + 1] = "1" if args[args.index("-fa") + 1] == "on" else "0"
    out = engine.run(
        "llama-bench",
        [
            "-m",
            str(engine.model),
            *args,
            "-p",
            str(pp),
            "-n",
            str(tg),
            "-r",
            str(reps),
            "-o",
            "json",
        ],
        timeout=1800,
    )
    rows = []
    for r in json.loads(out[out.index("[") : out.rindex("]") + 1]):
        test = f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r['n_gen']}"
        rows.append(
            {
                "test": test,
                "tokens_per_s": r["avg_ts"],
                "stddev": r["stddev_ts"],
                "model_size": r["model_size"],
                "build_commit": r.get("build_commit"),
            }
        )
    return rows


def batched_bench(engine: Engine, flags: dict[str, str], slots: int, pp: int, tg: int) -> list:
    parallel = sorted({1, slots})
    args = engine_args(flags)
    if flags.get("LLAMA_ARG_KV_UNIFIED") == "on":
        args.append("-kvu")
    out = engine.run(
        "llama-batched-bench",
        [
            "-m",
            str(engine.model),
            *args,
            "-c",
            str(max(parallel) * (pp + tg) + 256),
            "-npp",
            str(pp),
            "-ntg",
            str(tg),
            "-npl",
            ",".join(map(str, parallel)),
            "--output-format",
            "jsonl",
        ],
        timeout=1800,
    )
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"n_kv_max"')]
    return [
        {
            "parallel": r["pl"],
            "pp": r["pp"],
            "tg": r["tg"],
            "decode_tokens_per_s": r["speed_tg"],
            "prompt_tokens_per_s": r["speed_pp"],
        }
        for r in rows
    ]


def tokenizer_session(api: Endpoint) -> requests.Session:
    """One keep-alive session per client for /tokenize and /detokenize, which are idempotent:
    a connection the gateway dropped before answering is retried (twice), the chat request never
    is (its failures are the sweep's)."""
    http = api.session()
    retry = urllib3.util.Retry(total=2, allowed_methods=None, status=0, backoff_factor=0.2)
    http.mount("https://", requests.adapters.HTTPAdapter(max_retries=retry))
    http.mount("http://", requests.adapters.HTTPAdapter(max_retries=retry))
    return http


def prompt_of(api: Endpoint, http: requests.Session, n_tokens: int, request: int) -> str:
    """A distinct prompt per request (the prompt cache must not serve it) of n_tokens tokens, cut
    to length by the server's own tokenizer (/tokenize, /detokenize)."""
    words = " ".join(f"item{(request * 7919 + i) % 10007}" for i in range(n_tokens))
    text = f"Request {request}. Continue this list without stopping: {words}"
    tokens = http.post(f"{api.url}/tokenize", json={"content": text}, timeout=60).json()
    cut = http.post(
        f"{api.url}/detokenize", json={"tokens": tokens["tokens"][:n_tokens]}, timeout=60
    )
    return cut.json()["content"]


def percentile(values: list[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def request_errors() -> tuple[type[Exception], ...]:
    """What one load request may fail with; every one counts, the prompt's /tokenize calls
    included: a worker that died on one would silently make fewer requests than reported."""
    import openai

    return (openai.OpenAIError, requests.RequestException, ValueError, probe.ProbeError)


def side_by_side(work, count: int) -> float:
    """work(0) .. work(count - 1) in threads at once; the wall time until all have ended."""
    started = time.monotonic()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started


def sweep_level(
    api: Endpoint, model: str, clients: int, rounds: int, prompt: int, max_tokens: int, offset: int
) -> dict:
    client = api.openai(timeout=600, max_retries=0)
    results: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        with tokenizer_session(api) as http:
            for r in range(rounds):
                try:
                    request = offset + index * rounds + r
                    text = prompt_of(api, http, prompt, request)
                    done = probe.one_request(client, model, probe.user(text), max_tokens)
                except request_errors() as exc:
                    with lock:
                        failures.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                with lock:
                    results.append(done)

    wall = side_by_side(worker, clients)
    ttft = [r["ttft_s"] for r in results]
    per_stream = [r["decode_tokens_per_s"] for r in results if r["decode_tokens_per_s"]]
    return {
        "clients": clients,
        "requests": clients * rounds,
        "completed": len(results),
        "failures": len(failures),
        "failure_samples": failures[:3],
        "completion_tokens": sum(r["completion_tokens"] for r in results),
        "prompt_tokens_mean": round(statistics.mean(r["prompt_tokens"] for r in results), 1)
        if results
        else None,
        "wall_s": round(wall, 2),
        "aggregate_tokens_per_s": round(sum(r["completion_tokens"] for r in results) / wall, 2),
        "per_stream_tokens_per_s": round(statistics.median(per_stream), 2) if per_stream else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p95_s": percentile(ttft, 0.95),
    }


def sweep(api: Endpoint, model: str, levels: list[int], rounds: int, prompt: int, max_tokens: int):
    rows = []
    for step, clients in enumerate(levels, start=1):
        log(
            f"sweep {step}/{len(levels)}: {clients} clients x {rounds} requests, "
            f"{max_tokens} tokens each"
        )
        row = sweep_level(api, model, clients, rounds, prompt, max_tokens, offset=step * 100000)
        log(
            f"  {row['aggregate_tokens_per_s']} t/s aggregate, {row['per_stream_tokens_per_s']} "
            f"t/s per stream, TTFT p95 {row['ttft_p95_s'] or 0:.2f} s, {row['failures']} failed"
        )
        rows.append(row)
    return rows


def chat_level(
    api: Endpoint, model: str, users: int, turns: int, user_tokens: int, max_tokens: int
) -> dict:
    """users conversations side by side, each of `turns` turns: every turn adds user_tokens new
    tokens of the user's to the whole history and generates max_tokens. Per turn: TTFT and what
    the server evaluated of the prompt and reused from the conversation's earlier turns."""
    client = api.openai(timeout=600, max_retries=0)
    per_turn: list[list[dict]] = [[] for _ in range(turns)]
    failures: list[str] = []
    lock = threading.Lock()

    def conversation(index: int) -> None:
        messages: list[dict] = []
        with tokenizer_session(api) as http:
            for turn in range(turns):
                try:
                    text = prompt_of(api, http, user_tokens, 10**6 + index * 1000 + turn)
                    messages.append({"role": "user", "content": text})
                    done = probe.one_request(client, model, messages, max_tokens)
                except request_errors() as exc:
                    with lock:
                        failures.append(f"turn {turn + 1}: {type(exc).__name__}: {exc}"[:200])
                    return  # the rest of this conversation has no history to build on
                messages.append({"role": "assistant", "content": done["text"]})
                with lock:
                    per_turn[turn].append(done)

    wall = side_by_side(conversation, users)
    done_all = [r for rows in per_turn for r in rows]

    def mean(rows: list[dict], key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return round(statistics.mean(values), 1) if values else None

    return {
        "users": users,
        "turns": [
            {
                "turn": turn + 1,
                "completed": len(rows),
                "ttft_p50_s": percentile([r["ttft_s"] for r in rows], 0.5),
                "ttft_p95_s": percentile([r["ttft_s"] for r in rows], 0.95),
                "prompt_tokens_mean": mean(rows, "prompt_tokens"),
                "prompt_evaluated_mean": mean(rows, "prompt_evaluated"),
                "prompt_reused_mean": mean(rows, "prompt_reused"),
            }
            for turn, rows in enumerate(per_turn)
        ],
        "failures": len(failures),
        "failure_samples": failures[:3],
        "wall_s": round(wall, 2),
        "aggregate_tokens_per_s": round(sum(r["completion_tokens"] for r in done_all) / wall, 2),
    }


def chat(
    api: Endpoint, model: str, levels: list[int], turns: int, user_tokens: int, max_tokens: int
):
    rows = []
    for users in levels:
        log(f"chat: {users} users x {turns} turns, {user_tokens} new tokens a turn")
        row = chat_level(api, model, users, turns, user_tokens, max_tokens)
        last = row["turns"][-1]
        log(
            f"  turn {turns}: TTFT p50 {last['ttft_p50_s'] or 0:.2f} s, "
            f"{last['prompt_reused_mean']} tokens reused, {row['aggregate_tokens_per_s']} t/s "
            f"aggregate, {row['failures']} failed"
        )
        rows.append(row)
    return rows


def chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["sweep"]
    clients = [r["clients"] for r in rows]
    chats = result.get("chat") or []
    fig, panels = plt.subplots(1, 3 if chats else 2, figsize=(16 if chats else 11, 4.2))
    left, right = panels[0], panels[1]
    if chats:
        for level in chats:
            turns = [t["turn"] for t in level["turns"]]
            panels[2].plot(
                turns, [t["ttft_p50_s"] or 0 for t in level["turns"]], "o-",
                label=f"{level['users']} users, TTFT p50",
            )  # fmt: skip
        panels[2].set_xlabel("chat turn")
        panels[2].set_ylabel("seconds")
        panels[2].legend(fontsize=8)
    left.plot(clients, [r["aggregate_tokens_per_s"] for r in rows], "o-", label="server, aggregate")
    left.plot(
        clients, [r["per_stream_tokens_per_s"] or 0 for r in rows], "s-", label="server, per stream"
    )
    for row in result["batched_bench"]:
        left.scatter([row["parallel"]], [row["decode_tokens_per_s"]], marker="x", color="k")
    tg = [r["tokens_per_s"] for r in result["llama_bench"] if r["test"].startswith("tg")]
    if tg:
        left.axhline(tg[0], linestyle=":", color="grey", label="llama-bench tg (one stream)")
    left.scatter([], [], marker="x", color="k", label="llama-batched-bench decode")
    left.set_xlabel("concurrent clients")
    left.set_ylabel("decode tokens/s")
    left.legend(fontsize=8)
    right.plot(clients, [r["ttft_p50_s"] or 0 for r in rows], "o-", label="TTFT p50")
    right.plot(clients, [r["ttft_p95_s"] or 0 for r in rows], "s-", label="TTFT p95")
    right.set_xlabel("concurrent clients")
    right.set_ylabel("seconds")
    right.legend(fontsize=8)
    plan = result["settings"]
    fig.suptitle(
        f"{result['model']} on {result['machine']['gpu'][:60]}\n"
        f"release {result['release']}, WORKLOAD={plan['workload']}, {plan['slots']} slots x "
        f"{plan['context']} tokens, KV {plan['kv_type']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def wait_healthy(api: Endpoint, proc: subprocess.Popen, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise BenchError(f"llama-server exited with {proc.returncode} while loading")
        try:
            if requests.get(f"{api.url}/health", timeout=2, verify=api.verify).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise BenchError(f"llama-server not healthy after {timeout:.0f} s")


def native_flags(
    model: Path, given: dict[str, str], port: int
) -> tuple[dict[str, str], dict, dict[str, str]]:
    """The rendered server env for model with the given settings, as Compose would pass it; the
    plan; the settings."""
    values = settings.resolve(
        {}, {"MODEL_DIR": str(model.parent), "MODEL_FILE": model.name, **given}
    )
    files, _, memory = config.planned(values)
    flags = envfile.parse(files[config.SERVER_ENV])
    flags.update(LLAMA_ARG_MODEL=str(model), LLAMA_ARG_HOST="127.0.0.1", LLAMA_ARG_PORT=str(port))
    # A native server on loopback for the length of the run: no Compose secret, no key.
    del flags["LLAMA_ARG_API_KEY_FILE"]
    return flags, memory.as_dict() if memory else {}, values


def summary(result: dict) -> str:
    lines = [
        f"machine: {result['machine']['gpu']}; model {result['model']}; release {result['release']}"
    ]
    for row in result["llama_bench"]:
        lines.append(f"  llama-bench {row['test']:<8} {row['tokens_per_s']:>9.1f} t/s")
    for row in result["batched_bench"]:
        lines.append(
            f"  llama-batched-bench {row['parallel']:>3} seqs  "
            f"{row['decode_tokens_per_s']:>9.1f} t/s decode"
        )
    lines.append(
        f"  {'clients':>7} {'aggregate':>10} {'per stream':>10} {'TTFT p50':>9} "
        f"{'TTFT p95':>9} {'failed':>6}"
    )
    for r in result["sweep"]:
        lines.append(
            f"  {r['clients']:>7} {r['aggregate_tokens_per_s']:>10.1f} "
            f"{r['per_stream_tokens_per_s'] or 0:>10.1f} {r['ttft_p50_s'] or 0:>8.2f}s "
            f"{r['ttft_p95_s'] or 0:>8.2f}s {r['failures']:>6}"
        )
    for level in result.get("chat") or []:
        lines.append(
            f"  chat, {level['users']} users: {level['aggregate_tokens_per_s']:.1f} t/s aggregate, "
            f"{level['failures']} failed"
        )
        lines.append(f"  {'turn':>7} {'TTFT p50':>9} {'TTFT p95':>9} {'prompt':>7} "
                     f"{'evaluated':>9} {'reused':>7}")  # fmt: skip
        for t in level["turns"]:
            lines.append(
                f"  {t['turn']:>7} {t['ttft_p50_s'] or 0:>8.2f}s {t['ttft_p95_s'] or 0:>8.2f}s "
                f"{t['prompt_tokens_mean'] or 0:>7.0f} {t['prompt_evaluated_mean'] or 0:>9.0f} "
                f"{t['prompt_reused_mean'] or 0:>7.0f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--env-file", type=Path, default=PROJECT_ROOT / ".env", help="the deployed stack to measure"
    )
    ap.add_argument("--bin", type=Path, help="no Docker: the engine's bin/ (native llama-server)")
    ap.add_argument("--model", type=Path, help="with --bin: the GGUF")
    ap.add_argument(
        "--port", type=int, default=config.SERVER_PORT, help="with --bin: the server's port"
    )
    ap.add_argument("--out", type=Path, default=Path("bench"), help="directory for JSON and PNG")
    ap.add_argument("--name", default="bench", help="file name stem in --out")
    ap.add_argument("--pp", type=int, default=512, help="llama-bench prompt tokens")
    ap.add_argument("--tg", type=int, default=128, help="llama-bench / sweep generated tokens")
    ap.add_argument("--reps", type=int, default=3, help="llama-bench repetitions")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="sweep prompt length")
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--sweep-only", action="store_true", help="skip the engine's benchmarks")
    ap.add_argument("--chat-turns", type=int, default=4, help="turns per conversation (0: none)")
    ap.add_argument("--chat-user-tokens", type=int, default=1000, help="new user tokens a turn")
    ap.add_argument("--chat-max-tokens", type=int, default=64, help="tokens generated a turn")
    ap.add_argument(
        "assignments",
        nargs="*",
        metavar="NAME=value",
        help="with --bin: settings (SLOTS, CONTEXT, SERVER_EXTRA...)",
    )
    args = ap.parse_intermixed_args(argv)

    def bench_and_report() -> int:
        result = run(args)
        print(summary(result))
        levels = [*result["sweep"], *result.get("chat", [])]
        return 0 if all(r["failures"] == 0 for r in levels) else 1

    return errors.run("bench", bench_and_report)


def run(args: argparse.Namespace) -> dict:
    args.out.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.bin:
        if not args.model:
            raise BenchError("--bin needs --model")
        flags, memory, values = native_flags(
            args.model, settings.parse_assignments(args.assignments), args.port
        )
        engine = Engine(args.bin, args.model)
        api = Endpoint(f"http://127.0.0.1:{args.port}")
        build = args.bin.parent / "build-info.json"
        release = (
            json.loads(build.read_text()).get("engine_ref", "native")
            if build.is_file()
            else "native"
        )
        model_name = args.model.name
    else:
        if not args.env_file.is_file():
            raise BenchError(f"{args.env_file} does not exist: configure and deploy a stack first")
        env = {**envfile.read(args.env_file), "ENV_FILE": str(args.env_file)}
        flags = envfile.read(Path(env["SERVER_ENV_FILE"]))
        memory = {}
        values = settings.configured(args.env_file)
        engine = Engine(None, Path(flags["LLAMA_ARG_MODEL"]), env)
        api = Endpoint.of(env)
        release = env["IMAGE_TAG"]
        model_name = env["MODEL_FILE"]
        try:
            probe.served_model(api)  # before minutes of engine benchmarks
        except probe.ProbeError:
            dockerd.answers()  # the stack is down because Docker is: that is the fix to name
            raise
    slots = int(flags.get("LLAMA_ARG_N_PARALLEL", "1"))
    result = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"gpu": gpu_name(), "cpu_count": os.cpu_count(), "host": platform.node()},
        "release": release,
        "model": model_name,
        "settings": {
            "slots": slots,
            "context": int(flags.get("LLAMA_ARG_CTX_SIZE", "0")) // slots,
            "kv_type": flags.get("LLAMA_ARG_CACHE_TYPE_K", "f16"),
            "kv_unified": flags.get("LLAMA_ARG_KV_UNIFIED", "off"),
            "workload": values["WORKLOAD"],
            "prompt_cache": values["PROMPT_CACHE"],
            "server_flags": flags,
            "plan": memory,
        },
    }
    result["llama_bench"] = result["batched_bench"] = []
    room = None if args.bin else engine_room(flags, env)
    if room:
        # The engine's benchmarks load a second copy of the weights beside the live server.
        log(f"skipping llama-bench and llama-batched-bench: {room}")
        result["engine_benchmarks_skipped"] = room
    elif not args.sweep_only:
        log(f"llama-bench pp{args.pp} tg{args.tg} x{args.reps}")
        result["llama_bench"] = llama_bench(engine, flags, args.pp, args.tg, args.reps)
        log(f"llama-batched-bench at 1 and {slots} sequences")
        result["batched_bench"] = batched_bench(engine, flags, slots, 128, args.tg)
    if args.bin:
        server_log = args.out / f"{args.name}.server.log"
        with server_log.open("w") as fh:
            proc = subprocess.Popen(
                [str(args.bin / "llama-server")],
                # Trace level: the engine logs its buffer sizes and, at exit, its memory breakdown.
                env={**os.environ, **flags, "LLAMA_ARG_LOG_VERBOSITY": "4"},
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
    try:
        if proc is not None:
            result["load_seconds"] = round(wait_healthy(api, proc, timeout=900), 1)
            result["memory"] = {"planned_mib": memory.get("used_mib"), **gpu_memory_used()}
        levels = sorted({1, slots, 2 * slots})
        model = probe.served_model(api)
        result["sweep"] = sweep(api, model, levels, args.rounds, args.prompt_tokens, args.tg)
        if args.chat_turns:
            result["chat"] = chat(
                api, model, sorted({1, slots}), args.chat_turns, args.chat_user_tokens,
                args.chat_max_tokens,
            )  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=120)
            # At exit the server prints what it allocated per device: model, context, compute.
            lines = server_log.read_text().splitlines()
            result.setdefault("memory", {}).update(
                engine_buffers=[line.split(": ", 1)[-1] for line in lines if "buffer size" in line],
                engine_breakdown=[
                    line.split("common_memory_breakdown_print: ", 1)[-1]
                    for line in lines
                    if "common_memory_breakdown_print" in line
                ],
            )
    out_json = args.out / f"{args.name}.json"
    write_json(out_json, result, ensure_ascii=False)
    chart(result, args.out / f"{args.name}.png")
    log(f"wrote {out_json} and {args.out / (args.name + '.png')}")
    return result


def convert_main(argv: list[str] | None = None) -> int:
    """Conversion throughput and peak memory on a synthetic checkpoint with 27B-class layers."""
    from ternary_serve import synthetic

    ap = argparse.ArgumentParser(
        prog="ternary-serve bench-convert", description=convert_main.__doc__
    )
    ap.add_argument("--image", required=True, help="the model-init image, e.g. from make release")
    ap.add_argument("--profile", choices=synthetic.LLAMA_PROFILES, default="llama-27b")
    ap.add_argument("--layers", type=int, default=4, help="layers of the profile's shape to write")
    ap.add_argument(
        "--vocab", type=int, default=151936, help="embedding rows (default: a Qwen-size vocabulary)"
    )
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/ternary-serve-convert-bench"))
    ap.add_argument("--out", type=Path, default=Path("convert-bench.json"))
    args = ap.parse_args(argv)

    checkpoint = args.workdir / f"{args.profile}-{args.layers}l-v{args.vocab}"
    if not (checkpoint / "config.json").is_file():
        print(f"bench-convert: writing {checkpoint}", flush=True)
        synthetic.write_checkpoint(
            checkpoint, args.profile, n_layer=args.layers, n_vocab=args.vocab
        )
    out = args.workdir / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        "docker",
        "run",
        "--rm",
        "-v",
        f"{checkpoint.resolve()}:/in:ro",
        "-v",
        f"{out.resolve()}:/out",
        args.image,
        "convert",
        "/in",
        "/out/model.gguf",
        "--type",
        "Q2_0",
        "--backend",
        "cpu",
    ]
    print("+ " + " ".join(cmd), flush=True)
    started = time.monotonic()
    subprocess.run(cmd, check=True)
    wall = time.monotonic() - started
    manifest = json.loads((out / "model.gguf.manifest.json").read_text())

    gb = manifest["input_bytes"] / 1e9
    result = {
        "machine": {"cpu_count": os.cpu_count(), "host": platform.node(), "gpu": gpu_name()},
        "profile": args.profile,
        "layers": args.layers,
        "vocab": args.vocab,
        "input_gb": round(gb, 3),
        "output_gb": round(manifest["bytes"] / 1e9, 3),
        "steps": manifest["steps"],
        "convert_seconds": manifest["seconds"],
        "wall_seconds": round(wall, 1),
        "engine": manifest["engine"],
        "tools": manifest["tools"],
    }
    write_json(args.out, result)
    print(
        f"\n{args.layers} layers of {args.profile}: {gb:.2f} GB fp16 in, "
        f"{result['output_gb']:.2f} GB Q2_0 out, {os.cpu_count()} CPUs"
    )
    print(f"{'step':<24} {'seconds':>8} {'GB/s in':>8} {'peak RSS MiB':>13}")
    for step in manifest["steps"]:
        print(
            f"{step['tool']:<24} {step['seconds']:>8.1f} {gb / step['seconds']:>8.3f} "
            f"{step['peak_rss_mib']:>13}"
        )
    print(
        f"{'total (hash, verify too)':<24} {manifest['seconds']:>8.1f} "
        f"{gb / manifest['seconds']:>8.3f}"
    )
    print(f"json: {args.out}")
    return 0
