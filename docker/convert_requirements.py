#!/usr/bin/env python3
"""Print the engine's converter requirements as the convert image installs them.

The one place this filter lives: the Dockerfile's convert stage pipes it into pip, and
`make constraints` into `uv pip compile`, so the pins and the image read the same list. Dropped:
the engine's torch pin (TORCH_VERSION replaces it), gguf (the engine's own gguf-py is installed
from source) and pip options (`-r` includes are read here, the PyTorch index comes from
TORCH_INDEX_URL).

    python3 docker/convert_requirements.py vendor/llama.cpp/requirements

Standard library only: it runs in the convert stage before anything is installed.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FILES = ("requirements-convert_hf_to_gguf.txt", "requirements-convert_legacy_llama.txt")
DROPPED = ("torch", "gguf", "-")


def converter_requirements(requirements_dir: Path) -> list[str]:
    lines = []
    for name in FILES:
        for raw in (requirements_dir / name).read_text().splitlines():
            line = re.sub(r"(^|\s)#.*", "", raw).strip()
            if line and not line.startswith(DROPPED):
                lines.append(line)
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        sys.exit("usage: convert_requirements.py ENGINE_SOURCE/requirements")
    print("\n".join(converter_requirements(Path(sys.argv[1]))))
