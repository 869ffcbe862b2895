"""Smoke test an OpenAI-compatible llama-server: health, model list, streamed chat round trips, and
a quality gate: questions with known answers, since a server that streams gibberish streams fine.

Reports time to first token and decode tokens/s per prompt and each gate answer. Any failure
prints one line saying which check failed and why, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import requests

from ternary_serve import credentials, errors
from ternary_serve.catalog import CATALOG_FILE, Catalog, Question, load_catalog
from ternary_serve.files import write_json

# The gate for models the catalog does not name (a URL, a local file): most serve chat models.
DEFAULT_GATE = "chat"
GATE_MAX_TOKENS = 64

PROMPTS = {
    # A CJK prompt exercises multi-byte tokenization and UTF-8 streaming.
    "zh": "用一句话介绍你自己。",
    "code": "Write a Python function that returns the n-th Fibonacci number.",
}


class SmokeFailure(errors.ServeError):
    """One failed check; the message names the check and what came back."""


@dataclass
class RoundTrip:
    prompt: str
    completion_tokens: int
    ttft_s: float
    decode_tokens_per_s: float | None
    decode_measured_by: str
    finish_reason: str
    text: str


def _json(resp: requests.Response, what: str) -> dict:
    try:
        body = resp.json()
    except ValueError as exc:
        raise SmokeFailure(
            f"{what}: HTTP {resp.status_code}, body is not JSON: {resp.text[:120]!r}"
        ) from exc
    if not isinstance(body, dict):
        raise SmokeFailure(f"{what}: expected a JSON object, got {type(body).__name__}")
    return body


def check_health(session: requests.Session, base: str, timeout: float) -> None:
    resp = session.get(f"{base}/health", timeout=timeout)
    body = _json(resp, "GET /health")
    if resp.status_code != 200 or body.get("status") != "ok":
        raise SmokeFailure(f"GET /health: HTTP {resp.status_code} {body}: server is not ready")


def list_models(session: requests.Session, base: str, timeout: float) -> list[str]:
    resp = session.get(f"{base}/v1/models", timeout=timeout)
    body = _json(resp, "GET /v1/models")
    data = body.get("data")
    if resp.status_code != 200 or not isinstance(data, list) or not data:
        raise SmokeFailure(f"GET /v1/models: HTTP {resp.status_code}, no models listed: {body}")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if not all(isinstance(i, str) and i for i in ids):
        raise SmokeFailure(f"GET /v1/models: entries without an id: {data}")
    return ids


def _sse_events(resp: requests.Response):
    for raw in resp.iter_lines(decode_unicode=False):
        if not raw:
            continue
        line = raw.decode("utf-8")
        if not line.startswith("data:"):
            raise SmokeFailure(f"chat stream: expected 'data:' lines, got {line[:120]!r}")
        payload = line[5:].strip()
        if payload == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except ValueError as exc:
            raise SmokeFailure(f"chat stream: event is not JSON: {payload[:120]!r}") from exc
    raise SmokeFailure("chat stream: ended without [DONE]")


def chat_round_trip(
    session: requests.Session,
    base: str,
    model: str,
    name: str,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool,
    timeout: float,
) -> RoundTrip:
    what = f"chat[{name}]"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True  # llama-server extension: fixed-length decode for measurements
    started = time.perf_counter()
    resp = session.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=timeout)
    if resp.status_code != 200:
        raise SmokeFailure(f"{what}: HTTP {resp.status_code}: {resp.text[:200]!r}")
    first = last = None
    pieces: list[str] = []
    chunks = 0
    usage_tokens = None
    server_decode = None
    finish_reason = None
    for event in _sse_events(resp):
        if not isinstance(event, dict):
            raise SmokeFailure(f"{what}: stream event is not an object: {event!r}")
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
        if isinstance(event.get("timings"), dict):  # llama-server's own decode timing
            server_decode = event["timings"].get("predicted_per_second")
        choices = event.get("choices")
        if not isinstance(choices, list):
            raise SmokeFailure(f"{what}: stream event without choices: {str(event)[:160]}")
        for choice in choices:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                raise SmokeFailure(f"{what}: choice without a delta: {str(choice)[:160]}")
            text = delta.get("content") or delta.get("reasoning_content")
            if text:
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
                pieces.append(text)
            finish_reason = choice.get("finish_reason") or finish_reason
    tokens = usage_tokens if isinstance(usage_tokens, int) else chunks
    if tokens < 1 or first is None:
        raise SmokeFailure(f"{what}: the server generated no tokens")
    if finish_reason not in ("stop", "length"):
        raise SmokeFailure(f"{what}: finish_reason {finish_reason!r}, expected stop or length")
    # Chunks can arrive in bursts, so the server's timing is preferred over arrival times.
    if isinstance(server_decode, (int, float)):
        decode, measured_by = float(server_decode), "server"
    elif tokens > 1 and last > first:
        decode, measured_by = (tokens - 1) / (last - first), "client"
    else:
        decode, measured_by = None, "n/a"
    return RoundTrip(
        name, tokens, first - started, decode, measured_by, finish_reason, "".join(pieces)
    )


def choose_gate(setting: str, model: Path | None, catalog: Catalog) -> tuple[tuple, str]:
    """The questions to ask, and why those: QUALITY_GATE if set, else the model's catalog entry
    (named in its manifest), else the default; none for a synthetic model, which says so."""
    if setting != "auto":
        if setting not in catalog.quality_gates:
            known = ", ".join(["auto", *catalog.quality_gates])
            raise SmokeFailure(f"quality gate {setting!r} is not defined: choose one of {known}")
        return catalog.quality_gates[setting], f"QUALITY_GATE={setting}"
    if model is not None:
        from ternary_serve.weights import WeightsError, is_synthetic, manifest_path

        try:
            if is_synthetic(model):
                return (), "synthetic model (random weights): it has no answers to check"
        except WeightsError as exc:
            raise SmokeFailure(f"quality gate: cannot read the served model: {exc}") from exc
        manifest = manifest_path(model)
        name = json.loads(manifest.read_text()).get("catalog_name") if manifest.is_file() else None
        if name in catalog:
            gate = catalog[name].quality_gate
            return catalog.quality_gates[gate], f"catalog entry {name} ({gate})"
    return catalog.quality_gates.get(DEFAULT_GATE, ()), f"default ({DEFAULT_GATE})"


def ask(session: requests.Session, base: str, model: str, q: Question, timeout: float) -> dict:
    """One gate question at temperature 0, thinking off; the answer must contain q.expect."""
    what = f"quality[{q.name}]"
    resp = session.post(
        f"{base}/v1/chat/completions",
        timeout=timeout,
        json={
            "model": model,
            "messages": [{"role": "user", "content": q.prompt}],
            "temperature": 0,
            "max_tokens": GATE_MAX_TOKENS,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    body = _json(resp, what)
    try:
        message = body["choices"][0]["message"]
        answer = message.get("content") or message.get("reasoning_content") or ""
    except (KeyError, IndexError, TypeError, AttributeError) as exc:
        raise SmokeFailure(f"{what}: HTTP {resp.status_code}, no message: {body}") from exc
    if q.expect.casefold() not in answer.casefold():
        raise SmokeFailure(
            f"{what}: expected {q.expect!r} in the answer to {q.prompt!r}, got {answer[:120]!r}: "
            "the model answers wrongly or in gibberish (a file packed for another engine?)"
        )
    return {"name": q.name, "expect": q.expect, "answer": answer.strip()[:120]}


def run(
    base: str,
    max_tokens: int,
    ignore_eos: bool,
    timeout: float,
    gate: tuple[tuple, str] = ((), "not asked"),
    api_key: str | None = None,
) -> dict:
    base = base.rstrip("/")
    questions, why = gate
    with requests.Session() as session:
        if api_key:
            session.headers["Authorization"] = f"Bearer {api_key}"
        try:
            check_health(session, base, timeout)
            models = list_models(session, base, timeout)
            trips = [
                chat_round_trip(
                    session, base, models[0], name, prompt, max_tokens, ignore_eos, timeout
                )
                for name, prompt in PROMPTS.items()
            ]
            answers = [ask(session, base, models[0], q, timeout) for q in questions]
        except requests.RequestException as exc:
            raise SmokeFailure(f"cannot reach {base}: {exc}") from exc
    return {
        "url": base,
        "model": models[0],
        "round_trips": [asdict(t) for t in trips],
        "quality": {"gate": why, "answers": answers},
    }


def format_report(report: dict) -> str:
    lines = [
        f"smoke: {report['url']} model={report['model']}",
        f"{'prompt':<8} {'tokens':>6} {'ttft_ms':>9} {'decode_tok/s':>13} finish",
    ]
    for t in report["round_trips"]:
        decode = f"{t['decode_tokens_per_s']:.1f}" if t["decode_tokens_per_s"] else "n/a"
        lines.append(
            f"{t['prompt']:<8} {t['completion_tokens']:>6} {t['ttft_s'] * 1000:>9.1f} "
            f"{decode:>13} {t['finish_reason']}"
        )
    quality = report["quality"]
    if not quality["answers"]:
        lines.append(f"quality: skipped: {quality['gate']}")
    for a in quality["answers"]:
        lines.append(f"quality[{a['name']}]: ok ({a['expect']!r} in {a['answer']!r})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve smoke", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server base URL (Compose passes the stack's)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="decode exactly --max-tokens tokens (for throughput numbers)",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument(
        "--api-key-file", type=Path, help="the server's API key (sent as a bearer token)"
    )
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("--model", type=Path, help="the served model file: it picks the quality gate")
    ap.add_argument(
        "--quality-gate",
        default="auto",
        help="auto (the model's catalog entry, none for synthetic models), none, or a gate name "
        "from the catalog",
    )
    ap.add_argument("--catalog", type=Path, default=CATALOG_FILE)
    args = ap.parse_args(argv)

    def smoke_and_report() -> int:
        gate = choose_gate(args.quality_gate, args.model, load_catalog(args.catalog))
        api_key = credentials.read_api_key(args.api_key_file) if args.api_key_file else None
        report = run(args.url, args.max_tokens, args.ignore_eos, args.timeout, gate, api_key)
        print(format_report(report))
        if args.json:
            write_json(args.json, report)
        print("smoke: PASS")
        return 0

    # "FAIL" is what a reader of the sidecar's log (and the release's last line) looks for.
    return errors.run("smoke: FAIL", smoke_and_report)
