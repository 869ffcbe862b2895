"""Benchmark an engine build on a model: llama-bench pp512/tg128, then llama-server started with the
flags rendered from templates/llama-server.env.j2 and measured by the smoke client.

Runs natively (no Docker): point --bin at the engine's bin/ (docker/build_engine.py --prefix).
Prints a table and writes JSON next to --out.

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
import subprocess
import sys
import time
from pathlib import Path

import requests

from ternary_serve import plan, smoke


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        return "no NVIDIA GPU (no nvidia-smi)"
    return out.stdout.strip() if out.returncode == 0 else "no NVIDIA GPU"


def llama_bench(bin_dir: Path, model: Path, backend: str) -> list[dict]:
    ngl = "99" if backend == "cuda" else "0"
    cmd = [
        str(bin_dir / "llama-bench"),
        "-m",
        str(model),
        "-ngl",
        ngl,
        "-fa",
        "1",
        "-p",
        "512",
        "-n",
        "128",
        "-r",
        "3",
        "-o",
        "json",
    ]
    print("+ " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = []
    for r in json.loads(out.stdout):
        test = f"pp{r.get('n_prompt')}" if r.get("n_prompt") else f"tg{r.get('n_gen')}"
        keep = (
            "avg_ts",
            "stddev_ts",
            "model_size",
            "model_n_params",
            "model_type",
            "build_commit",
            "n_gpu_layers",
            "flash_attn",
        )
        rows.append({"test": test, **{k: r.get(k) for k in keep}})
    return rows


def server_env(model: Path, backend: str, port: int) -> dict[str, str]:
    """The production flags: the same template Compose uses, with the model path swapped in."""
    rendered = plan.render_server_env(
        {"backend": backend, "model_file": model.name, "server_port": port}
    )
    env = dict(os.environ)
    for line in rendered.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    env["LLAMA_ARG_MODEL"] = str(model)
    env["LLAMA_ARG_HOST"] = "127.0.0.1"
    return env


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} while loading")
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s")


def serve_and_smoke(
    bin_dir: Path, model: Path, backend: str, port: int, max_tokens: int, log: Path
) -> dict:
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [str(bin_dir / "llama-server")],
            env=server_env(model, backend, port),
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
        try:
            load_s = wait_healthy(url, proc, timeout=600)
            report = smoke.run(url, max_tokens=max_tokens, ignore_eos=True, timeout=300)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    report["load_seconds"] = round(load_s, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve bench", description=__doc__.splitlines()[0])
    ap.add_argument("--bin", type=Path, required=True, help="engine bin/ directory")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("bench.json"))
    args = ap.parse_args(argv)

    build_info = args.bin.parent / "build-info.json"
    result = {
        "machine": {"gpu": gpu_name(), "cpu_count": os.cpu_count(), "host": platform.node()},
        "build": json.loads(build_info.read_text()) if build_info.is_file() else None,
        "model": str(args.model),
        "llama_bench": llama_bench(args.bin, args.model, args.backend),
    }
    try:
        result["server"] = serve_and_smoke(
            args.bin,
            args.model,
            args.backend,
            args.port,
            args.max_tokens,
            args.out.with_suffix(".server.log"),
        )
    except (RuntimeError, smoke.SmokeFailure) as exc:
        print(f"bench: server run failed: {exc}", file=sys.stderr)
        result["server"] = {"error": str(exc)}
    args.out.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")

    print(f"\nmachine: {result['machine']['gpu']}; model: {args.model.name}")
    print(f"{'measure':<34} {'tokens/s':>10}")
    for row in result["llama_bench"]:
        print(f"{'llama-bench ' + row['test']:<34} {row['avg_ts']:>10.1f}")
    for trip in result["server"].get("round_trips", []):
        print(
            f"{'llama-server decode [' + trip['prompt'] + ']':<34} "
            f"{trip['decode_tokens_per_s'] or 0:>10.1f}   ttft {trip['ttft_s'] * 1000:.0f} ms"
        )
    print(f"json: {args.out}")
    return 0 if "error" not in result["server"] else 1


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
        "docker", "run", "--rm",
        "-v", f"{checkpoint.resolve()}:/in:ro", "-v", f"{out.resolve()}:/out",
        args.image, "convert", "/in", "/out/model.gguf", "--type", "Q2_0", "--backend", "cpu",
    ]  # fmt: skip
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
    args.out.write_text(json.dumps(result, indent=2) + "\n")
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
