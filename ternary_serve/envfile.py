"""KEY=value files: the one reader and writer for versions.env, settings.env, .env and the server's
env file.

Plain lines only: no quotes, no `export`, no expansion (Compose, Make and Ansible read the same
files, and those are the lines all of them agree on). Comments and blank lines are skipped.
"""

from __future__ import annotations

from pathlib import Path

from ternary_serve.files import write_atomic


def parse(text: str, source: str = "<text>") -> dict[str, str]:
    pairs: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"{source}:{number}: expected KEY=value, got {raw!r}")
        pairs[key] = value
    return pairs


def read(path: Path) -> dict[str, str]:
    return parse(path.read_text(), str(path))


def render(pairs: dict[str, str], header: str = "") -> str:
    for key, value in pairs.items():
        if not key.isidentifier() or "\n" in str(value):
            raise ValueError(f"cannot write {key}={value!r} as one KEY=value line")
    return header + "".join(f"{key}={value}\n" for key, value in pairs.items())


def write(path: Path, pairs: dict[str, str], header: str = "") -> bool:
    return write_atomic(path, render(pairs, header))
