"""The one error base: a failure the operator acts on is one line that names the fix, printed in
one place."""

from __future__ import annotations

import sys
from collections.abc import Callable


class ServeError(Exception):
    """A failure of a job, or a refusal: the message is one line saying what is wrong and what to
    do; exit_code is the command's exit status. Each module's error class derives from this, so a
    caller adds context to any of them without re-wrapping each by hand."""

    exit_code = 1


def run(command: str, job: Callable[[], int]) -> int:
    """job's exit status; when it fails with a ServeError, `command: message` on stderr and the
    error's exit code (no traceback: the message is the report)."""
    try:
        return job()
    except ServeError as exc:
        print(f"{command}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
