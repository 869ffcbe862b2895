"""Fetch model weights into MODEL_DIR: resumable, checksummed, verified, placed atomically.

Sources: a Hugging Face repo file (huggingface_hub; HF_TOKEN optional), an http(s) URL, or a local
path. The download goes to `<name>.partial` beside the target and resumes from there; only a file
whose SHA-256 matches the pin and that passes the GGUF checks is renamed into place, so a half or
wrong file never sits at the final path. A manifest (`<name>.manifest.json`) records what was
placed; a rerun that finds the target matching its manifest and pin does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import requests
import urllib3

from ternary_serve.weights import WeightsError, verify

CHUNK = 8 * 2**20
PROGRESS_EVERY_S = 5.0
# Room left free on the disk beyond the file itself (logs, the server's temporary files).
DISK_MARGIN = 2 * 2**30


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


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_disk(directory: Path, needed: int) -> None:
    free = shutil.disk_usage(directory).free
    if free < needed + DISK_MARGIN:
        raise WeightsError(
            f"{directory} has {free / 2**30:.1f} GiB free, the download needs "
            f"{(needed + DISK_MARGIN) / 2**30:.1f} GiB: free space there or set MODEL_DIR elsewhere"
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
        check_disk(partial.parent, (total or 0) - have)
        progress = Progress(partial.name.removesuffix(".partial"), total, have)
        with partial.open("ab" if have else "wb") as out:
            try:
                # read1 hands over what has arrived, so a broken connection loses nothing written.
                while chunk := resp.raw.read1(CHUNK):
                    out.write(chunk)
                    progress.update(len(chunk))
            except urllib3.exceptions.HTTPError as exc:
                raise requests.ConnectionError(f"connection lost: {exc}") from exc
            finally:
                out.flush()
                os.fsync(out.fileno())
        progress.update(0, final=True)
        if total is not None and partial.stat().st_size != total:
            raise WeightsError(
                f"download of {url} stopped at {partial.stat().st_size} of {total} bytes: "
                "run the same command again to resume"
            )


def download_hf(repo: str, filename: str, revision: str | None, partial: Path) -> None:
    """Fetch through huggingface_hub (resumable, cached), then copy into partial."""
    from huggingface_hub import hf_hub_download

    cached = Path(
        hf_hub_download(
            repo_id=repo, filename=filename, revision=revision, token=os.environ.get("HF_TOKEN")
        )
    )
    check_disk(partial.parent, cached.stat().st_size)
    shutil.copyfile(cached, partial)


def place(partial: Path, target: Path) -> None:
    os.replace(partial, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def manifest_path(target: Path) -> Path:
    return target.with_name(target.name + ".manifest.json")


def fetch(
    source: str,
    target: Path,
    sha256: str | None,
    backend: str = "cuda",
    expected_size: int | None = None,
    revision: str | None = None,
    timeout: float = 60,
) -> dict:
    """Bring source to target; returns the manifest. Raises WeightsError, target untouched."""
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest_file = manifest_path(target)
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
    if source.startswith(("http://", "https://")):
        download_url(source, partial, expected_size, timeout)
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

    actual = sha256_of(partial)
    if sha256 and actual != sha256.lower():
        partial.unlink()
        raise WeightsError(
            f"checksum mismatch for {source}: expected {sha256}, got {actual}: the download is "
            "corrupt or the pin is wrong; run again to download afresh"
        )
    try:
        summary = verify(partial, backend)
    except WeightsError:
        partial.unlink()
        raise
    place(partial, target)
    manifest = {
        "source": source,
        "path": str(target),
        "sha256": actual,
        "bytes": target.stat().st_size,
        "sha256_pinned": bool(sha256),
        "architecture": summary["architecture"],
        "tensor_types": summary["tensor_types"],
        "backend_checked": backend,
        "seconds": round(time.monotonic() - started, 1),
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = manifest_file.with_name(manifest_file.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    place(tmp, manifest_file)
    print(
        f"fetch: {target} in place: sha256 {actual}"
        + ("" if sha256 else " (not pinned: record it to pin this file)")
    )
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve fetch", description=__doc__.splitlines()[0])
    ap.add_argument("source", help="https://… URL, hf://OWNER/REPO/FILE, or a local path")
    ap.add_argument("target", type=Path, help="where the GGUF goes, e.g. models/model.gguf")
    ap.add_argument("--sha256", help="expected SHA-256 (strongly recommended)")
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--size", type=int, help="expected size in bytes, for the disk-space check")
    ap.add_argument("--revision", help="Hugging Face revision (commit) to pin")
    args = ap.parse_args(argv)
    try:
        fetch(args.source, args.target, args.sha256, args.backend, args.size, args.revision)
    except WeightsError as exc:
        print(f"fetch: {exc}", file=sys.stderr)
        return 1
    except requests.RequestException as exc:
        print(
            f"fetch: {args.source}: {exc}: the partial download is kept; run again to resume",
            file=sys.stderr,
        )
        return 1
    return 0
