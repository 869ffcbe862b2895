"""The model catalog (models.yaml): models an operator picks by name, with their pins, the engine
they need and the quality gate their answers must pass; and the lock (models.lock.json) where a
first verified fetch pins a model the catalog has no digest for.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ternary_serve.files import write_json
from ternary_serve.versions import PROJECT_ROOT
from ternary_serve.weights import ENGINES, WeightsError, engine_family

# The images carry the catalog elsewhere and say where in TERNARY_SERVE_CATALOG.
CATALOG_FILE = Path(os.environ.get("TERNARY_SERVE_CATALOG", PROJECT_ROOT / "models.yaml"))
# First-fetch pins live beside the models they pin, shared by `make model` and model-init.
LOCK_NAME = "models.lock.json"
NO_GATE = "none"
SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")


@dataclass(frozen=True)
class Question:
    """A prompt at temperature 0 whose answer must contain `expect`."""

    name: str
    prompt: str
    expect: str


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    source: str
    engine: str
    size_bytes: int | None = None
    sha256: str | None = None
    quality_gate: str = NO_GATE


@dataclass(frozen=True)
class Catalog:
    models: dict[str, CatalogEntry] = field(default_factory=dict)
    quality_gates: dict[str, tuple[Question, ...]] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.models

    def __getitem__(self, name: str) -> CatalogEntry:
        return self.models[name]


def load_catalog(path: Path = CATALOG_FILE) -> Catalog:
    """models.yaml, checked; an empty catalog where there is none."""
    if not path.is_file():
        return Catalog()
    data = yaml.safe_load(path.read_text()) or {}
    gates: dict[str, tuple[Question, ...]] = {NO_GATE: ()}
    for gate, questions in (data.get("quality_gates") or {}).items():
        try:
            gates[gate] = tuple(Question(**q) for q in questions)
        except TypeError as exc:
            raise WeightsError(
                f"{path}: quality gate {gate}: each question needs name, prompt, expect ({exc})"
            ) from exc
    models: dict[str, CatalogEntry] = {}
    for name, spec in (data.get("models") or {}).items():
        if spec.get("engine") not in ENGINES:
            raise WeightsError(f"{path}: {name}: engine must be one of {', '.join(ENGINES)}")
        gate = spec.get("quality_gate", NO_GATE)
        if gate not in gates:
            raise WeightsError(
                f"{path}: {name}: quality_gate {gate!r} is not defined under quality_gates"
            )
        sha256, size = spec.get("sha256"), spec.get("bytes")
        # YAML reads an all-digit digest as a number (0x... or 000...): only a quoted string counts.
        if sha256 is not None and not (isinstance(sha256, str) and SHA256_RE.fullmatch(sha256)):
            raise WeightsError(f'{path}: {name}: sha256 must be 64 hex digits in quotes: "..."')
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise WeightsError(f"{path}: {name}: bytes must be the file size, a whole number")
        models[name] = CatalogEntry(
            name=name,
            source=spec["source"],
            engine=spec["engine"],
            size_bytes=size,
            sha256=sha256.lower() if sha256 else None,
            quality_gate=gate,
        )
    return Catalog(models, gates)


def check_name(source: str, models: Catalog) -> None:
    """Refuse a source that can only mean a catalog name (no URL, no directory in it, no file of
    that name) and names none of the catalog's models: one line with the names, and the closest."""
    if not source or source in models or "/" in source or Path(source).exists():
        return
    close = difflib.get_close_matches(source, models.models, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    names = ", ".join(models.models) or "none"
    raise WeightsError(
        f"{source} is not a model in models.yaml: {hint}its models: {names} (or give an "
        "https:// URL, hf://OWNER/REPO/FILE or a path)"
    )


def check_engine(entry: CatalogEntry, engine_repo: str) -> None:
    """Refuse before downloading a model the configured engine cannot run."""
    if entry.engine == "prismml" and engine_family(engine_repo) != "prismml":
        raise WeightsError(
            f"{entry.name} needs the PrismML engine, but the configured engine is "
            f"{engine_repo}: use ENGINE_REPO from versions.env (ENGINE_SOURCE=git)"
        )


def read_lock(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def pin_in_lock(path: Path, name: str, manifest: dict) -> None:
    lock = read_lock(path)
    lock[name] = {
        "source": manifest["source"],
        "sha256": manifest["sha256"],
        "bytes": manifest["bytes"],
        "pinned_at": manifest["fetched_at"],
    }
    write_json(path, lock, sort_keys=True)
