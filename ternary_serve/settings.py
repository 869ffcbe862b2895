"""Every operator setting, declared once: name, default, check and meaning.

Make (`make config NAME=value`), the CLI (`ternary-serve config NAME=value`) and the Ansible role
(`llm_stack_settings: {NAME: value}`) pass these names to one renderer (ternary_serve.config),
which writes what Compose and llama-server read. Chosen values persist in settings.env beside
.env, so a later `make up` keeps them; `NAME=` puts a setting back to its default.

`ternary-serve settings` lists them with their current values. Standard library only: the Makefile
reads the names with the system python3 before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import difflib
import ipaddress
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ternary_serve import envfile, errors
from ternary_serve.versions import PROJECT_ROOT

SETTINGS_FILE = "settings.env"
HEADER = "# Operator settings, written by `make config NAME=value` (`ternary-serve settings`).\n"
AUTO = "auto"
KV_TYPES = ("f16", "q8_0", "q4_0")
# A llama-server flag's environment twin: what SERVER_EXTRA may hold.
SERVER_ARG = re.compile(r"^LLAMA_ARG_[A-Z0-9_]+$")


@dataclass(frozen=True)
class Workload:
    """What a WORKLOAD value sets in the server (templates/llama-server.env.j2); each flag's
    measured effect is in docs/bench.md ("Workload profiles")."""

    ctx_checkpoints: int  # per slot, each a copy of the slot's recurrent state in host RAM
    backend_sampling: bool  # the sampler chain runs in the model's graph, not on the CPU after it


# Checkpoints are what lets a hybrid model (qwen35) reuse a conversation's prompt, and each one is
# copied synchronously in the server's loop (~150 MiB for the 27B), stalling every other slot:
# worth it only where turns come back to their prefix.
WORKLOADS = {
    "api": Workload(ctx_checkpoints=0, backend_sampling=True),
    "chat": Workload(ctx_checkpoints=2, backend_sampling=True),
}


class SettingError(errors.ServeError):
    """A setting's value that cannot work; the message names the setting and what it accepts."""


Check = Callable[[str], str]


def accepting(text: str) -> Callable[[Check], Check]:
    """Mark a check with what it accepts, in words, for the settings page (docs/settings.md)."""

    def mark(check: Check) -> Check:
        check.accepts = text  # type: ignore[attr-defined]
        return check

    return mark


def one_of(*options: str) -> Check:
    @accepting(" or ".join(f"`{option}`" for option in options))
    def check(value: str) -> str:
        if value not in options:
            raise ValueError(f"choose {' or '.join(options)}")
        return value

    return check


def integer(low: int, high: int, auto: bool = False) -> Check:
    @accepting(f"{low} to {high}" + (f", or `{AUTO}`" if auto else ""))
    def check(value: str) -> str:
        if auto and value == AUTO:
            return value
        if not value.isdigit() or not low <= int(value) <= high:
            accepted = f"a whole number from {low} to {high}"
            raise ValueError(accepted + (f", or {AUTO}" if auto else ""))
        return str(int(value))

    return check


def matching(pattern: str, what: str) -> Check:
    compiled = re.compile(pattern)

    @accepting(what)
    def check(value: str) -> str:
        if not compiled.fullmatch(value):
            raise ValueError(what)
        return value

    return check


@accepting("any text")
def anything(value: str) -> str:
    return value


@accepting("an IP address")
def ip_address(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError("an IP address, e.g. 127.0.0.1 (this host only) or 0.0.0.0") from None
    return value


@accepting("a directory (relative: from the project directory)")
def directory(value: str) -> str:
    """Relative paths are taken from the project directory (where .env lives)."""
    if not value:
        raise ValueError("a directory")
    return str((PROJECT_ROOT / value).resolve()) if not Path(value).is_absolute() else value


@accepting("an absolute path, or empty")
def optional_file(value: str) -> str:
    if value and not Path(value).is_absolute():
        raise ValueError("an absolute path to a file, or empty")
    return value


@accepting("space-separated `https://host[:port]` origins, or empty")
def origins(value: str) -> str:
    for origin in value.split():
        if not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:\d+)?", origin):
            raise ValueError(
                f"space-separated origins like https://app.example.com (scheme, host, optional "
                f"port, no path), got {origin!r}"
            )
    return value


