"""Host-side key-value store used for rendezvous.

``Store`` wraps torch's ``TCPStore`` and ``PrefixStore``; fastcomm never runs a server of its
own. ``Store.on_etcd`` (or ``FASTCOMM_STORE=etcd://...``, :func:`store_from_env`) puts the same
store in an etcd cluster instead (:class:`~.etcd_store.EtcdStore`), where no node of the job
serves it. ``barrier``, ``all_gather_object`` and ``broadcast_object`` need a name unique per use
(the store keeps every key), built from a sequence number.

Invariants: every blocking call has a timeout and raises :class:`StoreTimeoutError` naming the
key, ``host:port``, the rank and the elapsed time; nothing read is executed: objects travel as
JSON (``encode`` refuses other types before writing), and with a job secret
(``FASTCOMM_JOB_SECRET``/``_FILE``) each value is HMAC-SHA256 signed and checked before it is
parsed; raw ``get``/``set`` bytes are not signed. A server binds only the address it is given.

The encoding, the secret and the listening socket: docs/architecture.md.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import json
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import settings
from .errors import FastcommError, StoreTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "AnswerGuard",
    "Store",
    "as_timedelta",
    "job_secret_from_env",
    "joining_node_key",
    "lost_rank_key",
    "env_rendezvous",
    "parse_store_url",
    "store_from_env",
]

MIN_SECRET_BYTES = 16
"""A shorter secret is refused (the launcher makes 32 random bytes)."""

_FROM_ENV = object()  # Store(_secret=...) default: read the secret from the environment

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a store wait, a rendezvous or a collective may take when no timeout is given (the
one default of the store, every communicator and ``fastcomm.init``)."""


def lost_rank_key(rank: int) -> str:
    """The root key of a job's store that says its rank ``rank`` (the launcher's ``RANK``) is
    lost: ``fastcomm-run --recover in-process`` sets it (the reason as its value), the
    survivors' in-place recovery reads it (liveness across hosts)."""
    return f"fastcomm/lost/{rank}"


def joining_node_key(node: str) -> str:
    """The root key of a job's store where the agent of joining `node` (``node1``: its workers'
    ``FASTCOMM_RECOVER_JOIN``) puts how many ranks it brings; fastcomm DDP's running ranks read
    it to admit them all at one step boundary."""
    return f"fastcomm/join/{node}"


def as_timedelta(timeout: float | timedelta | None, default: timedelta) -> timedelta:
    """Normalizes a timeout given as seconds or ``timedelta`` (``None`` means ``default``)."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(f"timeout must be seconds (int/float) or timedelta, got {timeout!r}")
    if value.total_seconds() <= 0:
        raise ValueError(f"timeout must be positive, got {value.total_seconds()} s")
    return value


def _to_bytes(value: bytes | str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__}")


def job_secret_from_env(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from ``FASTCOMM_JOB_SECRET`` (hex) or ``FASTCOMM_JOB_SECRET_FILE``.

    The variable wins over the file; an empty variable counts as unset.

    Returns:
        The secret, or ``None`` when neither is set (values are then JSON only, unsigned).

    Raises:
        ValueError: the variable is not hex, the file cannot be read, or the secret is shorter
            than 16 bytes.
    """
    secret = settings.JOB_SECRET.get(environ)
    if secret is not None:
        source = settings.JOB_SECRET.name
    else:
        path = settings.JOB_SECRET_FILE.get(environ)
        if path is None:
            return None
        name = settings.JOB_SECRET_FILE.name
        try:
            with open(path, "rb") as fh:
                secret = fh.read().strip()
        except OSError as exc:
            raise ValueError(f"{name}: cannot read {path!r}: {exc.strerror}") from None
        source = f"{name} ({path})"
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{source}: the job secret must be at least {MIN_SECRET_BYTES} bytes, "
            f"got {len(secret)}"
        )
    return secret


