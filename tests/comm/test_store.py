"""The TCPStore wrapper: raw operations, namespaces, helpers, and timeouts that say where."""

from __future__ import annotations

import threading
import time

import pytest

from fastcomm import Store, StoreTimeoutError
from tests.harness import free_port


@pytest.fixture(scope="module")
def server():
    return Store(is_server=True, timeout=5, rank=0)


def client(server, rank=1, timeout=5):
    return Store("127.0.0.1", server.port, timeout=timeout, rank=rank)


def test_server_binds_a_free_port_and_clients_connect(server):
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    c = client(server)
    c.set("hello", "world")
    assert server.get("hello") == b"world"


def test_set_get_add_check_delete_compare_set(server, unique_name):
    s = client(server).prefixed(unique_name)
    assert not s.check(["a"])
    s.set("a", b"1")
    assert s.check(["a"]) and s.get("a") == b"1"
    assert s.add("n", 2) == 2 and s.add("n", 3) == 5
    assert s.compare_set("c", b"", b"first") == b"first"
    assert s.compare_set("c", b"wrong", b"second") == b"first"
    assert s.compare_set("c", b"first", b"second") == b"second"
    assert s.delete("a") and not s.check(["a"])
    with pytest.raises(TypeError, match="bytes or str"):
        s.set("x", 3)


def test_prefixes_are_isolated_namespaces(server, unique_name):
    a = client(server).prefixed(f"{unique_name}/a")
    b = client(server).prefixed(f"{unique_name}/b")
    a.set("k", "from-a")
    b.set("k", "from-b")
    assert a.get("k") == b"from-a" and b.get("k") == b"from-b"
    assert a.prefixed("inner").prefix == f"{unique_name}/a/inner"


def test_get_timeout_names_key_address_rank_and_elapsed(server, unique_name):
    s = client(server, rank=3).prefixed(unique_name)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        s.get("never", timeout=0.3)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 0.25 <= elapsed < 3
    assert f"{unique_name}/never" in message
    assert f"127.0.0.1:{server.port}" in message
    assert "rank 3" in message and "timed out after 0." in message


def test_wait_returns_once_another_client_sets_the_key(server, unique_name):
    s = client(server).prefixed(unique_name)
    other = client(server, rank=2).prefixed(unique_name)
    timer = threading.Timer(0.2, lambda: other.set("late", b"x"))
    timer.start()
    s.wait(["late"], timeout=5)
    timer.join()
    assert s.get("late") == b"x"


def test_unreachable_server_raises_with_address():
    probe = Store(is_server=True, timeout=1)
    port = probe.port
    del probe  # the port is free again (and nobody listens on it)
    with pytest.raises(StoreTimeoutError, match=f"127.0.0.1:{port}"):
        Store("127.0.0.1", port, timeout=0.5)


@pytest.mark.timeout(30)
def test_refused_connections_are_retried_until_the_timeout_not_called_not_a_store():
    """Nothing listens at the port: torch's client needs ~7 s to give up on it with a 5 s
    timeout, which was then reported as "in use by a program that is not a store" -- the
    launcher takes that as final and a node started before the rendezvous host quit."""
    port = free_port()
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        Store("127.0.0.1", port, timeout=5, rank=1)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert f"nothing is listening at 127.0.0.1:{port} yet" in message, message
    assert "not a store" not in message and "rank 1" in message
    assert 5 <= elapsed < 5 + 2, elapsed


@pytest.mark.timeout(30)
def test_a_server_that_starts_late_is_reached_within_the_timeout():
    port = free_port()
    served = {}
    timer = threading.Timer(
        1.5, lambda: served.setdefault("s", Store("127.0.0.1", port, is_server=True, timeout=5))
    )
    timer.start()
    try:
        c = Store("127.0.0.1", port, timeout=5, rank=1)
        c.set("late", b"ok")
    finally:
        timer.join()
    assert served["s"].get("late") == b"ok"


def test_barrier_and_object_exchange_between_threads(server, unique_name):
    stores = [client(server, rank=r).prefixed(unique_name) for r in range(3)]
    gathered, errors = {}, []

    def rank_main(r):
        try:
            stores[r].barrier("b0", 3, timeout=5)
            gathered[r] = stores[r].all_gather_object("g0", r, 3, {"rank": r, "sq": r * r})
            gathered[r, "id"] = stores[r].broadcast_object(
                "uid", b"secret-id" if r == 0 else None, is_source=r == 0
            )
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors, errors
    for r in range(3):
        assert gathered[r] == [{"rank": q, "sq": q * q} for q in range(3)]
        assert gathered[r, "id"] == b"secret-id"


def test_barrier_timeout_counts_arrivals(server, unique_name):
    s = client(server).prefixed(unique_name)
    with pytest.raises(StoreTimeoutError, match=r"1 of 3 processes reached barrier"):
        s.barrier("lonely", 3, timeout=0.3)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"port": 70000}, ValueError, "port"),
        ({"port": 0, "is_server": False}, ValueError, "server-only"),
        ({"port": 1, "timeout": -1}, ValueError, "positive"),
        ({"port": 1, "timeout": "soon"}, TypeError, "timeout"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Store("127.0.0.1", **kwargs)


def test_bad_helper_arguments(server):
    s = client(server)
    with pytest.raises(ValueError, match="world_size"):
        s.barrier("x", 0)
    with pytest.raises(ValueError, match="rank must be in"):
        s.all_gather_object("y", 5, 2, None)
