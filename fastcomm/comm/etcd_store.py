"""``EtcdStore``: a ``torch.distributed.Store`` whose keys live in an etcd cluster.

It does what torch's ``TCPStore`` does for Gloo, ``init_process_group`` and fastcomm's
:class:`~.store.Store`, with no process of the job serving it: any node may die, the keys stay
in etcd (replicated on its members). Every key of one store lives under ``<prefix>/``; a
prefix names one job (or one round of it): etcd keeps the keys after the job, so a new job
takes a new prefix, or :meth:`EtcdStore.clear` empties the old one first.

Invariants (as ``TCPStore``'s): ``get`` and ``wait`` block until the keys exist, at most the
store's timeout, then raise ``torch.distributed.DistStoreError`` naming the keys and the
elapsed time; ``compare_set`` returns the value after the call (the expected value itself
when the key does not exist and ``expected`` is not empty); ``add`` keeps a decimal integer.
A cluster that cannot serve a call within the timeout raises ``DistNetworkError`` saying
whether it lost its majority or cannot be reached, member by member.

How to run a cluster and point fastcomm at it: docs/etcd.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from .etcd import RECEIPT_PREFIX, EtcdClient, EtcdUnavailableError, EtcdWaitTimeout
from .store import DEFAULT_TIMEOUT, as_timedelta

__all__ = ["EtcdStore", "EtcdStoreTimeoutError", "EtcdStoreUnavailableError"]


class EtcdStoreTimeoutError(EtcdWaitTimeout, dist.DistStoreError):
    """A key waited for by ``get``/``wait`` was not set within the timeout (torch's
    ``DistStoreError``, as ``TCPStore`` raises)."""


class EtcdStoreUnavailableError(EtcdUnavailableError, dist.DistNetworkError):
    """No etcd member served a store call within the timeout (torch's ``DistNetworkError``,
    as ``TCPStore`` raises when its server is gone)."""


def _bytes(value: bytes | str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__}")


class EtcdStore(dist.Store):
    """A c10d store in an etcd cluster, under ``prefix``.

    Args:
        endpoints: the etcd members' client addresses, ``"host:port,host:port"`` or a list.
        prefix: the namespace of this store's keys (e.g. the job's id); not empty.
        timeout: how long ``get``/``wait`` wait for a key, and any call for the cluster
            (seconds or ``timedelta``; default :data:`~.store.DEFAULT_TIMEOUT`).
        request_timeout: seconds one request to one member may take before the next member
            is tried.

    Raises:
        ValueError, TypeError: malformed endpoints, prefix or timeouts.
    """

    called_directly = True
    """``fastcomm.Store`` calls this store's methods from Python (keys prefixed there), not
    through torch's C++ ``PrefixStore``."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        prefix: str,
        timeout: float | timedelta | None = None,
        *,
        request_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        if not isinstance(prefix, str) or not prefix.strip("/"):
            raise ValueError(f"an etcd store needs a non-empty prefix (the job's), got "
                             f"{prefix!r}")
        self.prefix = prefix.strip("/")
        if (self.prefix + "/").startswith(RECEIPT_PREFIX.split("/")[0] + "/"):
            raise ValueError(f"prefix {prefix!r} is the etcd client's own ({RECEIPT_PREFIX})")
        self.set_timeout(as_timedelta(timeout, DEFAULT_TIMEOUT))
        # the add receipts beside the prefix (not under it: num_keys counts the store's keys),
        # so that deleting the job's keys deletes them too, a killed process's included
        self.client = EtcdClient(endpoints, request_timeout=request_timeout,
                                 timeout=self.timeout.total_seconds(),
                                 receipts=f"{self.prefix}.receipts/")

    @property
    def endpoints(self) -> tuple[str, ...]:
        return self.client.endpoints

    @property
    def address(self) -> str:
        """``etcd://host:port,.../prefix``, as error messages (and ``FASTCOMM_STORE``) name
        the store."""
        return f"etcd://{','.join(self.endpoints)}/{self.prefix}"

    def __repr__(self) -> str:
        return f"EtcdStore({self.address})"

    def _full(self, key: str) -> bytes:
        if not isinstance(key, str):
            raise TypeError(f"store keys must be str, got {type(key).__name__}")
        return f"{self.prefix}/{key}".encode()

    def _limit(self) -> float:
        return self.timeout.total_seconds()

    def _do(self, fn, *args, **kwargs):
        """Runs a client call; a cluster that cannot serve it raises torch's network error."""
        try:
            return fn(*args, **kwargs)
        except EtcdStoreUnavailableError:
            raise
        except EtcdUnavailableError as exc:
            raise EtcdStoreUnavailableError(str(exc)) from None

    # ------------------------------------------------------------------ c10d operations
    def set(self, key: str, value: bytes | str) -> None:
        self._do(self.client.put, self._full(key), _bytes(value), timeout=self._limit())

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to the store's timeout for it to be set."""
        full = self._full(key)
        deadline = time.monotonic() + self._limit()
        while True:
            left = max(deadline - time.monotonic(), 1e-3)
            kv = self._do(self.client.get, full, timeout=left)
            if kv is not None:
                return kv.value
            self.wait([key], timedelta(seconds=left))

    def add(self, key: str, value: int) -> int:
        return self._do(self.client.add, self._full(key), int(value), timeout=self._limit())

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        """Sets ``key`` to ``desired`` if it holds ``expected`` (``b""``: it does not exist or
        is empty); returns the value after the call, as ``TCPStore`` does (``expected`` when
        the key does not exist and ``expected`` is not empty)."""
        full, expected, desired = self._full(key), _bytes(expected), _bytes(desired)
        cas = self.client.compare_and_set
        deadline = time.monotonic() + self._limit()
        while True:
            left = max(deadline - time.monotonic(), 1e-3)
            if expected:
                done, now = self._do(cas, full, desired, prev_value=expected, timeout=left)
                return desired if done else (expected if now is None else now.value)
            done, now = self._do(cas, full, desired, prev_version=0, timeout=left)
            if done:
                return desired
            if now is not None and now.value:
                return now.value
            if now is not None:  # it exists and is empty: equal to expected
                done, _ = self._do(cas, full, desired, prev_mod_revision=now.mod_revision,
                                   timeout=left)
                if done:
                    return desired
            if time.monotonic() >= deadline:  # changed under us every time
                raise EtcdStoreUnavailableError(
                    f"etcd compare_set of key {full.decode()!r} at {self.address}: the key "
                    f"changed under every attempt for {self._limit():.1f} s")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Blocks until every key exists, at most ``timeout`` (default the store's)."""
        limit = (timeout or self.timeout).total_seconds()
        if limit <= 0:  # torch's "no timeout"
            limit = self._limit()
        try:
            self._do(self.client.wait, [self._full(k) for k in keys], limit)
        except EtcdWaitTimeout as exc:
            raise EtcdStoreTimeoutError(str(exc)) from None

    def check(self, keys: list[str]) -> bool:
        absent, _ = self._do(self.client.missing, [self._full(k) for k in keys],
                             timeout=self._limit())
        return not absent

    def check_stale(self, keys: list[str]) -> bool:
        """``check`` answered by the nearest member without a round to the leader, so during an
        election too: a key set an instant ago may be reported missing (never the reverse)."""
        absent, _ = self._do(self.client.missing, [self._full(k) for k in keys],
                             timeout=self._limit(), serializable=True)
        return not absent

    def delete_key(self, key: str) -> bool:
        return self._do(self.client.delete, self._full(key), timeout=self._limit())

    def num_keys(self) -> int:
        """Keys under this store's prefix."""
        return self._do(self.client.count, f"{self.prefix}/", timeout=self._limit())

    # ------------------------------------------------------------------ lifetime
    def clear(self) -> int:
        """Deletes every key under the prefix (a job's prefix reused); returns how many."""
        return self._do(self.client.delete_prefix, f"{self.prefix}/", timeout=self._limit())

    def clone(self) -> EtcdStore:
        """Another client of the same keys (torch clones a store for each thread that needs
        its own connection)."""
        return EtcdStore(self.endpoints, self.prefix, self.timeout,
                         request_timeout=self.client.request_timeout)

    def close(self) -> None:
        """Closes the connections (the keys stay in etcd)."""
        self.client.close()
