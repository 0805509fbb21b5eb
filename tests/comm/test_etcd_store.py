"""The store in etcd: the client, torch's Store contract, Gloo and ``init_process_group`` over it,
fastcomm's signed ``Store`` and ``FASTCOMM_STORE``, and a cluster that loses members.

Real etcd members on free ports (tests/etcd_cluster.py), started once per module; skipped
where ``etcd`` is not installed.
"""

from __future__ import annotations

import datetime
import http.client
import os
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from fastcomm import Store, StoreTimeoutError
from fastcomm.comm.errors import FastcommError
from fastcomm.comm.etcd import EtcdClient, EtcdError, EtcdUnavailableError, parse_endpoints
from fastcomm.comm.etcd_store import EtcdStore, EtcdStoreUnavailableError
from fastcomm.comm.store import parse_store_url, store_from_env
from fastcomm.settings import JOB_SECRET
from tests.etcd_cluster import EtcdCluster, etcd_binary, etcd_cluster_fixture
from tests.harness import env_rank, free_port, pool_fixture

etcd1 = etcd_cluster_fixture(1)
pool = pool_fixture(2, timeout=60)


@pytest.fixture
def client(etcd1):
    c = EtcdClient(etcd1.endpoints, request_timeout=2, timeout=5)
    yield c
    c.close()


# ---------------------------------------------------------------------- the client
def test_client_put_get_count_delete(client, unique_name):
    p = f"{unique_name}/"
    assert client.get(p + "a") is None
    revision = client.put(p + "a", "1")
    kv = client.get(p + "a")
    assert kv.value == b"1" and kv.version == 1 and kv.create_revision == revision
    client.put(p + "b", b"\x00\xff")
    assert client.get(p + "b").value == b"\x00\xff"
    assert client.count(p) == 2 and [kv.key for kv in client.get_prefix(p)] == [
        (p + "a").encode(), (p + "b").encode()]
    assert client.delete(p + "a") and not client.delete(p + "a")
    assert client.delete_prefix(p) == 1 and client.count(p) == 0


def test_client_fails_over_past_members_that_do_not_answer(etcd1, unique_name):
    dead = f"127.0.0.1:{free_port()}"
    c = EtcdClient(f"{dead},{etcd1.endpoints}", request_timeout=1, timeout=5)
    try:
        c.put(f"{unique_name}/k", "v")
        assert c.get(f"{unique_name}/k").value == b"v"
        assert c.endpoints == (dead, etcd1.endpoint(0))
    finally:
        c.close()


def test_client_compare_and_set_on_value_version_and_revisions(client, unique_name):
    k = f"{unique_name}/cas"
    assert client.compare_and_set(k, "x", prev_value="") == (False, None)  # no value to match
    assert client.compare_and_set(k, "first", prev_version=0) == (True, None)
    done, now = client.compare_and_set(k, "again", prev_version=0)
    assert not done and now.value == b"first"
    assert client.compare_and_set(k, "second", prev_value="first") == (True, None)
    now = client.get(k)
    assert client.compare_and_set(k, "third", prev_mod_revision=now.mod_revision)[0]
    assert not client.compare_and_set(k, "x", prev_create_revision=now.create_revision + 1)[0]
    with pytest.raises(ValueError, match="needs a condition"):
        client.compare_and_set(k, "x")