@accepting("space-separated `LLAMA_ARG_NAME=value` pairs, or empty")
def server_extra(value: str) -> str:
    for pair in value.split():
        key, sep, _ = pair.partition("=")
        if not sep or not SERVER_ARG.match(key):
            raise ValueError(
                f"space-separated LLAMA_ARG_NAME=value pairs (the flags' environment twins), "
                f"got {pair!r}"
            )
    return value


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    help: str
    check: Check = anything


SETTINGS = {
    s.name: s
    for s in (
        Setting("BACKEND", "cuda", "cuda: the GPU stack; cpu: no GPU (tests, laptops)",
                one_of("cuda", "cpu")),
        Setting("ENGINE_SOURCE", "git",
                "git: the build clones the pinned engine; local: builds vendor/llama.cpp offline",
                one_of("git", "local")),
        Setting("PROJECT_NAME", "ternary-serve", "Compose project name (one per stack on a host)",
                matching(r"[a-z0-9][a-z0-9_-]*", "lowercase letters, digits, - and _")),
        Setting("MODEL_DIR", "models", "host directory of the model files", directory),
        Setting("MODEL_FILE", "model.gguf", "the GGUF the server loads, in MODEL_DIR",
                matching(r"[\w.+-]+\.gguf", "a file name ending in .gguf, no directories")),
        Setting("MODEL_SOURCE", "",
                "what model-init fetches when the file is missing: a models.yaml name, https://, "
                "hf://OWNER/REPO/FILE, or a checkpoint directory as /models/NAME"),
        Setting("MODEL_SHA256", "", "the model's expected SHA-256 (empty: the catalog's, if any)",
                matching(r"(|[0-9a-f]{64})", "64 lowercase hex digits, or empty")),
        Setting("MODEL_TYPE", "Q2_0", "the type model-init converts a checkpoint source to",
                matching(r"[A-Z0-9_]+", "a ggml type name, e.g. Q2_0")),
        Setting("QUALITY_GATE", "auto",
                "the smoke test's questions: auto (from the model), none, or a models.yaml gate",
                matching(r"[a-z0-9_-]+", "auto, none or a gate name")),
        Setting("PUBLISH_ADDRESS", "127.0.0.1", "host address the API is published on",
                ip_address),
        Setting("PUBLISH_PORT", "8080", "host port the API is published on", integer(1, 65535)),
        Setting("GPU", "0", "the GPU (nvidia-smi index) the server runs on and the plan reads",
                integer(0, 63)),
        Setting("VRAM_MIB", AUTO,
                "memory to plan for: auto reads the GPU (nvidia-smi) or, on cpu, the host's RAM; "
                "a number plans for a card elsewhere", integer(1024, 10**7, auto=True)),
        Setting("CONTEXT", AUTO,
                "tokens of context per slot; auto: 8192, or the model's training context if less",
                integer(256, 10**7, auto=True)),
        Setting("SLOTS", AUTO,
                "requests served at once; auto: as many as the memory holds, up to 16",
                integer(1, 256, auto=True)),
        Setting("KV_TYPE", AUTO,
                "KV cache type; auto: f16, or q8_0 when f16 cannot hold the context",
                one_of(AUTO, *KV_TYPES)),
        Setting("KV_UNIFIED", "off",
                "on: one KV pool shared by all slots (a slot may use more than its share)",
                one_of("on", "off")),
        Setting("WORKLOAD", "api",
                "api: independent requests (RAG, tools), no context checkpoints; chat: "
                "multi-turn conversations, checkpoints so a turn reuses the last one's prompt",
                one_of(*WORKLOADS)),
        Setting("PROMPT_CACHE", "off",
                "on: llama-server's host-RAM prompt cache (8 GiB; idle slots saved to it). Risk: "
                "the pinned engine can restore another user's conversation into a new request "
                "(ggml-org/llama.cpp#27148)", one_of("on", "off")),
        Setting("BATCH", "2048", "logical batch size (tokens per prompt-processing call)",
                integer(32, 65536)),
        Setting("UBATCH", "512", "physical batch size; the compute buffers grow with it",
                integer(32, 65536)),
        Setting("SLOTS_ENDPOINT", "off",
                "on: GET /slots shows every slot's live prompt (other users' conversations)",
                one_of("on", "off")),
        Setting("WEB_UI", "off", "on: llama-server's web chat UI at / (through the gateway too)",
                one_of("on", "off")),
        Setting("GATEWAY", "on",
                "TLS reverse proxy (HAProxy) in front of the server, the only published port: "
                "body limit, CORS, the bounded queue, slow clients (loopback too); off: the "
                "server's own port, with none of these", one_of("on", "off")),
        Setting("TLS_CERT", "",
                "the gateway's PEM certificate (chain); empty: one generated for this host",
                optional_file),
        Setting("TLS_KEY", "", "the private key of TLS_CERT (PEM)", optional_file),
        Setting("CORS_ORIGINS", "",
                "origins whose web pages may call the API (space-separated, "
                "https://app.example.com); empty: none", origins),
        Setting("BODY_LIMIT_KIB", "4096", "largest request body the gateway accepts, KiB",
                integer(1, 1024 * 1024)),
        Setting("CLIENT_CONNECTIONS", "32",
                "open connections one client address may hold at the gateway",
                integer(1, 100000)),
        Setting("CLIENT_RATE", "300",
                "requests one client address may make per minute at the gateway",
                integer(1, 10**7)),
        Setting("QUEUE_LENGTH", "16",
                "requests that may wait at the gateway for a free server slot; more get 429 "
                "with Retry-After at once", integer(1, 100000)),
        Setting("QUEUE_WAIT_S", "10",
                "seconds a request may wait at the gateway for a free slot before it gets 429 "
                "with Retry-After (a stream once started is never cut)", integer(1, 3600)),
        Setting("DECODE_GATE", "80",
                "a release goes live only if it decodes at least this % of the tokens/s recorded "
                "for the release it replaces on this server (a short benchmark after the smoke "
                "test); 0: not measured", integer(0, 100)),
        Setting("SERVER_EXTRA", "",
                "more server flags, LLAMA_ARG_NAME=value pairs: LLAMA_ARG_THREADS=8",
                server_extra),
        Setting("BUILD_BASE_IMAGE", "", "the image to build the engine on (empty: versions.env's)"),
        Setting("RUNTIME_BASE_IMAGE", "",
                "the base of the server, smoke and model-init images (empty: versions.env's)"),
        Setting("GATEWAY_BASE_IMAGE", "",
                "the gateway image's base, HAProxy from its packages (empty: versions.env's)"),
        Setting("REVISION", "",
                "the project commit for the image tag (empty: this checkout's; provisioning "
                "passes the controller's)",
                matching(r"(|[\w.-]+)", "a commit id, or empty")),
    )
}  # fmt: skip


