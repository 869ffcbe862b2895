"""Benchmark an engine build on a model: llama-bench pp512/tg128, then llama-server started with the
flags rendered from templates/llama-server.env.j2 and measured by the smoke client.

Runs natively (no Docker): point --bin at the engine's bin/ (docker/build_engine.py --prefix).
Prints a table and writes JSON next to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import requests

from ternary_serve import plan, smoke


def gpu_name() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
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
