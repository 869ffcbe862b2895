"""Fetch model weights into MODEL_DIR: resumable, checksummed, verified, placed atomically.

Sources: a catalog name (models.yaml), a Hugging Face repo file (huggingface_hub; HF_TOKEN
optional), an http(s) URL, or a local path. The download goes to `<name>.partial` beside the
target and resumes from there; only a file whose size and SHA-256 match the pins and that passes
the configured engine's GGUF checks is renamed into place, so a half or wrong file never sits at
the final path. A download that matches its pinned SHA-256 but fails a later check stays as the
`.partial`, and the next run uses it instead of downloading it again. A manifest
(`<name>.manifest.json`) records what was placed; a rerun that finds the target matching its
manifest and pin does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import requests
import urllib3

from ternary_serve import errors
from ternary_serve.catalog import (
    CATALOG_FILE,
    LOCK_NAME,
    Catalog,
    check_engine,
    check_name,
    load_catalog,
    pin_in_lock,
    read_lock,
)
from ternary_serve.files import place, write_json
from ternary_serve.versions import ENV_FILE, configured_engine_repo
from ternary_serve.weights import (
    CHUNK,
    WeightsError,
    check_disk,
    engine_family,
    manifest_path,
    sha256_of,
    verify,
)

PROGRESS_EVERY_S = 5.0


class Progress:
    """Prints bytes done, percent and rate to stderr at most every PROGRESS_EVERY_S seconds."""

    def __init__(self, name: str, total: int | None, done: int = 0):
        self.name, self.total, self.done = name, total, done
        self.started = self.last = time.monotonic()
        self.start_bytes = done

    def update(self, n: int, final: bool = False) -> None:
        self.done += n
        now = time.monotonic()
        if not final and now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = (self.done - self.start_bytes) / max(now - self.started, 1e-6) / 2**20
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        total = f"/{self.total / 2**30:.2f}" if self.total else ""
        print(
            f"fetch: {self.name}: {self.done / 2**30:.2f}{total} GiB{share} {rate:.0f} MiB/s",
            file=sys.stderr,
            flush=True,
        )


def download_url(url: str, partial: Path, expected_size: int | None, timeout: float) -> None:
    """Download url into partial, resuming from its current length (HTTP Range)."""
    have = partial.stat().st_size if partial.exists() else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    with requests.get(url, headers=headers, stream=True, timeout=timeout) as resp:
        if resp.status_code == 416 and have:  # nothing left to fetch: the partial is complete
            return
        if resp.status_code not in (200, 206):
            raise WeightsError(f"{url} answered HTTP {resp.status_code}: check the URL or token")
        if resp.status_code == 200 and have:
            print("fetch: the server does not resume; starting over", file=sys.stderr)
            have = 0
        length = resp.headers.get("Content-Length")
        total = have + int(length) if length else expected_size
        if expected_size is not None and total != expected_size:
            raise WeightsError(
                f"{url} is {total} bytes, the pin says {expected_size}: upstream changed the "
                "file or the URL is wrong; nothing was downloaded"
            )
        check_disk(partial.parent, (total or 0) - have)
        progress = Progress(partial.name.removesuffix(".partial"), total, have)
        try:
            with partial.open("ab" if have else "wb") as out:
                try:
                    # read1 hands over what has arrived: a broken connection loses nothing written.
                    while chunk := resp.raw.read1(CHUNK):
                        out.write(chunk)
                        progress.update(len(chunk))
                except urllib3.exceptions.HTTPError as exc:
                    raise requests.ConnectionError(f"connection lost: {exc}") from exc
                finally:
                    out.flush()
                    os.fsync(out.fileno())
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            # A source of unstated size can outgrow the disk check above.
            raise WeightsError(
                f"{partial.parent} is full after {partial.stat().st_size:,} bytes of {url}: free "
                f"space there (or set MODEL_DIR elsewhere) and run again to resume; the model in "
                "place is untouched"
            ) from None
        progress.update(0, final=True)
        if total is not None and partial.stat().st_size != total:
            raise WeightsError(
                f"download of {url} stopped at {partial.stat().st_size} of {total} bytes: "
                "run the same command again to resume"
            )


@contextlib.contextmanager
def hub_errors(what: str):
    """huggingface_hub raises its HTTP client's own errors; the operator gets one line."""
    try:
        yield
    except WeightsError:
        raise
    except Exception as exc:  # noqa: BLE001 - every Hub or transport failure is reported alike
        raise WeightsError(
            f"Hugging Face Hub, {what}: {type(exc).__name__}: {exc}: check the network and "
            "HF_TOKEN, or fetch from an https:// URL or a local path"
        ) from exc


