"""The NVIDIA GPUs as nvidia-smi reports them: the one reader of its output (the plan sizes the
server by it, bench records it)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

FIELDS = "index,name,driver_version,memory.total,memory.used"
TIMEOUT_S = 30  # a GPU that stopped answering hangs nvidia-smi


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    driver: str
    total_mib: int
    used_mib: int

    def __str__(self) -> str:
        return f"{self.name}, driver {self.driver}, {self.total_mib} MiB"


def query(index: int | None = None) -> tuple[list[Gpu], str]:
    """The GPUs (only GPU index, if given), and when there are none, why: nvidia-smi missing,
    hung, or what it said."""
    select = [] if index is None else ["-i", str(index)]
    try:
        out = subprocess.run(
            ["nvidia-smi", *select, f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except FileNotFoundError:
        return [], "nvidia-smi not found"
    except subprocess.TimeoutExpired:
        return [], f"nvidia-smi did not answer within {TIMEOUT_S} s"
    if out.returncode != 0:
        return [], out.stderr.strip() or out.stdout.strip() or f"nvidia-smi exit {out.returncode}"
    gpus = []
    for line in out.stdout.splitlines():
        if line.strip():
            number, name, driver, total, used = (field.strip() for field in line.split(","))
            gpus.append(Gpu(int(number), name, driver, int(total), int(used)))
    return gpus, "" if gpus else "no such GPU"
