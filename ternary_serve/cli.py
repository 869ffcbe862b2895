"""ternary-serve: one entry point for the project's jobs."""

from __future__ import annotations

import sys

from ternary_serve import bench, plan, smoke, synthetic, weights

COMMANDS = {
    "config": (plan.main, "render .env and the llama-server env file from versions.env + template"),
    "smoke": (smoke.main, "smoke test a running server"),
    "verify": (weights.main, "check a GGUF before serving it"),
    "synth": (synthetic.main, "write a synthetic ternary Q2_0 model"),
    "bench": (bench.main, "benchmark an engine build: llama-bench, then llama-server + smoke"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        usage = "\n".join(f"  {name:<{width}}  {doc}" for name, (_, doc) in COMMANDS.items())
        print(
            f"usage: ternary-serve COMMAND [ARGS]\n\ncommands:\n{usage}",
            file=sys.stdout if argv and argv[0] in ("-h", "--help") else sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    command, _ = COMMANDS[argv[0]]
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
