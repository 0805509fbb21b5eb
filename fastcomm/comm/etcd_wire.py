"""The wire under the etcd client: one member over HTTP/1.1, etcd's JSON encoding, the errors.

etcd's JSON gateway takes the v3 API's requests as JSON POSTs (``/v3/kv/put``, ``/v3/kv/txn``
...) with keys and values in base64 and 64-bit integers as strings, and answers errors as
``{"code": <gRPC status>, "message": ...}``. :class:`_Member` sends one request to one member
over a keep-alive connection of its own and says how it failed (:class:`_Failure`): whether the
member was reached, and whether another member (or a later try) may serve it.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import FastcommError

__all__ = ["EtcdError", "EtcdUnavailableError", "EtcdWaitTimeout", "KeyValue",
           "parse_endpoints"]

# gRPC status codes of answers that say "this member cannot serve now; another may":
# UNKNOWN (etcd's "context deadline exceeded", "leader changed"), DEADLINE_EXCEEDED,
# RESOURCE_EXHAUSTED ("too many requests"), UNAVAILABLE ("no leader", "request timed out")
_RETRY_CODES = frozenset({2, 4, 8, 14})


class EtcdError(FastcommError):
    """An etcd member refused a request (its answer is in the message)."""


class EtcdUnavailableError(EtcdError, TimeoutError):
    """No member of the cluster served a request within its timeout: the cluster cannot be
    reached, or it lost its majority (the message says which, member by member)."""


class EtcdWaitTimeout(EtcdError, TimeoutError):
    """Keys waited for were not all set within the timeout."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd holds it."""

    key: bytes
    value: bytes
    create_revision: int
    """Revision of the key's creation (0: the key does not exist)."""
    mod_revision: int
    """Revision of the key's last change."""
    version: int
    """Number of changes since its creation (1 after the first put)."""
    lease: int
    """The lease the key is attached to (0: none)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _as_bytes(value: bytes | str, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"etcd {what} must be bytes or str, got {type(value).__name__}")


def _key(key: bytes | str) -> bytes:
    data = _as_bytes(key, "keys")
    if not data:
        raise ValueError("etcd keys must not be empty")
    return data


def _range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's ``--prefix``)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


def _kv(item: dict) -> KeyValue:
    return KeyValue(
        _unb64(item.get("key")),
        _unb64(item.get("value")),
        int(item.get("create_revision", 0)),
        int(item.get("mod_revision", 0)),
        int(item.get("version", 0)),
        int(item.get("lease", 0)),
    )


def _positive(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (int/float), got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def parse_endpoints(endpoints: str | Sequence[str]) -> tuple[str, ...]:
    """``"h1:p1,h2:p2"`` (or a list of ``host:port``; ``http://`` allowed, ``[::1]:p`` for
    IPv6) as a tuple of ``host:port``.

    Raises:
        ValueError: no endpoint, a port that is not in [1, 65535], a missing host, or TLS
            (``https://``, which this client does not speak).
        TypeError: ``endpoints`` is neither a string nor a sequence of strings.
    """
    if isinstance(endpoints, str):
        items = endpoints.split(",")
    elif isinstance(endpoints, Sequence) and all(isinstance(e, str) for e in endpoints):
        items = list(endpoints)
    else:
        raise TypeError(f"etcd endpoints must be 'host:port,...' or a list of them, got "
                        f"{endpoints!r}")
    parsed = []
    for item in (i.strip() for i in items):
        if item.startswith("https://"):
            raise ValueError(f"etcd endpoint {item!r}: TLS is not supported (use http://)")
        text = item.removeprefix("http://").rstrip("/")
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item!r} is not host:port (port in [1, 65535])")
        parsed.append(f"{host}:{int(port)}")
    if not parsed or not all(parsed):
        raise ValueError(f"no etcd endpoint in {endpoints!r}")
    return tuple(dict.fromkeys(parsed))


# ---------------------------------------------------------------------- one member
class _Failure(Exception):
    """One request to one member failed; ``retry``: another member (or later) may serve it."""

    def __init__(self, reason: str, *, retry: bool, reached: bool, code: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.retry = retry
        self.reached = reached  # the member accepted the connection
        self.code = code


class _Member:
    """One endpoint and its idle keep-alive connections."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        host, _, port = endpoint.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def connection(self, limit: float) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection (``True``: reused) or a new, connected one."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the parent's sockets are not ours
                self._idle, self._pid = [], os.getpid()
            if self._idle:
                conn = self._idle.pop()
                conn.sock.settimeout(limit)
                return conn, True
        conn = http.client.HTTPConnection(self.host, self.port, timeout=limit)
        try:
            conn.connect()
        except OSError as exc:
            conn.close()
            raise _Failure(_os_reason(exc), retry=True, reached=False) from None
        return conn, False

    def request(self, path: str, body: dict, limit: float) -> dict:
        """POSTs ``body`` to ``path``; returns the decoded answer (a stream's first message).

        Raises:
            _Failure: no connection, no answer within ``limit`` s, or an error answer.
        """
        data = json.dumps(body).encode()
        deadline = time.monotonic() + limit
        conn, reused = self.connection(limit)
        try:
            conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            left = deadline - time.monotonic()
            if reused and left > 0 and not isinstance(exc, TimeoutError):
                # the member closed an idle connection: one new connection; safe, since every
                # request of this client may be sent twice (see EtcdClient.add)
                return self.request(path, body, left)
            raise _Failure(_os_reason(exc), retry=True, reached=True) from None
        if response.will_close:
            conn.close()
        else:
            with self._lock:
                self._idle.append(conn)
        try:
            answer = json.loads(raw.split(b"\n", 1)[0] or b"{}")
        except ValueError:
            raise _Failure(f"HTTP {response.status}, not etcd's JSON: {raw[:80]!r}",
                           retry=response.status >= 500, reached=True) from None
        if "result" in answer and isinstance(answer["result"], dict):  # a stream's message
            answer = answer["result"]
        if "error" in answer or response.status != 200:
            code = answer.get("code")
            message = answer.get("message") or answer.get("error") or f"HTTP {response.status}"
            raise _Failure(message, retry=code in _RETRY_CODES or response.status >= 500,
                           reached=True, code=code)
        return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "no answer (timed out)"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed the connection without answering"
    return f"{type(exc).__name__}: {exc}"
