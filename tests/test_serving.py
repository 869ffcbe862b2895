"""Serving many users on the real llama-server: each workload profile's flags on the live server,
no user served another user's conversation, and backend sampling choosing what CPU sampling
chooses.

The CPU stack (compose.cpu.yaml) with the tiny qwen35 model (Bonsai 2's hybrid DeltaNet and
attention architecture, random ternary weights), planned for several slots. Random weights answer
nothing, but their greedy continuation is deterministic and depends on the whole prompt: that is
all these tests read. What runs only on a real box: the CUDA backend's sampler kernels (here the
CPU backend runs the same sampler graph) and the GPU speed of each profile (docs/bench.md).
"""

from __future__ import annotations

import json
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from scipy.stats import chi2_contingency

pytestmark = pytest.mark.docker

SLOTS = 4
WORDS = ["the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was", "for"]


def serving(stack_for, tiny_model, **settings):
    stack = stack_for(tiny_model, SLOTS=str(SLOTS), **settings)
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "llama-server")
    assert up.returncode == 0, up.stderr[-3000:]
    return stack


def conversation(user: str, n: int, words: int = 60) -> str:
    """One user's prompt: a few hundred tokens (this vocabulary is about a token a character)."""
    rng = random.Random(f"{user}-{n}")
    return f"{user} {n}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "\n"


def complete(stack, prompt: str, **params) -> dict:
    """llama-server's own /completion: the token ids, the settings the request ran with."""
    body = {"prompt": prompt, "n_predict": 24, "temperature": 0, "return_tokens": True, **params}
    reply = stack.api().post(f"{stack.url}/completion", json=body, timeout=300)
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()