def parse_store_url(url: str) -> tuple[str, tuple[str, ...], str]:
    """``etcd://host:port[,host:port...]/prefix`` as ``("etcd", endpoints, prefix)``.

    Raises:
        ValueError: another scheme, no endpoint, a malformed ``host:port`` or no prefix.
    """
    from .etcd import parse_endpoints  # no torch, no socket: cheap

    name = settings.STORE.name
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme != "etcd":
        raise ValueError(f"{name}={url!r}: expected etcd://host:port[,host:port...]/prefix")
    hosts, _, prefix = rest.partition("/")
    if not prefix.strip("/"):
        raise ValueError(f"{name}={url!r}: no prefix after the endpoints (etcd keeps keys "
                         "after a job: give each job its own, e.g. etcd://h:2379/job-42)")
    try:
        endpoints = parse_endpoints(hosts)
    except ValueError as exc:
        raise ValueError(f"{name}={url!r}: {exc}") from None
    return scheme, endpoints, prefix.strip("/")


def store_from_env(
    environ: Mapping[str, str] | None = None,
    *,
    timeout: float | timedelta | None = None,
    rank: int | None = None,
) -> Store | None:
    """The job's store as ``FASTCOMM_STORE`` names it (``None`` where it is unset or empty).

    Raises:
        ValueError: the variable is malformed (see :func:`parse_store_url`).
    """
    url = settings.STORE.get(environ)
    if url is None:
        return None
    _, endpoints, prefix = parse_store_url(url)
    return Store.on_etcd(endpoints, prefix, timeout=timeout, rank=rank)


_ENV_STORES: list[Store] = []  # the stores env_rendezvous handed to torch


def env_rendezvous(url: str, timeout: timedelta | None = None):
    """torch's ``env://`` rendezvous over the store ``FASTCOMM_STORE`` names: yields ``(store,
    rank, world size)`` once, as torch's handler does (``rank``/``world_size`` from the URL's
    query, else ``RANK``/``WORLD_SIZE``). ``import fastcomm`` routes ``env://`` here where the
    variable is set, so ``init_process_group`` and ``fastcomm.init()`` share the job's store.

    Raises:
        ValueError: ``FASTCOMM_STORE`` is malformed, or ``RANK``/``WORLD_SIZE`` is missing.
    """
    from urllib.parse import parse_qsl, urlparse

    query = dict(parse_qsl(urlparse(url).query))
    numbers = {}
    for name, env in (("rank", "RANK"), ("world_size", "WORLD_SIZE")):
        text = query.get(name, os.environ.get(env, ""))
        if not text.strip().lstrip("-").isdigit():
            raise ValueError(
                f"env:// rendezvous over {settings.STORE.name}: {env} expected, got {text!r}")
        numbers[name] = int(text)
    store = store_from_env(timeout=timeout, rank=numbers["rank"])
    # torch keeps only the C++ side: the Python store must outlive the process group (its
    # methods are Python, found through this object)
    _ENV_STORES.append(store)
    yield store.torch_store, numbers["rank"], numbers["world_size"]
    raise RuntimeError("Unable to perform re-rendezvous using env:// method")


# ---------------------------------------------------------------------- value encoding
# Every JSON object of the encoding is a one-key tag, so a user dict can never pass for bytes:
# {"b": base64} bytes, {"t": [...]} tuple, {"d": [[key, value], ...]} dict.
_ALLOWED = "None, bool, int, float, str, bytes, list, tuple and dict with str keys"
_UNSIGNED = b"fc1:u:"
_SIGNED = b"fc1:s:"
_MAC_HEX = 64  # hex digits of an HMAC-SHA256


