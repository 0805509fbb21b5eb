"""Host-side key-value store used for rendezvous.

``Store`` wraps torch's ``TCPStore`` (one server, many clients) and ``PrefixStore`` (namespaces);
fastcomm never runs a server of its own. Every blocking call takes a timeout and, when it runs
out, raises :class:`StoreTimeoutError` naming the key, the server's ``host:port``, the rank (if
known) and the elapsed time, instead of torch's bare ``wait timeout after 300000ms``.

Helpers built on the raw operations (``barrier``, ``all_gather_object``, ``broadcast_object``)
need a name that is unique per use: the store keeps every key it was given, so reusing a name
would read the previous round's values. Callers pass ``name`` built from a sequence number.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import StoreTimeoutError

__all__ = ["DEFAULT_TIMEOUT", "Store", "as_timedelta"]

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""How long a store wait, a rendezvous or a collective may take when no timeout is given (the
one default of the store, every communicator and ``fastcomm.init``)."""


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


class Store:
    """A namespace in a TCP key-value store shared by all ranks of a job.

    Args:
        host: address of the server (for a server: the address it reports to clients).
        port: TCP port; ``0`` with ``is_server=True`` binds a free port (read it from ``.port``).
        is_server: whether this process hosts the ``TCPStore`` server.
        timeout: default timeout of blocking calls (seconds or ``timedelta``; default
            :data:`DEFAULT_TIMEOUT`).
        prefix: namespace prepended to every key (``""``: the root).
        rank: this process's rank, only used to name it in error messages.

    Raises:
        StoreTimeoutError: a client could not reach the server within ``timeout``.
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
        _root: dist.TCPStore | None = None,
    ) -> None:
        self.timeout = as_timedelta(timeout, DEFAULT_TIMEOUT)
        self.prefix = prefix
        self.rank = rank
        if _root is not None:
            self._root = _root
        else:
            if not isinstance(port, int) or not 0 <= port < 65536:
                raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
            if port == 0 and not is_server:
                raise ValueError("a store client needs the server's port; port=0 is server-only")
            start = time.monotonic()
            try:
                self._root = dist.TCPStore(
                    host,
                    port,
                    None,
                    is_server,
                    self.timeout,
                    wait_for_workers=False,
                )
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
        """``host:port``, as error messages name the store."""
        return f"{self.host}:{self.port}"

    @property
    def torch_store(self) -> dist.Store:
        """The underlying c10d store (prefixed), e.g. to build a ``ProcessGroupGloo`` on."""
        return self._store

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
        )

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
        return StoreTimeoutError(
            f"{self._who()}store {op} of key {names} at {self.address} timed out after "
            f"{elapsed:.1f} s: {exc}"
        )

    def set(self, key: str, value: bytes | str) -> None:
        """Sets ``key`` to ``value`` (a ``str`` is stored UTF-8 encoded)."""
        self._store.set(key, _to_bytes(value))

    def get(self, key: str, timeout: float | timedelta | None = None) -> bytes:
        """Returns the value of ``key``, waiting up to ``timeout`` for it to be set."""
        self.wait([key], timeout, op="get")
        return self._store.get(key)

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
            self._store.wait(keys, limit)
        except RuntimeError as exc:  # DistStoreError / DistNetworkError derive from it
            raise self._timeout_error(keys, op, start, exc) from exc

    def check(self, keys: Iterable[str]) -> bool:
        """Whether every key in ``keys`` is set (does not wait)."""
        return bool(self._store.check(list(keys)))

    def add(self, key: str, amount: int = 1) -> int:
        """Atomically adds ``amount`` to the integer at ``key`` and returns the new value."""
        return int(self._store.add(key, int(amount)))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (``b""``: unset); returns the
        value after the call."""
        return self._store.compare_set(key, _to_bytes(expected), _to_bytes(desired))

    def delete(self, key: str) -> bool:
        """Deletes ``key``; returns whether it was set."""
        return bool(self._store.delete_key(key))

    def num_keys(self) -> int:
        """Keys in the whole store (every namespace: torch counts them at the server)."""
        return int(self._store.num_keys())

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
            now = self.add(f"{name}/arrived", 0)
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
        """Every rank contributes a picklable ``obj``; returns the list in rank order."""
        _check_world(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.set(f"{name}/{rank}", pickle.dumps(obj))
        keys = [f"{name}/{r}" for r in range(world_size)]
        self.wait(keys, timeout, op="all_gather_object")
        return [pickle.loads(self._store.get(k)) for k in keys]

    def broadcast_object(
        self,
        name: str,
        obj: Any,
        *,
        is_source: bool,
        timeout: float | timedelta | None = None,
    ) -> Any:
        """The source publishes ``obj`` under ``name``; everyone returns it (e.g. an NCCL id)."""
        key = f"{name}/value"
        if is_source:
            self.set(key, pickle.dumps(obj))
            return obj
        return pickle.loads(self.get(key, timeout))


def _unwrap(store: dist.Store) -> dist.Store:
    """The TCPStore under nested PrefixStores (for naming its address in errors)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _check_world(world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