def chat(stack, messages: list[dict], **params) -> dict:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **params}
    reply = stack.api().post(f"{stack.url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()


# --- workload profiles ----------------------------------------------------------------------------


@pytest.mark.parametrize("workload", ["api", "chat"])
def test_the_workload_profile_reaches_the_live_server(stack_for, tiny_model, workload):
    """chat keeps context checkpoints, so a follow-up turn reuses the conversation's prompt (on
    a hybrid model nothing else can); api keeps none, so the turn is evaluated again. Both sample
    on the backend; the host prompt cache is off in both."""
    stack = serving(stack_for, tiny_model, WORKLOAD=workload)
    props = stack.api().get(f"{stack.url}/props", timeout=30).json()
    assert props["default_generation_settings"]["params"]["backend_sampling"] is True
    history = [
        {"role": "system", "content": "You answer briefly. " * 40},
        {"role": "user", "content": "Name a colour."},
    ]
    first = chat(stack, history)
    history += [first["choices"][0]["message"], {"role": "user", "content": "Another one?"}]
    second = chat(stack, history)
    reused = second["timings"]["cache_n"]
    if workload == "chat":
        assert reused > 100, second["timings"]
    else:
        assert reused == 0, second["timings"]


# --- no conversation served to the wrong user -----------------------------------------------------

ROUNDS = 4


@pytest.mark.parametrize(
    "prompt_cache",
    [
        "off",
        pytest.param(
            "on",
            marks=pytest.mark.xfail(
                strict=False,
                reason="ggml-org/llama.cpp#27148: the host prompt cache can restore another "
                "user's finished conversation into a new request (why PROMPT_CACHE is off); "
                "XPASS: not reproduced with this engine, model and load",
            ),
        ),
    ],
)
def test_no_user_is_served_another_users_conversation(stack_for, tiny_model, prompt_cache):
    """User B's greedy completion, after rounds of user A's different conversations have filled
    every slot and ended (and while more of them run), is token for token what B got from the
    freshly started server. A leak of A's state into B's slot changes B's tokens."""
    stack = serving(stack_for, tiny_model, PROMPT_CACHE=prompt_cache)
    b_prompt = conversation("B", 0)
    fresh = complete(stack, b_prompt)["tokens"]
    assert len(fresh) == 24
    a_prompts = iter(conversation("A", n, words=40 + 7 * n) for n in range(10**6))
    later = []
    with ThreadPoolExecutor(2 * SLOTS) as pool:
        for _ in range(ROUNDS):
            # A's conversations take every slot and finish: their states are what a cache keeps.
            finished = [next(a_prompts) for _ in range(SLOTS)]
            list(pool.map(lambda prompt: complete(stack, prompt, n_predict=8), finished))
            # B comes while more of A's run, as on a busy server.
            running = [pool.submit(complete, stack, next(a_prompts)) for _ in range(SLOTS - 1)]
            later.append(complete(stack, b_prompt)["tokens"])
            for future in running:
                future.result()
    differing = [i for i, tokens in enumerate(later) if tokens != fresh]
    assert not differing, (
        f"B's completion changed in rounds {differing} (PROMPT_CACHE={prompt_cache})"
    )


# --- backend sampling -----------------------------------------------------------------------------


def prompts(n: int) -> list[str]:
    return [conversation("P", i, words=20 + 11 * i) for i in range(n)]


def test_backend_sampling_chooses_the_tokens_cpu_sampling_chooses(stack_for, tiny_model):
    """Greedy (temperature 0): identical tokens over a set of prompts, the same server sampling on
    the backend (the profiles' default) and on the CPU (the request's backend_sampling: false).
    Each response says which path it took (generation_settings.backend_sampling)."""
    stack = serving(stack_for, tiny_model)
    for prompt in prompts(8):
        backend = complete(stack, prompt, n_predict=32)
        cpu = complete(stack, prompt, n_predict=32, backend_sampling=False)
        assert backend["generation_settings"]["backend_sampling"] is True
        assert cpu["generation_settings"]["backend_sampling"] is False
        assert backend["tokens"] == cpu["tokens"], prompt


SEEDS = 200


def test_backend_sampling_draws_from_the_distribution_cpu_sampling_does(stack_for, tiny_model):
    """Temperature 1 with a fixed seed: the engine feeds the backend's sampler the same random
    numbers as the CPU's, so most seeds give the same tokens; over many seeds the first token's
    distribution must not differ (chi-square test of the two samples, p > 0.001)."""
    stack = serving(stack_for, tiny_model)
    prompt = prompts(1)[0]
    params = {"n_predict": 2, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    draws = {True: [], False: []}
    with ThreadPoolExecutor(SLOTS) as pool:
        for on in draws:
            draws[on] = list(pool.map(
                lambda seed, on=on: complete(stack, prompt, seed=seed, backend_sampling=on,
                                             **params)["tokens"], range(SEEDS)))  # fmt: skip
    same = sum(a == b for a, b in zip(draws[True], draws[False], strict=True))
    assert same >= 0.9 * SEEDS, f"only {same} of {SEEDS} seeds gave the same tokens"
    firsts = sorted({tokens[0] for side in draws.values() for tokens in side})
    table = [[sum(t[0] == token for t in draws[on]) for token in firsts] for on in draws]
    if len(firsts) > 1:
        assert chi2_contingency(table).pvalue > 0.001, table


def test_requests_backend_sampling_cannot_serve_still_answer_correctly(stack_for, tiny_model):
    """What the engine samples on the CPU instead: a JSON schema and a grammar (constraints the
    backend sampler cannot apply) give output that obeys them; logprobs come with the greedy
    tokens, in order, and name each as the most likely; n > 1 at temperature 0 gives n copies of
    the greedy answer."""
    stack = serving(stack_for, tiny_model)
    prompt = prompts(2)[1]
    greedy = complete(stack, prompt, n_predict=16)
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["colour", "n"],
        "additionalProperties": False,
    }
    answer = chat(
        stack,
        [{"role": "user", "content": "A colour and a number, as JSON."}],
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}},
    )
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), schema)
    constrained = complete(stack, prompt, grammar='root ::= ("yes" | "no") " " [0-9] [0-9]')
    assert constrained["generation_settings"]["backend_sampling"] is False
    assert re.fullmatch(r"(yes|no) [0-9][0-9]", constrained["content"]), constrained["content"]
    with_logprobs = complete(stack, prompt, n_predict=16, n_probs=3)
    assert with_logprobs["tokens"] == greedy["tokens"]
    # The engine lists no probabilities for a token that ends inside a UTF-8 character (random
    # weights emit such byte tokens), so the steps are the greedy tokens with those left out.
    steps = with_logprobs["completion_probabilities"]
    assert len(steps) >= len(greedy["tokens"]) // 2, steps
    unmatched = iter(greedy["tokens"])
    for step in steps:
        assert step["id"] in unmatched, (step["id"], greedy["tokens"])
        assert step["top_logprobs"][0]["id"] == step["id"], step
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "n": 3}
    several = stack.api().post(f"{stack.url}/v1/completions", json=body, timeout=300)
    texts = [choice["text"] for choice in several.json()["choices"]]
    assert texts == [greedy["content"]] * 3, texts


