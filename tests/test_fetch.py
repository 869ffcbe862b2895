"""Fetching weights from a local HTTP server: resume after an interruption, checksum refusal, and
nothing ever left at the final path after a failure."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from ternary_serve import fetch, synthetic
from ternary_serve.catalog import check_engine, load_catalog
from ternary_serve.weights import WeightsError, check_disk

MAINLINE = "https://github.com/ggml-org/llama.cpp"
FORK = "https://github.com/PrismML-Eng/llama.cpp"


class FileServer:
    """Serves one payload at /model.gguf; can cut the first response short; honours Range."""

    def __init__(self, payload: bytes, cut_first_at: int | None = None, ranges: bool = True):
        self.payload, self.cut_first_at, self.ranges = payload, cut_first_at, ranges
        self.range_headers: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path != "/model.gguf":
                    self.send_error(404)
                    return
                header = self.headers.get("Range")
                outer.range_headers.append(header)
                start = 0
                match = re.fullmatch(r"bytes=(\d+)-", header or "")
                if match and outer.ranges:
                    start = int(match.group(1))
                    if start >= len(outer.payload):
                        self.send_response(416)
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header(
                        "Content-Range",
                        f"bytes {start}-{len(outer.payload) - 1}/{len(outer.payload)}",
                    )
                else:
                    self.send_response(200)
                body = outer.payload[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.cut_first_at is not None:
                    cut, outer.cut_first_at = outer.cut_first_at, None
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/model.gguf"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def served(tiny_model):
    servers = []

    def start(**kwargs) -> FileServer:
        server = FileServer(tiny_model.read_bytes(), **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="module")
def fork_file(tmp_path_factory):
    """The stand-in for Bonsai 2's PQ2_0 file: the tiny qwen35 model, linear tensors typed 142."""
    path = tmp_path_factory.mktemp("fork") / "bonsai-standin-PQ2_0.gguf"
    return synthetic.write_fork_packed(path, "PQ2_0")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_interrupted_download_resumes_and_lands_verified(served, tiny_model, tmp_path):
    payload = tiny_model.read_bytes()
    server = served(cut_first_at=len(payload) // 3)
    target = tmp_path / "model.gguf"
    with pytest.raises(requests.RequestException):
        fetch.fetch(server.url, target, sha(payload), backend="cpu")
    assert not target.exists()
    partial = tmp_path / "model.gguf.partial"
    assert 0 < partial.stat().st_size < len(payload)

    manifest = fetch.fetch(server.url, target, sha(payload), backend="cpu")
    assert server.range_headers[-1] == f"bytes={partial_len(server)}-"
    assert target.read_bytes() == payload
    assert manifest["sha256"] == sha(payload) and manifest["sha256_pinned"]
    assert leftovers(tmp_path) == ["model.gguf", "model.gguf.manifest.json"]


def partial_len(server: FileServer) -> int:
    return int(server.range_headers[-1].removeprefix("bytes=").removesuffix("-"))


def test_server_without_range_support_restarts_cleanly(served, tiny_model, tmp_path):
    payload = tiny_model.read_bytes()
    server = served(cut_first_at=1000, ranges=False)
    target = tmp_path / "model.gguf"
    with pytest.raises(requests.RequestException):
        fetch.fetch(server.url, target, sha(payload), backend="cpu")
    fetch.fetch(server.url, target, sha(payload), backend="cpu")
    assert target.read_bytes() == payload


def test_checksum_mismatch_leaves_nothing_behind(served, tmp_path):
    server = served()
    target = tmp_path / "model.gguf"
    with pytest.raises(WeightsError, match="checksum mismatch.*run again"):
        fetch.fetch(server.url, target, "0" * 64, backend="cpu")
    assert leftovers(tmp_path) == []


def test_checksum_mismatch_keeps_the_previous_good_file(served, tiny_model, tmp_path):
    server = served()
    target = tmp_path / "model.gguf"
    fetch.fetch(server.url, target, sha(tiny_model.read_bytes()), backend="cpu")
    before = target.read_bytes()
    with pytest.raises(WeightsError, match="checksum mismatch"):
        fetch.fetch(server.url, target, "f" * 64, backend="cpu")
    assert target.read_bytes() == before


def test_a_non_gguf_answer_is_refused_even_unpinned(tmp_path):
    server = FileServer(b"<html>login required</html>")
    try:
        with pytest.raises(WeightsError, match="not a GGUF file"):
            fetch.fetch(server.url, tmp_path / "model.gguf", None, backend="cpu")
    finally:
        server.close()
    assert leftovers(tmp_path) == []


def test_rerun_with_a_matching_manifest_does_nothing(served, tiny_model, tmp_path, capsys):
    server = served()
    target = tmp_path / "model.gguf"
    fetch.fetch(server.url, target, sha(tiny_model.read_bytes()), backend="cpu")
    requests_before = len(server.range_headers)
    manifest = fetch.fetch(server.url, target, sha(tiny_model.read_bytes()), backend="cpu")
    assert len(server.range_headers) == requests_before
    assert "nothing to do" in capsys.readouterr().out
    assert json.loads((tmp_path / "model.gguf.manifest.json").read_text()) == manifest


def test_local_path_source_and_http_error(served, tiny_model, tmp_path):
    fetch.fetch(str(tiny_model), tmp_path / "copy.gguf", sha(tiny_model.read_bytes()), "cpu")
    assert (tmp_path / "copy.gguf").read_bytes() == tiny_model.read_bytes()
    server = served()
    with pytest.raises(WeightsError, match="HTTP 404"):
        fetch.fetch(server.url.replace("model.gguf", "other.gguf"), tmp_path / "x.gguf", None)


def test_too_little_disk_names_the_fix(tmp_path):
    with pytest.raises(WeightsError, match="free space there or set MODEL_DIR"):
        check_disk(tmp_path, 2**60)


def test_cli_reports_one_line(tmp_path, capsys):
    assert fetch.main(["/no/such/file.gguf", str(tmp_path / "m.gguf")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fetch: ") and "\n" not in err


def test_a_mistyped_name_lists_the_catalog_and_the_closest(tmp_path, capsys):
    """`make model MODEL=...`, and model-init in the deploy's model check."""
    assert fetch.main(["bonsai-4b", str(tmp_path / "m.gguf"), "--backend", "cpu"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("fetch: bonsai-4b is not a model in models.yaml: did you mean "
                          "bonsai-4b-q2_0? its models: "), err  # fmt: skip
    assert "\n" not in err and all(name in err for name in load_catalog().models), err
    assert list(tmp_path.iterdir()) == []


# --- the catalog ---------------------------------------------------------------------------------


def test_every_shipped_model_is_fetchable_gated_and_the_27b_verified():
    """What picking a model by name relies on, whatever the entries say: each source is one the
    Hub client accepts (a typo in the repository id fails here, not on the operator's box), each
    model's answers must pass a non-empty quality gate, and the product's target (both 27B files)
    is pinned by size and digest, so its first download is verified and the preflight knows its
    size. The pinned values themselves are checked only by a fetch on a box that reaches the Hub."""
    from huggingface_hub.utils import validate_repo_id

    catalog = load_catalog()
    for entry in catalog.models.values():
        assert entry.source.startswith("hf://") and entry.source.endswith(".gguf"), entry
        repo, _, filename = entry.source.removeprefix("hf://").rpartition("/")
        validate_repo_id(repo)
        assert filename and catalog.quality_gates[entry.quality_gate], entry
    targets = [entry for name, entry in catalog.models.items() if name.startswith("bonsai-2-27b")]
    assert len(targets) == 2
    assert all(entry.sha256 and entry.size_bytes for entry in targets), targets


def test_prismml_model_refused_for_a_mainline_engine():
    entry = load_catalog()["bonsai-2-27b-pq2_0"]
    with pytest.raises(WeightsError, match="needs the PrismML engine"):
        check_engine(entry, MAINLINE)
    check_engine(entry, FORK)


def catalog_with(tmp_path, url: str, **pins) -> Path:
    lines = [f"models:\n  tiny:\n    source: {url}\n    engine: prismml\n"]
    lines += [f"    {key}: {json.dumps(value)}\n" for key, value in pins.items()]
    path = tmp_path / "models.yaml"
    path.write_text("".join(lines))
    return path


@pytest.mark.parametrize("wrong", ["bytes", "sha256"])
def test_catalog_fetch_that_does_not_match_its_pins_leaves_nothing(fork_file, tmp_path, wrong):
    payload = fork_file.read_bytes()
    server = FileServer(payload)
    pins = {"bytes": len(payload), "sha256": sha(payload)}
    pins[wrong] = len(payload) + 1 if wrong == "bytes" else "0" * 64
    catalog = load_catalog(catalog_with(tmp_path, server.url, **pins))
    models = tmp_path / "models"
    try:
        with pytest.raises(WeightsError, match="the pin says|checksum mismatch"):
            fetch.fetch_by_name("tiny", models / "m.gguf", "cuda", catalog, models / "l", FORK)
    finally:
        server.close()
    assert leftovers(models) == []


def test_catalog_digest_that_yaml_reads_as_a_number_is_refused(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n  tiny:\n    source: x\n    engine: mainline\n    sha256: " + "0" * 64
    )
    with pytest.raises(WeightsError, match="64 hex digits in quotes"):
        load_catalog(path)


def test_fork_packed_file_is_kept_with_the_fork_and_refused_with_mainline(fork_file, tmp_path):
    """Bonsai 2's packing (tensor types 142/143, unknown to every gguf-py) judged by the engine."""
    payload = fork_file.read_bytes()
    server = FileServer(payload)
    try:
        mainline = tmp_path / "mainline"
        with pytest.raises(WeightsError, match="only the prismml engine runs.*PrismML engine"):
            fetch.fetch(server.url, mainline / "m.gguf", None, "cuda", engine="mainline")
        assert leftovers(mainline) == []

        fork = tmp_path / "fork"
        manifest = fetch.fetch(server.url, fork / "m.gguf", sha(payload), "cuda", engine="prismml")
        assert leftovers(fork) == ["m.gguf", "m.gguf.manifest.json"]
        assert (fork / "m.gguf").read_bytes() == payload
        assert manifest["engine_checked"] == "prismml" and manifest["architecture"] == "qwen35"
        assert "PQ2_0" in manifest["tensor_types"]
    finally:
        server.close()


def test_a_pinned_download_the_engine_refuses_is_kept_and_not_fetched_again(fork_file, tmp_path):
    """Engine misconfigured, right bytes: fixing the engine must not cost a second download."""
    payload = fork_file.read_bytes()
    server = FileServer(payload)
    target = tmp_path / "m.gguf"
    try:
        with pytest.raises(WeightsError, match="kept as .*m.gguf.partial"):
            fetch.fetch(server.url, target, sha(payload), "cuda", len(payload), engine="mainline")
        assert leftovers(tmp_path) == ["m.gguf.partial"]
        requests_before = len(server.range_headers)
        fetch.fetch(server.url, target, sha(payload), "cuda", len(payload), engine="prismml")
        assert len(server.range_headers) == requests_before
        assert leftovers(tmp_path) == ["m.gguf", "m.gguf.manifest.json"]
    finally:
        server.close()


def test_first_fetch_pins_the_lock_and_later_fetches_enforce_it(served, tiny_model, tmp_path):
    server = served()
    catalog_file = tmp_path / "models.yaml"
    catalog_file.write_text(f"models:\n  tiny:\n    source: {server.url}\n    engine: mainline\n")
    catalog, lock = load_catalog(catalog_file), tmp_path / "models.lock.json"
    engine = MAINLINE
    fetch.fetch_by_name("tiny", tmp_path / "a.gguf", "cpu", catalog, lock, engine)
    pinned = json.loads(lock.read_text())["tiny"]
    assert pinned["sha256"] == sha(tiny_model.read_bytes())

    server.payload = server.payload[:-1] + b"\x00"  # the upstream file changed under the same name
    with pytest.raises(WeightsError, match="checksum mismatch"):
        fetch.fetch_by_name("tiny", tmp_path / "b.gguf", "cpu", catalog, lock, engine)
    assert not (tmp_path / "b.gguf").exists()
    assert json.loads(lock.read_text())["tiny"] == pinned
