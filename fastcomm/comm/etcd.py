"""A small etcd v3 client over etcd's JSON gateway (HTTP/1.1 and the standard library only).

:class:`EtcdClient` speaks to the members of one etcd cluster (``host:port,...``). Every call
goes to the member that answered last and fails over to the next one when a member does not
answer (connection refused, no answer within ``request_timeout``, or an answer that says it
cannot serve now: no leader, request timed out); a call gives up once its own ``timeout`` has
passed. Reads are linearizable (etcd's default), so a member cut off from the majority cannot
answer with stale data: it times out and the call moves on.

Invariants: every call is bounded (each HTTP request by ``request_timeout``, the call with its
retries by ``timeout``; :meth:`EtcdClient.wait` by its timeout); every error names the
operation, the key, the endpoints and the elapsed time; :meth:`EtcdClient.add` applies its
amount exactly once even when an answer is lost and the call is retried on another member (a
receipt key of this client is written in the same transaction and compared on retry). No torch
import: the launcher may use it.

How to run a cluster and use it as fastcomm's store: docs/etcd.md.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterable, Sequence

from .etcd_wire import (
    EtcdError,
    EtcdUnavailableError,
    EtcdWaitTimeout,
    KeyValue,
    _as_bytes,
    _b64,
    _Failure,
    _key,
    _kv,
    _Member,
    _positive,
    _range_end,
    parse_endpoints,
)

__all__ = [
    "EtcdClient",
    "EtcdError",
    "EtcdUnavailableError",
    "EtcdWaitTimeout",
    "KeyValue",
    "Lease",
    "parse_endpoints",
]

DEFAULT_REQUEST_TIMEOUT = 5.0
"""Seconds one HTTP request to one member may take before the call tries the next member
(etcd's own limit for a request without a majority is 7 s)."""
DEFAULT_TIMEOUT = 30.0
"""Seconds a call may take with its failovers, when the caller gives none."""
RECEIPT_PREFIX = "fastcomm-etcd/add-receipts/"
"""Where each client keeps its :meth:`EtcdClient.add` receipt (one key, on a lease)."""
RECEIPT_TTL_S = 24 * 3600
_MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
_BACKOFF_S = (0.02, 0.5)  # first and longest pause between two rounds over the members
_STATUS_PROBE_S = 0.5  # how long a failed call spends asking members why
_LAST_TRY_S = 0.05  # a call whose time is up before its first request still makes one


# ---------------------------------------------------------------------- the client
class EtcdClient:
    """A client of one etcd cluster (v3 API over its JSON gateway).

    Args:
        endpoints: the members' client addresses, ``"host:port,host:port"`` or a list.
        request_timeout: seconds one request to one member may take before the next member
            is tried (default 5).
        timeout: seconds a call may take with its failovers when it is given none (default
            30).
        receipts: the prefix of this client's :meth:`add` receipt key (default
            ``RECEIPT_PREFIX``; a store puts it beside its own keys, so that they go together).

    Raises:
        ValueError, TypeError: malformed endpoints or timeouts.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        timeout: float = DEFAULT_TIMEOUT,
        receipts: str = RECEIPT_PREFIX,
    ) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.request_timeout = _positive(request_timeout, "request_timeout")
        self.timeout = _positive(timeout, "timeout")
        self._members = [_Member(e) for e in self.endpoints]
        self._preferred = 0
        self._add_lock = threading.Lock()
        self._receipt = f"{receipts}{uuid.uuid4().hex}".encode()
        self._receipt_rev = 0  # the receipt's mod_revision as this client last saw it
        self._receipt_lease: int | None = None

    def __repr__(self) -> str:
        return f"EtcdClient({','.join(self.endpoints)})"

    # ------------------------------------------------------------------ transport
    def _describe(self, op: str, key: bytes | None) -> str:
        of = f" of key {key.decode(errors='replace')!r}" if key is not None else ""
        return f"etcd {op}{of} at {','.join(self.endpoints)}"

    def _call(self, op: str, key: bytes | None, path: str, body: dict,
              timeout: float | None = None) -> dict:
        """``body`` POSTed to ``path`` on the first member that serves it.

        Raises:
            EtcdError: a member refused the request for good (its answer in the message).
            EtcdUnavailableError: no member served it within ``timeout``.
        """
        limit = self.timeout if timeout is None else _positive(timeout, "timeout")
        start = time.monotonic()
        deadline = start + limit
        failures: dict[str, _Failure] = {}
        pause = _BACKOFF_S[0]
        while True:
            first = self._preferred
            for i in range(len(self._members)):
                left = deadline - time.monotonic()
                if left <= 0 and failures:
                    break
                index = (first + i) % len(self._members)
                member = self._members[index]
                try:
                    limit_now = min(self.request_timeout, max(left, _LAST_TRY_S))
                    answer = member.request(path, body, limit_now)
                except _Failure as failure:
                    failures[member.endpoint] = failure
                    if not failure.retry:
                        raise EtcdError(
                            f"{self._describe(op, key)}: {member.endpoint} refused it after "
                            f"{time.monotonic() - start:.1f} s: {failure.reason}",
                        ) from None
                    continue
                self._preferred = index
                return answer
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unavailable(op, key, start, failures)
            time.sleep(min(pause, left))
            pause = min(pause * 2, _BACKOFF_S[1])

    def _unavailable(self, op: str, key: bytes | None, start: float,
                     failures: dict[str, _Failure]) -> EtcdUnavailableError:
        """The error of a call no member served: unreachable, or without a majority."""
        elapsed = time.monotonic() - start
        reached = [e for e, f in failures.items() if f.reached]
        notes = {e: f.reason for e, f in failures.items()}
        leaderless = []
        probe_end = time.monotonic() + _STATUS_PROBE_S
        for endpoint in reached:  # ask the members that answered why they could not serve
            left = probe_end - time.monotonic()
            if left <= 0:
                break
            member = self._members[self.endpoints.index(endpoint)]
            try:
                status = member.request("/v3/maintenance/status", {}, left)
            except _Failure:
                continue
            if int(status.get("leader", 0)) == 0 or any(
                "no leader" in str(e) for e in status.get("errors", ())
            ):
                leaderless.append(endpoint)
                notes[endpoint] += " (it has no leader)"
        unreached = len(self.endpoints) - len(reached)
        if not reached:
            why = (f"the etcd cluster cannot be reached (none of its {len(self.endpoints)} "
                   "member(s) answered)")
        elif leaderless:
            why = (f"the etcd cluster lost its majority ({unreached} of {len(self.endpoints)} "
                   f"member(s) cannot be reached, and the others have no leader)")
        else:
            why = (f"the etcd cluster lost its majority or cannot be reached ({len(reached)} of "
                   f"{len(self.endpoints)} member(s) answered, none could serve it)")
        detail = "; ".join(f"{e}: {notes.get(e, 'not tried')}" for e in self.endpoints)
        return EtcdUnavailableError(
            f"{self._describe(op, key)} failed after {elapsed:.1f} s: {why}: {detail}"
        )

    # ------------------------------------------------------------------ keys
    def put(self, key: bytes | str, value: bytes | str, *, lease: int = 0,
            timeout: float | None = None) -> int:
        """Sets ``key`` to ``value`` (attached to ``lease`` when not 0); returns the revision."""
        k = _key(key)
        body = {"key": _b64(k), "value": _b64(_as_bytes(value, "values"))}
        if lease:
            body["lease"] = str(int(lease))
        answer = self._call("put", k, "/v3/kv/put", body, timeout)
        return int(answer["header"]["revision"])

    def get(self, key: bytes | str, *, timeout: float | None = None) -> KeyValue | None:
        """The key (``None`` when it does not exist)."""
        k = _key(key)
        answer = self._call("get", k, "/v3/kv/range", {"key": _b64(k)}, timeout)
        kvs = answer.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes | str, *, timeout: float | None = None) -> list[KeyValue]:
        """Every key that starts with ``prefix``, in key order."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_range_end(p))}
        answer = self._call("get_prefix", p, "/v3/kv/range", body, timeout)
        return [_kv(item) for item in answer.get("kvs") or []]

    def count(self, prefix: bytes | str, *, timeout: float | None = None) -> int:
        """How many keys start with ``prefix``."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_range_end(p)), "count_only": True}
        return int(self._call("count", p, "/v3/kv/range", body, timeout).get("count", 0))

    def delete(self, key: bytes | str, *, timeout: float | None = None) -> bool:
        """Deletes ``key``; returns whether it existed."""
        k = _key(key)
        answer = self._call("delete", k, "/v3/kv/deleterange", {"key": _b64(k)}, timeout)
        return int(answer.get("deleted", 0)) > 0

    def delete_prefix(self, prefix: bytes | str, *, timeout: float | None = None) -> int:
        """Deletes every key that starts with ``prefix``; returns how many there were."""
        p = _key(prefix)
        body = {"key": _b64(p), "range_end": _b64(_range_end(p))}
        answer = self._call("delete_prefix", p, "/v3/kv/deleterange", body, timeout)
        return int(answer.get("deleted", 0))

    def delete_range(self, start: bytes | str, end: bytes | str, *,
                     timeout: float | None = None) -> int:
        """Deletes every key in ``[start, end)``; returns how many there were."""
        k, e = _key(start), _key(end)
        body = {"key": _b64(k), "range_end": _b64(e)}
        answer = self._call("delete_range", k, "/v3/kv/deleterange", body, timeout)
        return int(answer.get("deleted", 0))

    def compare_and_set(
        self,
        key: bytes | str,
        value: bytes | str,
        *,
        prev_value: bytes | str | None = None,
        prev_version: int | None = None,
        prev_create_revision: int | None = None,
        prev_mod_revision: int | None = None,
        lease: int = 0,
        timeout: float | None = None,
    ) -> tuple[bool, KeyValue | None]:
        """Sets ``key`` to ``value`` in one transaction if every condition given holds.

        Args:
            prev_value: the value the key must hold (a missing key holds none: never equal).
            prev_version: the key's version (``0``: the key must not exist).
            prev_create_revision, prev_mod_revision: the key's revisions (``0``: missing).

        Returns:
            ``(True, None)`` when it was set, else ``(False, the key as it is, or None)``.

        Raises:
            ValueError: no condition given.
        """
        k = _key(key)
        compare = []
        if prev_value is not None:
            compare.append({"target": "VALUE", "value": _b64(_as_bytes(prev_value, "values"))})
        for target, field, given in (("VERSION", "version", prev_version),
                                     ("CREATE", "create_revision", prev_create_revision),
                                     ("MOD", "mod_revision", prev_mod_revision)):
            if given is not None:
                compare.append({"target": target, field: str(int(given))})
        if not compare:
            raise ValueError("compare_and_set needs a condition (prev_value, prev_version, "
                             "prev_create_revision or prev_mod_revision)")
        for c in compare:
            c.update(key=_b64(k), result="EQUAL")
        put = {"key": _b64(k), "value": _b64(_as_bytes(value, "values"))}
        if lease:
            put["lease"] = str(int(lease))
        body = {"compare": compare, "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": _b64(k)}}]}
        answer = self._call("compare_and_set", k, "/v3/kv/txn", body, timeout)
        if answer.get("succeeded"):
            return True, None
        kvs = answer["responses"][0]["response_range"].get("kvs") or []
        return False, _kv(kvs[0]) if kvs else None

    def add(self, key: bytes | str, amount: int, *, timeout: float | None = None) -> int:
        """Adds ``amount`` to the integer at ``key`` (a missing key is 0); returns the sum.

        A transaction compares the key's revision and this client's receipt; it writes the
        sum to both. When an answer is lost and the request is retried (on this member or
        another), the receipt tells whether the lost one was applied, so the amount is added
        exactly once. Adding 0 to a key that exists only reads it (no write, no revision: the
        launcher reads its counters so, every tick).

        Raises:
            ValueError: the key holds something other than a decimal integer.
            TypeError: ``amount`` is not an int.
        """
        if isinstance(amount, bool) or not isinstance(amount, int):
            raise TypeError(f"etcd add amount must be an int, got {amount!r}")
        k = _key(key)
        limit = self.timeout if timeout is None else _positive(timeout, "timeout")
        if amount == 0:
            kv = self.get(k, timeout=limit)
            if kv is not None:
                return _integer(kv, k)
        deadline = time.monotonic() + limit
        with self._add_lock:  # one receipt per client: one add at a time
            current: KeyValue | None = None  # first guess: the key does not exist
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EtcdUnavailableError(
                        f"{self._describe('add', k)}: still contended after {limit:.1f} s")
                total = _integer(current, k) + amount
                lease = self._receipt_lease_id(left)
                revision = current.mod_revision if current else 0
                body = {
                    "compare": [
                        {"key": _b64(k), "target": "MOD", "result": "EQUAL",
                         "mod_revision": str(revision)},
                        {"key": _b64(self._receipt), "target": "MOD", "result": "EQUAL",
                         "mod_revision": str(self._receipt_rev)},
                    ],
                    "success": [
                        {"request_put": {"key": _b64(k), "value": _b64(str(total).encode())}},
                        {"request_put": {"key": _b64(self._receipt), "lease": str(lease),
                                         "value": _b64(str(total).encode())}},
                    ],
                    "failure": [{"request_range": {"key": _b64(k)}},
                                {"request_range": {"key": _b64(self._receipt)}}],
                }
                try:
                    answer = self._call("add", k, "/v3/kv/txn", body, left)
                except EtcdError as exc:
                    if "lease not found" not in str(exc):
                        raise
                    self._receipt_lease = None  # it expired: a new one, and try again
                    continue
                if answer.get("succeeded"):
                    self._receipt_rev = int(answer["header"]["revision"])
                    return total
                key_kvs, receipt_kvs = (r["response_range"].get("kvs") or []
                                        for r in answer["responses"])
                receipt = _kv(receipt_kvs[0]) if receipt_kvs else None
                if receipt is not None and receipt.mod_revision != self._receipt_rev:
                    # a request whose answer was lost was applied: its sum is the receipt's
                    self._receipt_rev = receipt.mod_revision
                    return int(receipt.value)
                self._receipt_rev = receipt.mod_revision if receipt else 0
                current = _kv(key_kvs[0]) if key_kvs else None

    def _receipt_lease_id(self, timeout: float) -> int:
        if self._receipt_lease is None:
            self._receipt_lease = self.grant(RECEIPT_TTL_S, timeout=timeout).id
        return self._receipt_lease

    # ------------------------------------------------------------------ waiting
    def missing(self, keys: Iterable[bytes | str], *, timeout: float | None = None,
                serializable: bool = False) -> tuple[list[bytes], int]:
        """Which of ``keys`` do not exist, and the revision at which that was read.

        ``serializable``: read from the member asked, without a round to the leader (answered
        during an election too); a key set an instant ago may be reported missing, never the
        reverse. For a poll that looks again.
        """
        ks = [_key(k) for k in keys]
        absent, revision = [], 0
        for i in range(0, len(ks), _MAX_TXN_OPS):
            chunk = ks[i : i + _MAX_TXN_OPS]
            ranges = [{"key": _b64(k), "count_only": True} for k in chunk]
            if serializable:
                for r in ranges:
                    r["serializable"] = True
            body = {"success": [{"request_range": r} for r in ranges]}
            answer = self._call("check", chunk[0], "/v3/kv/txn", body, timeout)
            revision = max(revision, int(answer["header"]["revision"]))
            for k, response in zip(chunk, answer["responses"], strict=True):
                if int(response["response_range"].get("count", 0)) == 0:
                    absent.append(k)
        return absent, revision

    def wait(self, keys: Iterable[bytes | str], timeout: float | None = None) -> None:
        """Returns once every key of ``keys`` exists.

        Waits on a watch of a missing key (so a key set meanwhile is seen at once) and
        checks again at least every ``request_timeout`` s, on a member that has the majority.

        Raises:
            EtcdWaitTimeout: a key is still missing after ``timeout`` s (names them).
            EtcdUnavailableError: no member could say within ``timeout`` s.
        """
        ks = [_key(k) for k in keys]
        limit = self.timeout if timeout is None else _positive(timeout, "timeout")
        start = time.monotonic()
        deadline = start + limit
        pause = _BACKOFF_S[0]
        while True:
            try:
                absent, revision = self.missing(ks, timeout=max(deadline - time.monotonic(), 1e-3))
            except EtcdUnavailableError as exc:
                raise EtcdUnavailableError(f"{exc} (waiting for {_names(ks)})") from None
            if not absent:
                return
            left = deadline - time.monotonic()
            changed = left > 0 and self._watch(absent[0], revision + 1,
                                               min(left, self.request_timeout))
            if changed is None:  # no watch: poll, backing off
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(pause * 2, _BACKOFF_S[1])
            elif changed:
                pause = _BACKOFF_S[0]
            if not changed and time.monotonic() >= deadline:
                raise EtcdWaitTimeout(
                    f"etcd wait for key {_names(absent)} at {','.join(self.endpoints)} timed "
                    f"out after {time.monotonic() - start:.1f} s ({len(absent)} of {len(ks)} "
                    "key(s) not set)"
                )

    def _watch(self, key: bytes, start_revision: int, limit: float) -> bool | None:
        """Waits up to ``limit`` s for a change of ``key`` from ``start_revision`` on the
        preferred member: ``True`` on a change, ``False`` when none came, ``None`` when the
        watch could not be made (or broke)."""
        member = self._members[self._preferred]
        body = {"create_request": {"key": _b64(key), "start_revision": str(start_revision)}}
        conn = http.client.HTTPConnection(member.host, member.port, timeout=limit)
        try:
            conn.request("POST", "/v3/watch", body=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                return None
            while True:
                line = response.readline()
                if not line:
                    return None
                result = json.loads(line).get("result", {})
                if result.get("events") or result.get("canceled"):
                    return True
        except TimeoutError:
            return False
        except (OSError, ValueError, http.client.HTTPException):
            return None
        finally:
            conn.close()

    # ------------------------------------------------------------------ leases
    def grant(self, ttl: int, *, timeout: float | None = None) -> Lease:
        """A new lease of ``ttl`` seconds (call :meth:`Lease.keep_alive` to keep it)."""
        if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"lease ttl must be a positive int of seconds, got {ttl!r}")
        answer = self._call("lease grant", None, "/v3/lease/grant", {"TTL": ttl}, timeout)
        return Lease(self, int(answer["ID"]), int(answer["TTL"]))

    def refresh(self, lease_id: int, *, timeout: float | None = None) -> int:
        """Renews the lease once; returns its TTL in seconds.

        Raises:
            EtcdError: the lease expired or was revoked.
        """
        answer = self._call("lease keep-alive", None, "/v3/lease/keepalive",
                            {"ID": str(lease_id)}, timeout)
        ttl = int(answer.get("TTL", 0))
        if ttl <= 0:
            raise EtcdError(f"etcd lease {lease_id:x} expired or was revoked")
        return ttl

    def revoke(self, lease_id: int, *, timeout: float | None = None) -> bool:
        """Revokes the lease (its keys are deleted); returns whether it still existed."""
        try:
            self._call("lease revoke", None, "/v3/lease/revoke", {"ID": str(lease_id)}, timeout)
        except EtcdError as exc:
            if "lease not found" in str(exc):
                return False
            raise
        return True

    # ------------------------------------------------------------------ members
    def health(self, endpoint: str, timeout: float = 1.0) -> bool:
        """Whether ``endpoint`` (one of :attr:`endpoints`) says it is healthy (it has a
        leader and the majority)."""
        member = self._members[self.endpoints.index(endpoint)]
        conn = http.client.HTTPConnection(member.host, member.port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            answer = json.loads(conn.getresponse().read() or b"{}")
        except (OSError, ValueError, http.client.HTTPException):
            return False
        finally:
            conn.close()
        return str(answer.get("health")) == "true"

    def close(self) -> None:
        """Revokes this client's receipt lease (best effort) and closes its connections."""
        lease, self._receipt_lease = self._receipt_lease, None
        if lease is not None:
            try:
                self.revoke(lease, timeout=min(self.request_timeout, 2.0))
            except EtcdError:
                pass  # it expires on its own
        for member in self._members:
            member.close()


def _integer(kv: KeyValue | None, key: bytes) -> int:
    if kv is None:
        return 0
    try:
        return int(kv.value)
    except ValueError:
        raise ValueError(
            f"etcd add of key {key.decode(errors='replace')!r}: it holds {kv.value[:40]!r}, "
            "not a decimal integer"
        ) from None


def _names(keys: Sequence[bytes]) -> str:
    shown = ", ".join(repr(k.decode(errors="replace")) for k in keys[:4])
    return shown + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


class Lease:
    """An etcd lease: keys put with it are deleted when it expires or is revoked.

    Attributes:
        id: the lease's id (pass it as ``lease=`` to :meth:`EtcdClient.put`).
        ttl: its time to live in seconds, as granted.
        lost: why the keep-alive thread gave up: the cluster said the lease is gone
            (``None`` while the lease is kept).
    """

    def __init__(self, client: EtcdClient, lease_id: int, ttl: int) -> None:
        self.client = client
        self.id = lease_id
        self.ttl = ttl
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"Lease({self.id:x}, ttl={self.ttl})"

    def keep_alive(self, interval: float | None = None) -> Lease:
        """Renews the lease every ``interval`` s (default a third of its TTL) on a daemon
        thread until :meth:`stop` or :meth:`revoke`. The cluster saying the lease is gone
        (expired, revoked) sets :attr:`lost` and ends the thread; a renewal the cluster cannot
        serve (an election, its majority lost) is tried again at the next interval: etcd
        counts a lease's TTL from the last renewal its leader saw, and a new leader gives
        every lease a full TTL again."""
        every = self.ttl / 3 if interval is None else _positive(interval, "interval")
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew, args=(every,), daemon=True,
                                            name=f"fastcomm-etcd-lease-{self.id:x}")
            self._thread.start()
        return self

    def _renew(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.client.refresh(self.id, timeout=max(every, self.client.request_timeout))
            except EtcdUnavailableError:
                continue  # not served now: the lease lives on in etcd until it says otherwise
            except EtcdError as exc:
                self.lost = str(exc)
                return

    def stop(self, wait: bool = True) -> None:
        """Stops the keep-alive (the lease then expires after its TTL, unless another client
        keeps it); ``wait``: for a renewal in flight (at most ``request_timeout`` + 1 s)."""
        self._stop.set()
        if wait and self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.client.request_timeout + 1)

    def revoke(self) -> bool:
        """Stops the keep-alive and revokes the lease; returns whether it still existed."""
        self.stop()
        return self.client.revoke(self.id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revoke()