# --- the gateway's bounded queue ------------------------------------------------------------------

QUEUE_LENGTH = 2
# The default wait: a queued short request must be served within it on a machine whose cores a
# cold CUDA build keeps busy (3 s was too short there for two 4-token streams to free a slot).
QUEUE_WAIT_S = 10
BURST = 6 * (2 + QUEUE_LENGTH)  # six times what the gateway holds: 2 slots and the queue
FAST_S = 1.0


def streamed(stack, max_tokens: int) -> dict:
    """One streamed chat completion through the gateway: its status, when the status came, and
    (admitted) whether the stream ran to its end: every token asked for, by the server's usage."""
    started = time.monotonic()
    with stack.api().post(
        f"{stack.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
        stream=True,
        timeout=300,
    ) as reply:
        answered_s = time.monotonic() - started
        outcome = {"status": reply.status_code, "answered_s": answered_s, "headers": reply.headers}
        if reply.status_code != 200:
            outcome["error"] = reply.json()["error"]["message"]
            return outcome
        usage = None
        for line in reply.iter_lines():
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        outcome["completion_tokens"] = (usage or {}).get("completion_tokens")
        outcome["total_s"] = time.monotonic() - started
        return outcome


def burst(stack, max_tokens: int) -> list[dict]:
    with ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(lambda _: streamed(stack, max_tokens), range(BURST)))


def test_a_burst_beyond_the_gateways_queue_is_refused_fast_and_the_rest_complete(
    stack_for, tiny_model
):
    """GATEWAY=on, 2 slots, QUEUE_LENGTH=2, QUEUE_WAIT_S=10, bursts of six times that. Long
    streams (longer than the wait): the slots' streams run to their end, the queued requests get
    a 429 when their wait runs out, every other one a 429 at once; nothing else. Short ones: the
    queued requests are served too."""
    stack = stack_for(
        tiny_model, GATEWAY="on", SLOTS="2", CONTEXT="4096", QUEUE_LENGTH=str(QUEUE_LENGTH),
        QUEUE_WAIT_S=str(QUEUE_WAIT_S), CLIENT_CONNECTIONS="1000", CLIENT_RATE="100000",
    )  # fmt: skip
    up = stack.compose("up", "-d", "--wait", "--wait-timeout", "300", "llama-server", "gateway")
    assert up.returncode == 0, up.stderr[-3000:]
    # Streams that outlast the wait on this machine, however fast it is.
    probe = streamed(stack, 64)
    assert probe["status"] == 200 and probe["completion_tokens"] == 64, probe
    long_tokens = min(3000, int(64 * 3 * QUEUE_WAIT_S / probe["total_s"]))

    outcomes = burst(stack, long_tokens)
    admitted = [o for o in outcomes if o["status"] == 200]
    refused = [o for o in outcomes if o["status"] == 429]
    table = [(o["status"], round(o["answered_s"], 2), o.get("error", "")) for o in outcomes]
    assert len(admitted) + len(refused) == BURST, table
    assert all(o["completion_tokens"] == long_tokens for o in admitted), table  # none cut
    assert all(o["headers"].get("Retry-After") for o in refused), table
    full = [o for o in refused if "QUEUE_LENGTH" in o["error"]]
    waited = [o for o in refused if "QUEUE_WAIT_S" in o["error"]]
    assert len(full) + len(waited) == len(refused), table
    assert len(admitted) >= 2 and len(waited) <= QUEUE_LENGTH, table
    assert len(full) >= BURST - 2 - QUEUE_LENGTH, table
    assert max(o["answered_s"] for o in full) < FAST_S, table
    assert all(QUEUE_WAIT_S - 0.5 <= o["answered_s"] < QUEUE_WAIT_S + 5 for o in waited), table

    outcomes = burst(stack, 4)
    admitted = [o for o in outcomes if o["status"] == 200]
    refused = [o for o in outcomes if o["status"] == 429]
    table = [(o["status"], round(o["answered_s"], 2), o.get("error", "")) for o in outcomes]
    assert len(admitted) + len(refused) == BURST, table
    assert len(admitted) >= 2 + QUEUE_LENGTH, table  # the queued ones served as slots came free
    assert all(o["completion_tokens"] == 4 for o in admitted), table
    assert all(o["answered_s"] < FAST_S for o in refused), table
