"""What the llm stage learns from the tritonserver that started its stub process: the operator's key and whether
the server is stopping.

A Python model has no API for either: it reads its parent's command line (`/proc/<ppid>/cmdline`) and asks the
server's own HTTP endpoint.
"""

from __future__ import annotations

import hmac
import os
import urllib.error
import urllib.request
from typing import Callable

from omni_backend.operator_key import ADMIN_KEY_HEADER, admin_key_of, tritonserver_flags
from omni_backend.vocabulary import ErrorKind, StageError


def parent_tritonserver_flags(pid: int | None = None) -> dict[str, str] | None:
    """The flags (`operator_key.tritonserver_flags`) of the tritonserver that started this stub process (its parent,
    or `pid`); None when that process is not a tritonserver or its command line cannot be read."""
    try:
        with open(f"/proc/{pid or os.getppid()}/cmdline", "rb") as file:
            cmdline = [part.decode(errors="replace") for part in file.read().split(b"\0") if part]
    except OSError:
        return None
    if not cmdline or not os.path.basename(cmdline[0]).startswith("tritonserver"):
        return None
    return tritonserver_flags(cmdline)


def parent_operator_key(pid: int | None = None) -> str | None:
    """The operator's key of the tritonserver that started this stub process (its parent, or `pid`): the one its
    restricted-API flags require in the `omni-admin-key` header. None when the parent is not a tritonserver or
    restricts nothing with that header (then nobody may reset the cache)."""
    flags = parent_tritonserver_flags(pid)
    return admin_key_of(flags) if flags is not None else None


def check_operator_key(given_key: object, operator_key: str | None) -> None:
    """Refuse an operator's request that does not carry the operator's key (compared in constant time).

    Args:
        given_key: the key the request carries (its `omni-admin-key` parameter: a string), None without one.
        operator_key: the server's key (`parent_operator_key`), None when it has none.

    Raises:
        StageError: INVALID_ARGUMENT (field `omni-admin-key`) when there is no operator key or `given_key` is not it.
    """
    if not operator_key:
        raise StageError(ErrorKind.INVALID_ARGUMENT, f"{ADMIN_KEY_HEADER} cannot open a prefix cache reset: "
                         "this tritonserver has no operator key (no restricted-API flag for that header)",
                         ADMIN_KEY_HEADER)
    if not isinstance(given_key, str) or not hmac.compare_digest(given_key.encode(), operator_key.encode()):
        raise StageError(ErrorKind.INVALID_ARGUMENT, f"{ADMIN_KEY_HEADER} (a request parameter) must be the "
                         "operator's key to reset the prefix cache", ADMIN_KEY_HEADER)


def parent_server_probe(pid: int | None = None) -> tuple[Callable[[], bool] | None, int | None]:
    """(probe, exit timeout in s) for the tritonserver that started this stub process (its parent, or `pid`).

    Read from its command line: the exit timeout (`--exit-timeout-secs`, default 30) and its HTTP endpoint. The
    probe answers True once `GET /v2/health/live` there fails: tritonserver 2.51 closes its HTTP endpoint as soon
    as shutdown begins (seen: connection refused 0.5 s after SIGTERM). A Python model has no other way to learn
    it: `pb_utils.is_model_ready` raises once shutdown began, but a second call from a thread hung the stub here.
    (None, None) when the parent is not a tritonserver with HTTP on (the watch is then off).
    """
    flags = parent_tritonserver_flags(pid)
    if flags is None:
        return None, None
    if flags.get("allow-http", "true").lower() in ("false", "0", "no"):
        return None, None
    try:
        port, exit_timeout_s = int(flags.get("http-port", "8000")), int(flags.get("exit-timeout-secs", "30"))
    except ValueError:
        return None, None
    host = flags.get("http-address", "127.0.0.1")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/v2/health/live"

    def stopping() -> bool:
        """True when the port refuses the connection (or answers not live); a timeout or other error raises
        (an unknown answer: a busy server must not look like a stopping one)."""
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                return response.status != 200
        except urllib.error.HTTPError:
            return True
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, ConnectionRefusedError):
                return True
            raise
        except ConnectionRefusedError:
            return True

    return stopping, exit_timeout_s
