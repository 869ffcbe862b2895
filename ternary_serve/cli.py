"""ternary-serve: one entry point for the project's jobs."""

from __future__ import annotations

import importlib
import os
import sys

# command -> (module, what it does). Modules load on use: the smoke image needs no numpy or docker
# import to run a smoke test.
COMMANDS = {
    "config": (
        "config",
        "set NAME=value settings; render .env and the server flags (with the plan)",
    ),
    "settings": ("settings", "list the settings: value, default, meaning"),
    "plan": ("plan", "plan GPU memory for a model: slots x context x KV cache type"),
    "release": (
        "release",
        "deploy a tag (rolled back unless healthy and smoke passes), roll back, list",
    ),
    "fleet": ("fleet", "render a fleet gateway's files: every replica of every serving host"),
    "smoke": ("smoke", "smoke test a running server"),
    "fetch": ("fetch", "download a GGUF (resumable, checksummed, verified) into place"),
    "model-init": ("model_init", "fetch or convert the configured model, then verify it"),
    "convert": ("convert", "convert a checkpoint or GGUF to the deployable type (engine's tools)"),
    "verify": ("weights", "check a GGUF before serving it"),
    "synth": ("synthetic", "write a synthetic ternary Q2_0 model"),
    "bench": ("bench", "llama-bench, llama-batched-bench and a client sweep through the server"),
    "bench-convert": ("bench:convert_main", "conversion throughput and peak memory, 27B-class"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    asked_for_help = bool(argv) and argv[0] in ("-h", "--help")
    if not argv or asked_for_help or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        usage = "\n".join(f"  {name:<{width}}  {doc}" for name, (_, doc) in COMMANDS.items())
        print(
            f"usage: ternary-serve COMMAND [ARGS]\n\ncommands:\n{usage}",
            file=sys.stdout if asked_for_help else sys.stderr,
        )
        return 0 if asked_for_help else 2
    module_name, _, function = COMMANDS[argv[0]][0].partition(":")
    module = importlib.import_module(f"ternary_serve.{module_name}")
    try:
        return getattr(module, function or "main")(argv[1:])
    except BrokenPipeError:
        # The reader stopped early (`| head`): exit as a tool killed by SIGPIPE does, without a
        # traceback, and without Python's second one when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13


if __name__ == "__main__":
    sys.exit(main())