def test_client_add_is_exact_from_threads_and_clients(etcd1, unique_name):
    k = f"{unique_name}/n"
    clients = [EtcdClient(etcd1.endpoints, timeout=10) for _ in range(2)]
    seen: list[int] = []
    lock = threading.Lock()

    def adder(c):
        for _ in range(20):
            value = c.add(k, 1)
            with lock:
                seen.append(value)

    threads = [threading.Thread(target=adder, args=(clients[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        assert sorted(seen) == list(range(1, 81))  # every sum once: no add lost or doubled
        assert clients[0].add(k, -80) == 0
        clients[0].put(k, "not a number")
        with pytest.raises(ValueError, match="not a decimal integer"):
            clients[0].add(k, 1)
    finally:
        for c in clients:
            c.close()


class AnswerDropper:
    """A member that applies every request and dies before answering: a TCP listener that
    passes each HTTP request on to a real etcd member, then closes the connection instead of
    returning the answer."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.applied = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, body = data.split(b"\r\n\r\n", 1)
                lines = head.decode().split("\r\n")
                length = next(int(h.split(":")[1]) for h in lines
                              if h.lower().startswith("content-length"))
                while len(body) < length:
                    body += conn.recv(65536)
                etcd = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                etcd.request("POST", lines[0].split()[1], body=body)
                etcd.getresponse().read()
                etcd.close()
                self.applied += 1

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)  # wakes the accept() under way
        self.server.close()
        self.thread.join(10)


def test_add_counts_once_when_the_answer_is_lost_and_another_member_is_asked(etcd1, unique_name):
    dropper = AnswerDropper(etcd1.client_ports[0])
    c = EtcdClient(f"{dropper.endpoint},{etcd1.endpoints}", request_timeout=2, timeout=10)
    try:
        for i in range(5):  # a new key each time: the first transaction applies
            c._preferred = 0  # start at the member that drops answers every time
            assert c.add(f"{unique_name}/n{i}", 3) == 3
            assert c.get(f"{unique_name}/n{i}").value == b"3"
        assert dropper.applied >= 5  # each add was applied there first, its answer lost
    finally:
        c.close()
        dropper.close()


def test_lease_keep_alive_holds_its_keys_and_revoke_deletes_them(client, unique_name):
    kept = client.grant(1).keep_alive(0.2)
    client.put(f"{unique_name}/kept", "1", lease=kept.id)
    dropped = client.grant(1)
    client.put(f"{unique_name}/dropped", "1", lease=dropped.id)
    deadline = time.monotonic() + 10
    while client.get(f"{unique_name}/dropped") is not None:
        assert time.monotonic() < deadline, "a lease not kept alive did not expire in 10 s"
        time.sleep(0.1)
    assert client.get(f"{unique_name}/kept") is not None and kept.lost is None
    assert kept.revoke() and client.get(f"{unique_name}/kept") is None
    assert not client.revoke(kept.id)
    with pytest.raises(EtcdError, match="expired or was revoked"):
        client.refresh(kept.id)


def test_wait_returns_as_soon_as_another_client_sets_the_key(client, etcd1, unique_name):
    other = EtcdClient(etcd1.endpoints)
    timer = threading.Timer(0.3, lambda: other.put(f"{unique_name}/late", "x"))
    start = time.monotonic()
    timer.start()
    try:
        client.wait([f"{unique_name}/late"], timeout=10)
    finally:
        timer.join()
        other.close()
    assert time.monotonic() - start < 2  # the watch wakes it (polling would too, later)


@pytest.mark.parametrize(
    "endpoints, exc, match",
    [
        ("", ValueError, "not host:port"),
        ("127.0.0.1", ValueError, "not host:port"),
        ("127.0.0.1:70000", ValueError, "not host:port"),
        ("https://127.0.0.1:2379", ValueError, "TLS"),
        (2379, TypeError, "endpoints"),
    ],
)
def test_bad_endpoints(endpoints, exc, match):
    with pytest.raises(exc, match=match):
        parse_endpoints(endpoints)


def test_bad_client_arguments():
    with pytest.raises(ValueError, match="request_timeout must be positive"):
        EtcdClient("127.0.0.1:2379", request_timeout=0)
    with pytest.raises(TypeError, match="timeout must be seconds"):
        EtcdClient("127.0.0.1:2379", timeout="soon")
    c = EtcdClient("127.0.0.1:2379")
    with pytest.raises(ValueError, match="must not be empty"):
        c.put("", "v")
    with pytest.raises(TypeError, match="bytes or str"):
        c.put("k", 3)
    with pytest.raises(TypeError, match="amount must be an int"):
        c.add("k", 1.5)
    with pytest.raises(ValueError, match="ttl"):
        c.grant(0)


def test_a_cluster_nobody_serves_is_named_unreachable_within_the_timeout():
    endpoints = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    c = EtcdClient(endpoints, request_timeout=0.5, timeout=1)
    start = time.monotonic()
    with pytest.raises(EtcdUnavailableError) as info:
        c.put("job/k", "v")
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 1 <= elapsed < 2.5, elapsed
    assert "cannot be reached" in message and "'job/k'" in message and "after 1." in message
    for endpoint in endpoints.split(","):
        assert f"{endpoint}: connection refused" in message


# ---------------------------------------------------------------------- torch's Store contract
def _contract(store: dist.Store) -> list:
    """The same calls on a TCPStore and an EtcdStore: the answers must be the same."""
    out = []
    store.set("a", b"1")
    store.set("s", "text")
    out += [store.get("a"), store.get("s"), store.check(["a", "s"]), store.check(["a", "zz"])]
    out += [store.add("n", 2), store.add("n", 3), store.add("n", -5), store.get("n")]
    out += [store.add("fresh", 0), store.get("fresh")]
    out += [store.compare_set("c", b"", b"one"),      # missing, expected empty: set
            store.compare_set("c", b"x", b"two"),     # mismatch: the current value
            store.compare_set("c", b"one", b"two"),   # match: the new value
            store.compare_set("gone", b"x", b"y"),    # missing, expected given: expected
            store.check(["gone"])]
    store.set("e", b"")
    out += [store.compare_set("e", b"", b"filled"), store.get("e")]  # empty equals empty
    out += [store.delete_key("a"), store.delete_key("a"), store.check(["a"])]
    store.wait(["s", "n"])
    store.wait(["s"], datetime.timedelta(seconds=1))
    return out


def test_etcd_store_answers_as_tcpstore_does(etcd1, unique_name):
    tcp = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5),
                        wait_for_workers=False)
    expected = _contract(dist.PrefixStore(unique_name, tcp))
    store = EtcdStore(etcd1.endpoints, unique_name, 5)
    assert _contract(store) == expected
    assert store.num_keys() == 5  # s, n, fresh, c, e: under the prefix only
    assert store.clear() == 5 and store.num_keys() == 0
    store.close()


def test_get_and_wait_time_out_naming_the_key_and_elapsed(etcd1, unique_name):
    store = EtcdStore(etcd1.endpoints, unique_name, 0.4)
    for call in (lambda: store.get("never"), lambda: store.wait(["a", "never"]),
                 lambda: store.wait(["never"], datetime.timedelta(seconds=0.4))):
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError) as info:
            call()
        elapsed = time.monotonic() - start
        assert 0.35 <= elapsed < 2, elapsed
        assert f"'{unique_name}/never'" in str(info.value) and "after 0." in str(info.value)
    assert isinstance(info.value, TimeoutError)
    store.set_timeout(datetime.timedelta(seconds=3))
    assert store.timeout == datetime.timedelta(seconds=3)


def test_get_blocks_until_another_process_sets_the_key(etcd1, unique_name):
    store = EtcdStore(etcd1.endpoints, unique_name, 10)
    other = EtcdStore(etcd1.endpoints, unique_name, 10)
    timer = threading.Timer(0.3, lambda: other.set("late", b"here"))
    timer.start()
    try:
        assert store.get("late") == b"here"
    finally:
        timer.join()


@pytest.mark.parametrize(
    "prefix, kwargs, exc, match",
    [
        ("", {}, ValueError, "non-empty prefix"),
        ("/", {}, ValueError, "non-empty prefix"),
        ("fastcomm-etcd", {}, ValueError, "client's own"),
        ("job", {"timeout": -1}, ValueError, "positive"),
        ("job", {"timeout": "soon"}, TypeError, "timeout"),
    ],
)
def test_bad_store_arguments(prefix, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EtcdStore("127.0.0.1:2379", prefix, **kwargs)


def test_bad_store_values(etcd1, unique_name):
    store = EtcdStore(etcd1.endpoints, unique_name, 2)
    with pytest.raises(TypeError, match="bytes or str"):
        store.set("k", 3)
    with pytest.raises(TypeError, match="keys must be str"):
        store.get(b"k")


# ---------------------------------------------------------------------- two processes
def _add_many(endpoints: str, prefix: str, times: int) -> list[int]:
    store = EtcdStore(endpoints, prefix, 30)
    try:
        return [store.add("counter", 1) for _ in range(times)]
    finally:
        store.close()


def test_add_from_two_processes_counts_every_add_once(pool, etcd1, unique_name):
    seen = pool.run(_add_many, etcd1.endpoints, unique_name, 40)
    assert sorted(seen[0] + seen[1]) == list(range(1, 81))


def _gloo_all_reduce(endpoints: str, prefix: str) -> list[float]:
    rank = env_rank()
    store = EtcdStore(endpoints, prefix, 30)
    group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
    t = torch.full((5,), float(rank + 1))
    group.allreduce([t]).wait()
    return t.tolist()


def test_gloo_process_group_all_reduce_over_etcd(pool, etcd1, unique_name):
    assert pool.run(_gloo_all_reduce, etcd1.endpoints, unique_name) == [[3.0] * 5] * 2


def _init_process_group(endpoints: str, prefix: str) -> list[float]:
    rank = env_rank()
    dist.init_process_group("gloo", store=EtcdStore(endpoints, prefix, 30), rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        t = torch.arange(4, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t)
        dist.barrier()
        return t.tolist()
    finally:
        dist.destroy_process_group()


def test_init_process_group_over_etcd(pool, etcd1, unique_name):
    assert pool.run(_init_process_group, etcd1.endpoints, unique_name) == [[0.0, 3, 6, 9]] * 2


def _fastcomm_init_from_env(url: str) -> tuple[str, float]:
    import fastcomm

    os.environ["FASTCOMM_STORE"] = url
    try:
        comm = fastcomm.init("gloo", timeout=30)
        t = torch.ones(3) * (env_rank() + 1)
        comm.all_reduce(t)
        from fastcomm.comm import world

        return world._WORLD_STORE.address, t[0].item()
    finally:
        fastcomm.shutdown()
        del os.environ["FASTCOMM_STORE"]


def test_fastcomm_init_takes_its_store_from_FASTCOMM_STORE(pool, etcd1, unique_name):
    url = f"etcd://{etcd1.endpoints}/{unique_name}"
    assert pool.run(_fastcomm_init_from_env, url) == [(url, 3.0)] * 2
    client = EtcdClient(etcd1.endpoints)
    try:
        assert client.count(f"{unique_name}/fastcomm/world") > 0  # the world's keys are there
    finally:
        client.close()


# ---------------------------------------------------------------------- fastcomm's Store
def test_fastcomm_store_on_etcd_signs_and_checks_values(etcd1, unique_name, monkeypatch):
    monkeypatch.setenv(JOB_SECRET.name, "ab" * 32)
    stores = [Store.on_etcd(etcd1.endpoints, unique_name, timeout=10, rank=r) for r in range(3)]
    assert all(s.signed for s in stores)
    gathered, errors = {}, []

    def rank_main(r):
        try:
            stores[r].barrier("b", 3)
            gathered[r] = stores[r].all_gather_object("g", r, 3, {"rank": r, "t": (r, b"x")})
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(gathered[r] == [{"rank": q, "t": (q, b"x")} for q in range(3)] for r in range(3))
    raw = EtcdClient(etcd1.endpoints)  # someone without the secret writes a value
    raw.put(f"{unique_name}/forged/value", b'fc1:u:{"evil":1}')
    raw.close()
    with pytest.raises(FastcommError, match="refusing the value of store key 'forged/value'"):
        stores[0].broadcast_object("forged", None, is_source=False, timeout=2)
    view = stores[1].prefixed("ns")
    view.set("k", "v")
    assert stores[2].prefixed("ns").get("k") == b"v"
    assert view.address == f"etcd://{etcd1.endpoints}/{unique_name}"


def test_fastcomm_store_on_etcd_timeout_names_rank_address_key_and_elapsed(etcd1, unique_name):
    s = Store.on_etcd(etcd1.endpoints, unique_name, timeout=5, rank=3).prefixed("ns")
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        s.get("never", timeout=0.3)
    assert time.monotonic() - start < 2
    message = str(info.value)
    assert "rank 3" in message and "'ns/never'" in message and "timed out after 0." in message
    assert f"etcd://{etcd1.endpoints}/{unique_name}" in message


def test_store_from_env_reads_FASTCOMM_STORE(etcd1, unique_name):
    assert store_from_env({}) is None and store_from_env({"FASTCOMM_STORE": " "}) is None
    url = f"etcd://{etcd1.endpoints}/{unique_name}/job"
    store = store_from_env({"FASTCOMM_STORE": url}, timeout=5, rank=0)
    store.set("k", "v")
    assert store.address == url and store.get("k") == b"v"


@pytest.mark.parametrize(
    "url, match",
    [
        ("tcp://127.0.0.1:29500/job", "expected etcd://"),
        ("127.0.0.1:2379/job", "expected etcd://"),
        ("etcd://127.0.0.1:2379", "no prefix"),
        ("etcd://127.0.0.1:2379/", "no prefix"),
        ("etcd:///job", "not host:port"),
        ("etcd://127.0.0.1:2379,h/job", "'h' is not host:port"),
    ],
)
def test_bad_store_urls(url, match):
    with pytest.raises(ValueError, match=match):
        parse_store_url(url)
    assert parse_store_url("etcd://a:1,b:2/job/7") == ("etcd", ("a:1", "b:2"), "job/7")


# ---------------------------------------------------------------------- members lost
def _every_operation(store: EtcdStore, tag: str) -> None:
    store.set(f"{tag}/k", b"v")
    assert store.get(f"{tag}/k") == b"v"
    assert store.add(f"{tag}/n", 2) == 2
    assert store.compare_set(f"{tag}/c", b"", b"1") == b"1"
    store.wait([f"{tag}/k", f"{tag}/n"], datetime.timedelta(seconds=10))
    assert store.check([f"{tag}/k"]) and store.delete_key(f"{tag}/k")
    assert store.num_keys() > 0


@pytest.mark.skipif(etcd_binary() is None, reason="needs etcd")
def test_three_members_survive_one_loss_and_say_when_the_majority_is_lost(tmp_path):
    with EtcdCluster(3, str(tmp_path)) as cluster:
        store = EtcdStore(cluster.endpoints, "job", 15, request_timeout=1)
        waiter = EtcdStore(cluster.endpoints, "job", 15, request_timeout=1)
        _every_operation(store, "all")
        got = {}
        blocked = threading.Thread(target=lambda: got.setdefault("late", waiter.get("late")))
        blocked.start()  # it watches member 0, the member every call went to first
        time.sleep(0.3)
        cluster.kill(0)
        _every_operation(store, "one-lost")
        store.set("late", b"x")
        blocked.join(15)
        assert got == {"late": b"x"}
        cluster.kill(1)
        store.set_timeout(datetime.timedelta(seconds=1.5))
        for call in (lambda: store.set("k", b"v"), lambda: store.get("k"),
                     lambda: store.add("n", 1)):
            start = time.monotonic()
            with pytest.raises(EtcdStoreUnavailableError) as info:
                call()
            elapsed = time.monotonic() - start
            message = str(info.value)
            assert 1.5 <= elapsed < 3.5, elapsed
            assert "etcd cluster lost its majority" in message, message
            assert all(cluster.endpoint(m) in message for m in range(3)), message
            assert isinstance(info.value, dist.DistNetworkError)
