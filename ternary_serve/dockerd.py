"""Docker's daemon, reached in one place: the client every command opens, and the one line an
operator gets when the daemon is down or its socket is out of reach, never a traceback."""

from __future__ import annotations

import errno
import os

import docker
import docker.errors

from ternary_serve import errors

DEFAULT_HOST = "unix:///var/run/docker.sock"


class DockerUnreachable(errors.ServeError):
    """The daemon does not answer; the message says where it was asked and the fix."""


def client() -> docker.DockerClient:
    """A client of the daemon at DOCKER_HOST (else the default socket), which has answered."""
    try:
        return docker.from_env()
    except docker.errors.DockerException as exc:
        raise DockerUnreachable(reason(exc)) from None


def answers() -> None:
    """Raise DockerUnreachable unless the daemon answers: asked where a docker command failed,
    so that an unreachable daemon is reported as such rather than as the step that failed."""
    client().close()


def reason(exc: BaseException) -> str:
    """What an SDK failure to reach the daemon means, and what to do, in one line."""
    host = os.environ.get("DOCKER_HOST")
    where = f"{host} (DOCKER_HOST)" if host else f"{DEFAULT_HOST} (the default socket)"
    start = "start it: sudo systemctl start docker" + (
        ", or point DOCKER_HOST at a running daemon" if host else " (`make bootstrap` installs it)"
    )
    cause = os_error(exc)
    if cause is not None and cause.errno in (errno.EACCES, errno.EPERM):
        return (
            f"permission denied on Docker's socket {where}: add yourself to the docker group "
            "(sudo usermod -aG docker $USER, then log in again), or run with sudo"
        )
    if cause is not None and cause.errno in (errno.ENOENT, errno.ECONNREFUSED):
        what = "no socket" if cause.errno == errno.ENOENT else "nothing listens"
        return f"Docker is not running: {what} at {where}: {start}"
    detail = " ".join(str(exc).split())
    return f"Docker does not answer at {where} ({detail}): {start}"


def os_error(exc: BaseException) -> OSError | None:
    """The operating system's error under an SDK one (it hides in causes and arguments:
    DockerException <- requests' ConnectionError <- urllib3's ProtocolError(msg, OSError))."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        linked = (current.__cause__, current.__context__, *current.args)
        todo.extend(e for e in linked if isinstance(e, BaseException))
    return None
