"""The requests that measure a live server, shared by the release's decode gate and bench: the
served model, one streamed chat request timed by the server's own usage and timings, the gate's
short decode benchmark."""

from __future__ import annotations

import statistics
import time

import requests

from ternary_serve import errors
from ternary_serve.client import Endpoint


class ProbeError(errors.ServeError):
    """A measuring request that did not give a measurement; the message says why."""


def one_request(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    started = time.monotonic()
    first = None
    usage = timings = None
    text = []
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        # Every request generates max_tokens: comparable runs; thinking off: chat templates that
        # think first would hide the first token.
        extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    for chunk in stream:
        piece = (chunk.choices[0].delta.content or "") if chunk.choices else ""
        if first is None and piece:
            first = time.monotonic()
        text.append(piece)
        usage = chunk.usage or usage
        timings = (chunk.model_extra or {}).get("timings") or timings
    if usage is None or timings is None:
        raise ProbeError("the stream ended without the server's usage and timings")
    return {
        "ttft_s": (first or time.monotonic()) - started,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens": usage.prompt_tokens,
        # Of the prompt, what the server evaluated and what it reused from the slot's state.
        "prompt_evaluated": timings.get("prompt_n"),
        "prompt_reused": timings.get("cache_n"),
        "decode_tokens_per_s": timings.get("predicted_per_second"),
        "seconds": time.monotonic() - started,
        "text": "".join(text),
    }


def user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def decode_rate(api: Endpoint, requests_n: int = 3, max_tokens: int = 64) -> float:
    """The release gate's short benchmark: the median decode rate (tokens/s, the server's own
    timings) of requests_n single requests of max_tokens tokens each, one after another."""
    import openai

    client = api.openai(timeout=120, max_retries=0)
    model = served_model(api)
    rates = []
    for request in range(requests_n):
        prompt = f"Request {request}. Count upwards from one, separated by spaces:"
        try:
            done = one_request(client, model, user(prompt), max_tokens)
        except openai.OpenAIError as exc:
            raise ProbeError(f"a measuring request failed: {type(exc).__name__}: {exc}") from None
        if done["decode_tokens_per_s"]:
            rates.append(done["decode_tokens_per_s"])
    if not rates:
        raise ProbeError("the server reported no decode timing")
    return statistics.median(rates)


def served_model(api: Endpoint) -> str:
    try:
        with api.session() as http:
            return http.get(f"{api.url}/v1/models", timeout=10).json()["data"][0]["id"]
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise ProbeError(
            f"no server answers at {api.url} ({exc}): deploy first (make up)"
        ) from None