def download_hf(repo: str, filename: str, revision: str | None, partial: Path) -> None:
    """Fetch through huggingface_hub (resumable, cached), then copy into partial."""
    from huggingface_hub import hf_hub_download

    token = os.environ.get("HF_TOKEN")
    with hub_errors(f"downloading {repo}/{filename}"):
        cached = Path(
            hf_hub_download(repo_id=repo, filename=filename, revision=revision, token=token)
        )
    check_disk(partial.parent, cached.stat().st_size)
    shutil.copyfile(cached, partial)


def write_manifest(
    target: Path,
    source: str,
    sha256: str,
    summary: dict,
    seconds: float,
    pinned: bool = True,
    catalog_name: str | None = None,
) -> dict:
    manifest = {
        "source": source,
        "catalog_name": catalog_name,
        "path": str(target),
        "sha256": sha256,
        "bytes": target.stat().st_size,
        "sha256_pinned": pinned,
        "architecture": summary["architecture"],
        "tensor_types": summary["tensor_types"],
        "backend_checked": summary["backend"],
        "engine_checked": summary["engine"],
        "seconds": round(seconds, 1),
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    manifest_file = manifest_path(target)
    write_json(manifest_file, manifest)
    return manifest


def download(source: str, partial: Path, size: int | None, revision: str | None, timeout: float):
    if source.startswith(("http://", "https://")):
        download_url(source, partial, size, timeout)
    elif source.startswith("hf://"):
        repo, _, filename = source.removeprefix("hf://").rpartition("/")
        if not repo or not filename:
            raise WeightsError(f"{source}: write Hugging Face sources as hf://OWNER/REPO/FILE")
        download_hf(repo, filename, revision, partial)
    else:
        local = Path(source)
        if not local.is_file():
            raise WeightsError(f"{source} is neither a URL, an hf:// source nor a file")
        check_disk(partial.parent, local.stat().st_size)
        shutil.copyfile(local, partial)


def verified_partial(partial: Path, sha256: str | None, size: int | None) -> bool:
    """A download kept from an earlier run because it matched its pin (see fetch)."""
    return (
        bool(sha256)
        and partial.is_file()
        and size in (None, partial.stat().st_size)
        and sha256_of(partial) == sha256.lower()
    )


def fetch(
    source: str,
    target: Path,
    sha256: str | None,
    backend: str = "cuda",
    expected_size: int | None = None,
    revision: str | None = None,
    timeout: float = 60,
    engine: str = "mainline",
    catalog_name: str | None = None,
) -> dict:
    """Bring source to target, judged by `engine`'s checks; returns the manifest. Raises
    WeightsError with the target untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest_file = manifest_path(target)
    placed_by_hand = target.is_file() and not manifest_file.is_file()
    if placed_by_hand and sha256 and sha256_of(target) == sha256.lower():
        print(f"fetch: {target} is already in place (matches the pin); recording a manifest")
        summary = verify(target, backend, engine=engine)
        return write_manifest(target, source, sha256.lower(), summary, 0.0, True, catalog_name)
    if target.is_file() and manifest_file.is_file():
        manifest = json.loads(manifest_file.read_text())
        if (
            manifest.get("sha256") == (sha256 or manifest.get("sha256"))
            and manifest.get("bytes") == target.stat().st_size
        ):
            print(f"fetch: {target} is already in place (manifest matches); nothing to do")
            return manifest
    started = time.monotonic()
    partial = target.with_name(target.name + ".partial")
    if verified_partial(partial, sha256, expected_size):
        print(f"fetch: using {partial.name}, downloaded earlier and matching the pin")
    else:
        download(source, partial, expected_size, revision, timeout)

    actual_size = partial.stat().st_size
    if expected_size is not None and actual_size != expected_size:
        partial.unlink()
        raise WeightsError(
            f"{source} gave {actual_size} bytes, the pin says {expected_size}: upstream changed "
            "the file or the pin is wrong; nothing was kept"
        )
    actual = sha256_of(partial)
    if sha256 and actual != sha256.lower():
        partial.unlink()
        raise WeightsError(
            f"checksum mismatch for {source}: expected {sha256}, got {actual}: the download is "
            "corrupt or the pin is wrong; nothing was kept, run again to download afresh"
        )
    try:
        summary = verify(partial, backend, engine=engine)
    except WeightsError as exc:
        if not sha256:
            partial.unlink()
            raise
        # The bytes are the pinned ones: what failed is the configuration, not the download.
        raise WeightsError(
            f"{exc} (the download matches its pinned SHA-256 and is kept as {partial}: "
            "the next run uses it without downloading again)"
        ) from exc
    place(partial, target)
    write_manifest(
        target,
        source,
        actual,
        summary,
        time.monotonic() - started,
        bool(sha256),
        catalog_name,
    )
    print(
        f"fetch: {target} in place: sha256 {actual}"
        + ("" if sha256 else " (not pinned: record it to pin this file)")
    )
    return json.loads(manifest_file.read_text())


def fetch_by_name(
    name: str,
    target: Path,
    backend: str,
    catalog: Catalog,
    lock_file: Path,
    engine_repo: str,
    sha256: str | None = None,
    revision: str | None = None,
) -> dict:
    """Fetch a catalog model; a first verified fetch of an unpinned model pins it in the lock."""
    entry = catalog[name]
    check_engine(entry, engine_repo)
    locked = read_lock(lock_file).get(name, {})
    pin = sha256 or entry.sha256 or locked.get("sha256")
    manifest = fetch(
        entry.source,
        target,
        pin,
        backend,
        entry.size_bytes or locked.get("bytes"),
        revision,
        engine=engine_family(engine_repo),
        catalog_name=name,
    )
    if not pin:
        pin_in_lock(lock_file, name, manifest)
        print(f"fetch: pinned {name} in {lock_file.name}: sha256 {manifest['sha256']}")
    return manifest


def obtain(source: str, target: Path, args: argparse.Namespace) -> dict:
    """Fetch source (a catalog name or a location) to target, as the command line asked."""
    catalog = load_catalog(args.catalog)
    engine_repo = args.engine_repo or configured_engine_repo(args.env_file)
    if source in catalog:
        lock = args.lock or target.parent / LOCK_NAME
        return fetch_by_name(
            source, target, args.backend, catalog, lock, engine_repo, args.sha256, args.revision
        )
    check_name(source, catalog)
    return fetch(
        source,
        target,
        args.sha256,
        args.backend,
        args.size,
        args.revision,
        engine=engine_family(engine_repo),
    )


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--sha256", help="expected SHA-256 (strongly recommended)")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", type=int, help="expected size in bytes (checked)")
    ap.add_argument("--revision", help="Hugging Face revision (commit) to pin")
    ap.add_argument("--catalog", type=Path, default=CATALOG_FILE)
    ap.add_argument(
        "--lock", type=Path, help=f"first-fetch pins (default: {LOCK_NAME} beside the target)"
    )
    ap.add_argument(
        "--engine-repo",
        help="the engine the stack runs, whose checks judge the file (default: from --env-file)",
    )
    ap.add_argument(
        "--env-file", type=Path, default=ENV_FILE, help="the stack's config, for the engine"
    )
    return ap


def run_reporting(action, source: str, command: str = "fetch") -> int:
    """action's outcome as the command's exit status; a transfer that broke off is resumable."""

    def job() -> int:
        try:
            action()
        except requests.RequestException as exc:
            raise WeightsError(
                f"{source}: {exc}: the partial download is kept; run again to resume"
            ) from exc
        return 0

    return errors.run(command, job)


def main(argv: list[str] | None = None) -> int:
    ap = parser("ternary-serve fetch", __doc__.splitlines()[0])
    ap.add_argument(
        "source", help="a models.yaml name, an https:// URL, hf://OWNER/REPO/FILE, or a local path"
    )
    ap.add_argument("target", type=Path, help="where the GGUF goes, e.g. models/model.gguf")
    args = ap.parse_args(argv)
    return run_reporting(lambda: obtain(args.source, args.target, args), args.source)