def settings_file(env_file: Path) -> Path:
    return env_file.with_name(SETTINGS_FILE)


def parse_assignments(args: list[str]) -> dict[str, str]:
    """NAME=value arguments -> {NAME: value}; anything else is refused."""
    given: dict[str, str] = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        if not sep:
            raise SettingError(f"{arg!r}: settings are given as NAME=value")
        given[name] = value
    return given


# Settings a release removed, and why: a settings.env that still holds one drops it with a note.
RETIRED = {"SMOKE_BASE_IMAGE": "the smoke image is built on RUNTIME_BASE_IMAGE"}


def unknown(name: str) -> SettingError:
    if name in RETIRED:
        return SettingError(f"{name} is no longer a setting: {RETIRED[name]}")
    close = difflib.get_close_matches(name, SETTINGS, n=1)
    hint = f"did you mean {close[0]}?" if close else "`ternary-serve settings` lists them"
    return SettingError(f"{name} is not a setting: {hint}")


def resolve(stored: dict[str, str], given: dict[str, str]) -> dict[str, str]:
    """Defaults, then stored values, then given ones (empty: back to the default); all checked."""
    for name in RETIRED.keys() & stored.keys():
        print(f"settings: {name} dropped from {SETTINGS_FILE}: {RETIRED[name]}", file=sys.stderr)
    stored = {name: value for name, value in stored.items() if name not in RETIRED}
    for name in (*stored, *given):
        if name not in SETTINGS:
            raise unknown(name)
    values = {}
    for name, setting in SETTINGS.items():
        value = given.get(name, stored.get(name, setting.default))
        if value == "":
            value = setting.default
        try:
            values[name] = setting.check(value)
        except ValueError as exc:
            raise SettingError(f"{name}={value}: {exc}") from None
    return values