def _tree(obj: Any, path: str) -> Any:
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str):
        return obj
    if kind is bytes:
        return {"b": base64.b64encode(obj).decode("ascii")}
    if kind is list:
        return [_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if kind is tuple:
        return {"t": [_tree(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if kind is dict:
        items = []
        for k, v in obj.items():
            if type(k) is not str:
                raise TypeError(
                    f"store values must be {_ALLOWED}; {path} has a key of type "
                    f"{type(k).__name__} ({k!r})"
                )
            items.append([k, _tree(v, f"{path}[{k!r}]")])
        return {"d": items}
    raise TypeError(
        f"store values must be {_ALLOWED}; {path} is a {kind.__module__}.{kind.__qualname__} "
        "(values are sent as JSON, never pickled)"
    )


def _untag(pairs: list[tuple[str, Any]]) -> Any:
    if len(pairs) != 1:
        raise ValueError("a JSON object is not one tag")
    tag, body = pairs[0]
    if tag == "b" and type(body) is str:
        return base64.b64decode(body.encode("ascii"), validate=True)
    if tag == "t" and type(body) is list:
        return tuple(body)
    if tag == "d" and type(body) is list:
        if not all(type(p) is list and len(p) == 2 and type(p[0]) is str for p in body):
            raise ValueError("a dict is not a list of [str, value] pairs")
        return dict(body)
    raise ValueError(f"unknown tag {tag!r}")


def _mac(secret: bytes, key: str, body: bytes) -> bytes:
    name = key.encode()
    message = b"fastcomm-store-v1\0" + len(name).to_bytes(8, "big") + name + body
    return hmac.new(secret, message, hashlib.sha256).hexdigest().encode("ascii")


def encode_value(obj: Any, key: str, secret: bytes | None) -> bytes:
    """``obj`` as stored under the full key ``key``: JSON, signed when there is a secret.

    Raises:
        TypeError: ``obj`` holds something other than the types listed in the module docstring.
        ValueError: ``obj`` is nested too deeply (or contains itself).
    """
    try:
        body = json.dumps(_tree(obj, "the value"), separators=(",", ":")).encode()
    except RecursionError:
        raise ValueError("store value nested too deeply (or it contains itself)") from None
    if secret is None:
        return _UNSIGNED + body
    return _SIGNED + _mac(secret, key, body) + b":" + body


def decode_value(data: bytes, key: str, secret: bytes | None) -> Any:
    """The object ``encode_value`` made for ``key``; the signature is checked first.

    Raises:
        ValueError: the value is not this encoding, is unsigned while there is a secret, is
            signed while there is none, or its signature does not match (the message says which).
    """
    if data.startswith(_SIGNED):
        if secret is None:
            raise ValueError(
                f"the value is signed but this process has no job secret "
                f"({settings.JOB_SECRET.name} or {settings.JOB_SECRET_FILE.name} unset)"
            )
        mac = data[len(_SIGNED) : len(_SIGNED) + _MAC_HEX]
        body = data[len(_SIGNED) + _MAC_HEX + 1 :]
        sep = data[len(_SIGNED) + _MAC_HEX : len(_SIGNED) + _MAC_HEX + 1]
        if sep != b":" or not hmac.compare_digest(mac, _mac(secret, key, body)):
            raise ValueError("its signature does not match (written without the job secret)")
    elif data.startswith(_UNSIGNED):
        if secret is not None:
            raise ValueError("the value is not signed, but this job has a secret")
        body = data[len(_UNSIGNED) :]
    else:
        raise ValueError(f"not a fastcomm store value (starts {data[:8]!r})")
    try:
        return json.loads(body, object_pairs_hook=_untag)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid encoding: {exc}") from None


# ---------------------------------------------------------------------- server socket
def _listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` only (``port`` 0: a free one).

    Raises:
        FastcommError: the port is in use, or ``host`` is not an address of this machine.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FastcommError(f"cannot serve the store on {host}:{port}: {exc}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as clients try it
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            # TIME_WAIT connections of a previous server must not block a fixed port
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as exc:
            sock.close()
            if error is None or exc.errno == errno.EADDRINUSE:
                error = exc
    if error is not None and error.errno == errno.EADDRINUSE:
        raise FastcommError(f"port {port} on {host} is already in use (another process holds it)")
    raise FastcommError(f"cannot serve the store on {host}:{port}: {error}")


def _serve(host: str, port: int, timeout: timedelta, **kwargs) -> dist.TCPStore:
    """A ``TCPStore`` server listening on ``host:port`` only (see the module docstring)."""
    sock = _listen(host, port)
    try:
        fd = os.dup(sock.fileno())  # the store owns (and closes) the descriptor it is given
        try:
            return dist.TCPStore(
                host,
                sock.getsockname()[1],
                None,
                True,
                timeout,
                wait_for_workers=False,
                master_listen_fd=fd,
                **kwargs,
            )
        except BaseException:
            _close_if_ours(fd, sock)
            raise
    finally:
        sock.close()


# torch's client handshake waits for the server's reply without a timeout of its own
_ANSWER_GRACE_S = 2.0
# pause between two connection attempts to a port where nothing listens yet
_REFUSED_RETRY_S = 0.1


def _listening(host: str, port: int, limit: float) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (one attempt of at most
    ``limit`` s; refused, unreachable or unanswered: ``False``)."""
    try:
        with socket.create_connection((host, port), timeout=max(0.05, limit)):
            return True
    except OSError:
        return False


def _wait_listening(host: str, port: int, timeout: timedelta) -> None:
    """Returns once something listens at ``host:port``, retrying refused connections.

    A node started before the rendezvous host sees its connections refused: that is "nothing
    listening yet", to be retried by the caller until its own (join) timeout, never a verdict
    on what listens there.

    Raises:
        StoreTimeoutError: nothing accepted a connection within ``timeout``.
    """
    start = time.monotonic()
    deadline = start + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        if _listening(host, port, min(1.0, left)):
            return
        if time.monotonic() >= deadline:
            raise StoreTimeoutError(
                f"nothing is listening at {host}:{port} yet (connection refused or unanswered "
                f"for {time.monotonic() - start:.1f} s)"
            )
        time.sleep(min(_REFUSED_RETRY_S, max(0.0, deadline - time.monotonic())))


def _connect(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A ``TCPStore`` client of ``host:port``, or an error within ``timeout`` + 2 s.

    Refused connections are retried here until ``timeout`` (:func:`_wait_listening`): torch's
    client takes about ``timeout`` + 2 s to give up on a refused port, which read as "not a
    store" below. Once something accepts connections, torch's client is built on a helper
    thread: it waits for the server's handshake reply forever, so a port held by a program
    that accepts connections and never answers (not a store) would block the caller for good.
    If it has not returned by ``timeout`` + 2 s, that thread is left blocked (a daemon) and
    the port is reported as held by something that is not a store -- unless the port refuses
    connections again by then (the server went away meanwhile: nothing listening).

    Raises:
        StoreTimeoutError: nothing listened at ``host:port`` within ``timeout``.
        FastcommError: the listener accepted the connection but did not answer as a store.
        RuntimeError: torch's own error (the server went away during the handshake).
    """
    start = time.monotonic()
    _wait_listening(host, port, timeout)
    left = timedelta(seconds=max(1.0, timeout.total_seconds() - (time.monotonic() - start)))
    outcome: dict[str, Any] = {}

    def connect() -> None:
        try:
            outcome["store"] = dist.TCPStore(
                host, port, None, False, left, wait_for_workers=False
            )
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=connect, name=f"fastcomm-store-{host}:{port}", daemon=True)
    thread.start()
    thread.join(left.total_seconds() + _ANSWER_GRACE_S)
    if thread.is_alive():
        if not _listening(host, port, 1.0):
            raise StoreTimeoutError(
                f"nothing is listening at {host}:{port} any more (it accepted a connection "
                f"{time.monotonic() - start:.1f} s ago, then refused)"
            )
        raise FastcommError(
            f"port {port} on {host} is in use by a program that is not a store: it accepted the "
            f"connection but did not answer within {left.total_seconds() + _ANSWER_GRACE_S:g} s"
        )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["store"]


def _close_if_ours(fd: int, sock: socket.socket) -> None:
    """Closes ``fd`` if it still is the dup of ``sock`` (a store that failed may have closed it
    already, and the number may be reused since)."""
    try:
        mine, theirs = os.fstat(sock.fileno()), os.fstat(fd)
    except OSError:
        return
    if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino):
        os.close(fd)


class AnswerGuard:
    """Bounds how long a client's store operations may wait for the server's answer.

    torch's client waits for an answer without a limit of its own: a server that stops
    answering without closing the connection (its machine powered off, its process stopped)
    blocks the caller for good, signal handlers included (Python runs them between bytecodes,
    and the call never returns). With a guard, each operation runs on one helper thread while
    the caller waits at most ``limit`` s for it, calling ``interrupt`` every 0.1 s (which may
    raise, e.g. on a stop signal). The first operation left unanswered marks the connection
    lost: the helper thread stays blocked (a daemon) and every later operation fails at once,
    since a late answer would be read as the reply to the wrong request.

    Args:
        limit: seconds an operation may wait for its answer.
        interrupt: called while waiting; what it raises is raised by the operation.
    """

    def __init__(self, limit: float, interrupt: Callable[[], None] | None = None) -> None:
        if not limit > 0:
            raise ValueError(f"limit must be positive seconds, got {limit!r}")
        self.limit = float(limit)
        self.interrupt = interrupt
        self.lost: str | None = None
        """Why the connection is considered lost (``None`` while it answers)."""
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while True:
            fn, args, box, done = self._jobs.get()
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # handed to the waiting caller
                box["error"] = exc
            done.set()

    def call(self, what: str, fn: Callable, *args, extra: float = 0.0):
        """``fn(*args)`` on the helper thread, waited for at most ``limit`` + ``extra`` s
        (``extra``: how long the operation itself may wait at the server, e.g. for a key).

        Raises:
            StoreTimeoutError: no answer within ``limit`` s (now, or to an earlier call).
        """
        if self.lost is not None:
            raise StoreTimeoutError(self.lost)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fastcomm-store-calls",
                                            daemon=True)
            self._thread.start()
        box: dict[str, Any] = {}
        done = threading.Event()
        start = time.monotonic()
        self._jobs.put((fn, args, box, done))
        while not done.wait(0.1):
            waited = time.monotonic() - start
            if waited >= self.limit + extra:
                self.lost = f"no answer to {what} for {waited:.1f} s"
                raise StoreTimeoutError(self.lost)
            if self.interrupt is not None:
                try:
                    self.interrupt()
                except BaseException:
                    # the call may still be answered, but nobody will read that answer
                    self.lost = f"{what} was interrupted before its answer came"
                    raise
        if "error" in box:
            raise box["error"]
        return box.get("value")


class Store:
    """A namespace in a TCP key-value store shared by all ranks of a job.

    Args:
        host: address of the server (for a server: the address it listens on, and reports to
            clients; never every interface unless ``host`` is ``0.0.0.0``/``::``).
        port: TCP port; ``0`` with ``is_server=True`` binds a free port (read it from ``.port``).
        is_server: whether this process hosts the ``TCPStore`` server.
        timeout: default timeout of blocking calls (seconds or ``timedelta``; default
            :data:`DEFAULT_TIMEOUT`).
        prefix: namespace prepended to every key (``""``: the root).
        rank: this process's rank, only used to name it in error messages.

    Raises:
        StoreTimeoutError: a client could not reach the server within ``timeout``.
        FastcommError: a server's port is already in use, ``host`` is not an address of
            this machine, or a client's port is held by a program that is not a store.
        ValueError: the job secret in the environment is malformed (see
            :func:`job_secret_from_env`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        is_server: bool = False,
        timeout: float | timedelta | None = None,
        prefix: str = "",
        rank: int | None = None,
        _base: dist.Store | None = None,
        _root: dist.Store | None = None,
        _secret: bytes | None | object = _FROM_ENV,
        _guard: AnswerGuard | None = None,
    ) -> None:
        self.timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)
        self.guard = _guard
        """The :class:`AnswerGuard` bounding this client's operations (``None``: unbounded);
        set it with :meth:`bound_answers`, shared by every namespace made from this one
        afterwards."""
        self.prefix = prefix
        self.rank = rank
        self._secret = job_secret_from_env() if _secret is _FROM_ENV else _secret
        if _root is not None:
            self._root = _root
        else:
            if not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
            if port == 0 and not is_server:
                raise ValueError("a store client needs the server's port; port=0 is server-only")
            start = time.monotonic()
            try:
                if is_server:
                    self._root = _serve(host, port, self.timeout)
                else:
                    self._root = _connect(host, port, self.timeout)
            except StoreTimeoutError as exc:
                raise StoreTimeoutError(f"{self._who()}{exc}") from None
            except FastcommError as exc:
                raise FastcommError(f"{self._who()}{exc}") from None
            except RuntimeError as exc:
                elapsed = time.monotonic() - start
                role = "serve" if is_server else "reach"
                raise StoreTimeoutError(
                    f"{self._who()}could not {role} the store at {host}:{port} "
                    f"after {elapsed:.1f} s: {exc}"
                ) from exc
        if _base is not None:
            self._store = _base
        elif prefix:
            self._store = dist.PrefixStore(prefix, self._root)
        else:
            self._store = self._root
        # a store written in Python (etcd) is called directly, keys prefixed here: through
        # torch's C++ PrefixStore, a call that the interpreter's finalization catches in a
        # daemon thread ends the process (std::terminate as the thread exits in C++ frames)
        self._ops = _Prefixed(self._root, prefix) if getattr(
            self._root, "called_directly", False) else self._store

    @classmethod
    def on_etcd(
        cls,
        endpoints: str | Sequence[str],
        prefix: str,
        *,
        timeout: float | timedelta | None = None,
        rank: int | None = None,
        request_timeout: float = 5.0,
        _secret: bytes | None | object = _FROM_ENV,
    ) -> Store:
        """A store whose keys live in an etcd cluster, under ``prefix``: no process of the
        job serves it, so any node may die (see :class:`~.etcd_store.EtcdStore`). Values are
        signed with the job's secret as with a ``TCPStore``.

        Args:
            endpoints: the members' client addresses, ``"host:port,host:port"`` or a list.
            prefix: the job's namespace in etcd (one per job: etcd keeps keys after it).
            timeout, rank: as the constructor's.
            request_timeout: seconds one request to one member may take before the next
                member is tried.
            _secret: the job secret (default: from the environment, as the constructor's).

        Raises:
            ValueError, TypeError: malformed endpoints, prefix, timeout or job secret.
        """
        from .etcd_store import EtcdStore  # etcd only where asked for

        limit = as_timedelta(timeout, DEFAULT_TIMEOUT)
        root = EtcdStore(endpoints, prefix, limit, request_timeout=request_timeout)
        return cls(timeout=limit, rank=rank, _root=root, _secret=_secret)

    # ------------------------------------------------------------------ identity
    @property
    def host(self) -> str:
        """The server's address (``"?"`` when torch does not say)."""
        return getattr(_unwrap(self._root), "host", "?")

    @property
    def port(self) -> int:
        """The server's TCP port (``-1`` when torch does not say)."""
        return getattr(_unwrap(self._root), "port", -1)

    @property
    def address(self) -> str:
        """``host:port`` (``etcd://host:port,.../prefix`` in etcd), as error messages name the
        store."""
        return getattr(_unwrap(self._root), "address", None) or f"{self.host}:{self.port}"

    @property
    def torch_store(self) -> dist.Store:
        """The underlying c10d store (prefixed), e.g. to build a ``ProcessGroupGloo`` on."""
        return self._store

    @property
    def signed(self) -> bool:
        """Whether object values are signed with a job secret (see the module docstring)."""
        return self._secret is not None

    def prefixed(self, prefix: str, *, rank: int | None = None) -> Store:
        """Returns a view of this store in the namespace ``prefix`` (nested under ours)."""
        if not prefix:
            raise ValueError("prefix must be a non-empty string")
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        return Store(
            timeout=self.timeout,
            prefix=full,
            rank=self.rank if rank is None else rank,
            _base=dist.PrefixStore(prefix, self._store),
            _root=self._root,
            _secret=self._secret,
            _guard=self.guard,
        )

    def root(self) -> Store:
        """A view of the same store with no prefix (another connection is not opened)."""
        return Store(timeout=self.timeout, rank=self.rank, _base=self._root, _root=self._root,
                     _secret=self._secret, _guard=self.guard)

    def bound_answers(self, limit: float, interrupt: Callable[[], None] | None = None) -> None:
        """Has every later operation of this view (and of the namespaces made from it
        afterwards) wait at most ``limit`` s for the server's answer (see
        :class:`AnswerGuard`)."""
        self.guard = AnswerGuard(limit, interrupt)

    def __repr__(self) -> str:
        return f"Store({self.address}, prefix={self.prefix!r}, rank={self.rank})"

    # ------------------------------------------------------------------ raw ops
    def _who(self) -> str:
        return f"rank {self.rank}: " if self.rank is not None else ""

    def _key_name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _timeout_error(self, keys: Sequence[str], op: str, start: float, exc: Exception):
        elapsed = time.monotonic() - start
        names = ", ".join(repr(self._key_name(k)) for k in keys)
        of = f" of key {names}" if names else ""
        if isinstance(exc, dist.DistNetworkError):  # the server is gone (or unreachable)
            return StoreTimeoutError(
                f"{self._who()}lost the connection to the store at {self.address} "
                f"(store {op}{of}, after {elapsed:.1f} s): {exc}"
            )
        return StoreTimeoutError(
            f"{self._who()}store {op}{of} at {self.address} timed out after "
            f"{elapsed:.1f} s: {exc}"
        )

    def _call(self, op: str, keys: Sequence[str], fn, *args):
        """Runs a raw c10d operation; a lost server is named (address, key, rank)."""
        start = time.monotonic()
        try:
            if self.guard is not None:
                names = ", ".join(repr(self._key_name(k)) for k in keys)
                return self.guard.call(f"store {op} of {names} at {self.address}", fn, *args)
            return fn(*args)
        except dist.DistNetworkError as exc:
            raise self._timeout_error(keys, op, start, exc) from exc

    def set(self, key: str, value: bytes | str) -> None:
        """Sets ``key`` to ``value`` (a ``str`` is stored UTF-8 encoded)."""
        self._call("set", [key], self._ops.set, key, _to_bytes(value))

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        """Returns the value of ``key``, waiting up to ``timeout`` for it to be set."""
        self.wait([key], timeout, op="get")
        return self._call("get", [key], self._ops.get, key)

    def wait(
        self,
        keys: Iterable[str],
        timeout: float | timedelta | None = None,
        *,
        op: str = "wait",
    ) -> None:
        """Blocks until every key in ``keys`` is set, or raises ``StoreTimeoutError``."""
        keys = list(keys)
        if not keys:
            return
        limit = as_timedelta(timeout, self.timeout)
        start = time.monotonic()
        try:
            if self.guard is not None:
                names = ", ".join(repr(self._key_name(k)) for k in keys)
                self.guard.call(f"store {op} of {names} at {self.address}", self._ops.wait,
                                keys, limit, extra=limit.total_seconds())
            else:
                self._ops.wait(keys, limit)
        except StoreTimeoutError:
            raise
        except RuntimeError as exc:  # DistStoreError / DistNetworkError derive from it
            raise self._timeout_error(keys, op, start, exc) from exc

    def check(self, keys: Iterable[str], *, stale_ok: bool = False) -> bool:
        """Whether every key in ``keys`` is set (does not wait).

        ``stale_ok``: in etcd, answered by the nearest member without a round to the leader
        (no wait while the members elect one); a key set an instant ago may be reported unset,
        never the reverse. For a poll that looks again (a ``TCPStore`` answers as without it).
        """
        keys = list(keys)
        root = self._root
        if stale_ok and hasattr(root, "check_stale"):
            full = [self._key_name(k) for k in keys]
            return bool(self._call("check", keys, root.check_stale, full))
        return bool(self._call("check", keys, self._ops.check, keys))

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically adds ``amount`` to the integer at ``key`` and returns the new value."""
        return int(self._call("add", [key], self._ops.add, key, int(amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (``b""``: unset); returns the
        value after the call."""
        return self._call(
            "compare_set",
            [key],
            self._ops.compare_set,
            key,
            _to_bytes(expected),
            _to_bytes(desired),
        )

    def delete(self, key: str) -> bool:
        """Deletes ``key``; returns whether it was set."""
        return bool(self._call("delete", [key], self._ops.delete_key, key))

    def num_keys(self) -> int:
        """Keys in the whole store (every namespace: torch counts them at the server; in
        etcd, every key under the store's etcd prefix)."""
        return int(self._call("num_keys", [], self._ops.num_keys))

    # ------------------------------------------------------------------ object values
    def encode(self, key: str, obj: Any) -> bytes:
        """``obj`` as it is stored under ``key``: JSON, signed when the job has a secret.

        Raises:
            TypeError: ``obj`` is not made of the types the module docstring lists.
        """
        return encode_value(obj, self._key_name(key), self._secret)

    def decode(self, key: str, data: bytes) -> Any:
        """The object ``data`` (read from ``key``) holds, once its signature checks out.

        Raises:
            FastcommError: ``data`` is not a value ``encode`` made for ``key`` with this job's
                secret (tampered, foreign, e.g. a pickle, or unsigned in a signed job).
        """
        try:
            return decode_value(data, self._key_name(key), self._secret)
        except ValueError as exc:
            raise FastcommError(
                f"{self._who()}refusing the value of store key {self._key_name(key)!r} at "
                f"{self.address}: {exc}"
            ) from None

    # ------------------------------------------------------------------ helpers
    def barrier(
        self,
        name: str,
        world_size: int,
        timeout: float | timedelta | None = None,
    ) -> None:
        """Waits until ``world_size`` processes have entered the barrier ``name``.

        The last process to arrive sets ``<name>/done``; the error on timeout says how many of
        ``world_size`` arrived.
        """
        _check_world(world_size)
        arrived = self.add(f"{name}/arrived", 1)
        if arrived == world_size:
            self.set(f"{name}/done", b"1")
        start = time.monotonic()
        try:
            self.wait([f"{name}/done"], timeout, op="barrier")
        except StoreTimeoutError as exc:
            try:
                now = self.add(f"{name}/arrived", 0)
            except StoreTimeoutError:
                raise exc from None  # the store is gone: the count cannot be read
            raise StoreTimeoutError(
                f"{exc} ({now} of {world_size} processes reached barrier {name!r} "
                f"in {time.monotonic() - start:.1f} s)"
            ) from exc

    def all_gather_object(
        self,
        name: str,
        rank: int,
        world_size: int,
        obj: Any,
        timeout: float | timedelta | None = None,
    ) -> list[Any]:
        """Every rank contributes ``obj``; returns the list in rank order.

        ``obj`` travels as JSON (see the module docstring): tuples and bytes come back as
        such, anything else raises ``TypeError`` before anything is written.

        Raises:
            TypeError: ``obj`` is not JSON-encodable as described.
            FastcommError: a rank's value failed the check (names its key), on every rank.
        """
        _check_world(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        mine = f"{name}/{rank}"
        self.set(mine, self.encode(mine, obj))
        keys = [f"{name}/{r}" for r in range(world_size)]
        self.wait(keys, timeout, op="all_gather_object")
        return [self.decode(k, self._call("get", [k], self._ops.get, k)) for k in keys]

    def broadcast_object(
        self,
        name: str,
        obj: Any,
        *,
        is_source: bool,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """The source publishes ``obj`` under ``name``; everyone returns it (e.g. an NCCL id).

        Same encoding and errors as :meth:`all_gather_object`.
        """
        key = f"{name}/value"
        if is_source:
            self.set(key, self.encode(key, obj))
            return obj
        return self.decode(key, self.get(key, timeout))


class _Prefixed:
    """The c10d operations of a store written in Python (``called_directly``), keys under
    ``prefix``: what ``dist.PrefixStore`` does, without torch's C++ between the caller and
    the store."""

    __slots__ = ("root", "prefix")

    def __init__(self, root, prefix: str) -> None:
        self.root = root
        self.prefix = f"{prefix}/" if prefix else ""

    def set(self, key: str, value: bytes) -> None:
        self.root.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        return self.root.get(self.prefix + key)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.root.wait([self.prefix + k for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        return self.root.check([self.prefix + k for k in keys])

    def add(self, key: str, amount: int) -> int:
        return self.root.add(self.prefix + key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self.root.compare_set(self.prefix + key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.root.delete_key(self.prefix + key)

    def num_keys(self) -> int:
        return self.root.num_keys()


def _unwrap(store: dist.Store) -> dist.Store:
    """The root store under nested PrefixStores (for naming its address in errors)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