def chosen(values: dict[str, str]) -> dict[str, str]:
    """What differs from the defaults: what settings.env keeps."""
    defaults = resolve({}, {})
    return {name: value for name, value in values.items() if value != defaults[name]}


def configured(env_file: Path) -> dict[str, str]:
    """The settings a rendered .env holds (defaults where there is none yet)."""
    env = envfile.read(env_file) if env_file.is_file() else {}
    return resolve({name: env[name] for name in SETTINGS if name in env}, {})


SETTINGS_PAGE = PROJECT_ROOT / "docs" / "settings.md"
PAGE_INTRO = """\
# Settings

<!-- Generated from ternary_serve/settings.py by `make docs-settings`; a test fails when stale. -->

Every operator setting is declared once, with its default and its check, in
`ternary_serve/settings.py`. Set them by name, the same way everywhere:

```
make config CONTEXT=16384 KV_TYPE=auto         # Make; `make up NAME=value` works too
ternary-serve config CONTEXT=16384             # the CLI that Make calls
llm_stack_settings: {CONTEXT: 16384}           # the Ansible role (inventory or group_vars)
```

Chosen values are kept in `settings.env` beside `.env`, so a later `make up` keeps them; `NAME=`
returns one to its default. A bad value stops with one line and changes nothing (`config: SLOTS=0:
a whole number from 1 to 256, or auto`); a misspelt name too (`CONTXT is not a setting: did you
mean CONTEXT?`; Make says so before running anything). `make settings` lists them with the values
in effect. How the memory plan, the server flags and the pins use them:
[configuration.md](configuration.md).

"""


def page() -> str:
    """docs/settings.md: the registry as a table (name, default, what it accepts, meaning)."""
    rows = ["| setting | default | accepts | meaning |", "|---|---|---|---|"]
    for setting in SETTINGS.values():
        default = f"`{setting.default}`" if setting.default else "(empty)"
        accepts = getattr(setting.check, "accepts", "")
        meaning = setting.help.replace("|", "\\|")
        rows.append(f"| `{setting.name}` | {default} | {accepts} | {meaning} |")
    return PAGE_INTRO + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ternary-serve settings", description=__doc__.splitlines()[0])
    ap.add_argument("--names", action="store_true", help="only the names, one line (for Make)")
    ap.add_argument("--get", metavar="NAME", help="print one setting as the stack is configured")
    ap.add_argument("--env-file", type=Path, default=PROJECT_ROOT / ".env")
    ap.add_argument("--page", action="store_true", help=f"print {SETTINGS_PAGE.name}'s text")
    args = ap.parse_args(argv)
    return errors.run("settings", lambda: act(args))


def act(args: argparse.Namespace) -> int:
    if args.page:
        sys.stdout.write(page())
    elif args.names:
        print(" ".join(SETTINGS))
    elif args.get:
        if args.get not in SETTINGS:
            raise SettingError(unknown(args.get))
        print(configured(args.env_file)[args.get])
    else:
        print(table(settings_file(args.env_file)))
    return 0


def table(path: Path) -> str:
    """Every setting as settings.env at path configures it, marked where it is set there."""
    stored = envfile.read(path) if path.is_file() else {}
    try:
        values = resolve(stored, {})
    except SettingError as exc:
        raise SettingError(f"{path}: {exc}") from None
    width = max(map(len, SETTINGS))
    lines = [
        f"{'*' if name in stored else ' '} {name:<{width}}  {values[name] or '(empty)':<24}  "
        f"{setting.help}"
        for name, setting in SETTINGS.items()
    ]
    lines.append(f"\n* set in {path}; the others are defaults. Change: make config NAME=value")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
