"""Hostile input to the store: nothing read from it runs, signed values are checked, a server
listens on its own address only, and a port in use or a lost server is named as such.

The "attacker" is any process that reaches the server's port: here a raw torch ``TCPStore``
client of the test process (the wire is the same TCP), or a real process that hosts the server
and dies. Ranks are threads with their own connections, as in ``test_store.py``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fastcomm.comm.errors import FastcommError, StoreTimeoutError
from fastcomm.comm.store import (
    Store,
    _serve,
    decode_value,
    encode_value,
    job_secret_from_env,
)
from fastcomm.settings import JOB_SECRET, JOB_SECRET_FILE

SECRET_ENV, SECRET_FILE_ENV = JOB_SECRET.name, JOB_SECRET_FILE.name

SECRET = "5ec7e7" * 6  # 18 bytes, hex


class _Payload:
    """Unpickling it creates ``path``: a marker that foreign code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def no_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)


@pytest.fixture
def server(no_secret):
    return Store(is_server=True, timeout=5, rank=0)


def _raw(store: Store) -> dist.TCPStore:
    """A plain torch client of ``store``'s server: what a foreign process can do."""
    return dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=5))


def _ranks(fn, count):
    """Runs ``fn(rank)`` in ``count`` threads; returns {rank: result or exception}."""
    out = {}

    def body(r):
        try:
            out[r] = fn(r)
        except Exception as exc:  # returned to the test
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


# ---------------------------------------------------------------------- encoding
NCCL_ID = tuple(range(-64, 64))  # cupy's unique id: a tuple of 128 ints
IPC_HANDLE = bytes(range(64))  # a CUDA IPC memory handle


@pytest.mark.parametrize("secret", [None, bytes.fromhex(SECRET)], ids=["unsigned", "signed"])
@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        -(2**70),
        1.5,
        float("inf"),
        "host-id:boot",
        b"",
        IPC_HANDLE,
        NCCL_ID,
        (IPC_HANDLE, "0000:3b:00.0"),
        (3, 7, 1),
        (None, 0, 2),
        [("fc.weight", (64, 64), "float32"), ("fc.bias", (64,), "float32")],
        {"t": (1,), "b": [b"x"], "d": {}},
        ((), [], {}),
    ],
    ids=lambda v: type(v).__name__,
)
def test_values_round_trip_exactly(value, secret):
    out = decode_value(encode_value(value, "k", secret), "k", secret)
    assert out == value and type(out) is type(value)
    assert repr(out) == repr(value)  # tuples stay tuples, bytes stay bytes, at every depth


_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_values = st.recursive(
    _leaves,
    lambda inner: st.lists(inner, max_size=4)
    | st.lists(inner, max_size=4).map(tuple)
    | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=60, deadline=None)
@given(_values)
def test_any_allowed_value_round_trips(value):
    out = decode_value(encode_value(value, "k", b"s" * 16), "k", b"s" * 16)
    assert repr(out) == repr(value)


@pytest.mark.parametrize(
    "obj, named",
    [
        (object(), "builtins.object"),
        ({1, 2}, "builtins.set"),
        ([1, _Payload("x")], "_Payload"),
        ({1: "a"}, "key of type int"),
        (bytearray(b"x"), "builtins.bytearray"),
    ],
    ids=["object", "set", "nested", "int-key", "bytearray"],
)
def test_other_objects_are_refused_before_anything_is_written(server, unique_name, obj, named):
    s = Store("127.0.0.1", server.port, timeout=5, rank=0).prefixed(unique_name)
    with pytest.raises(TypeError, match=named) as info:
        s.all_gather_object("g", 0, 2, obj, timeout=1)
    assert "str keys" in str(info.value)  # says what is allowed
    with pytest.raises(TypeError, match=named):
        s.broadcast_object("b", obj, is_source=True)
    assert not s.check(["g/0"]) and not s.check(["b/value"])


# ---------------------------------------------------------------------- foreign values
@pytest.mark.parametrize("helper", ["all_gather_object", "broadcast_object"])
def test_foreign_pickle_never_runs_and_names_the_key(server, unique_name, tmp_path, helper):
    marker = tmp_path / "ran"
    ranks = [Store("127.0.0.1", server.port, timeout=5, rank=r) for r in range(2)]
    attacker = _raw(server)
    if helper == "all_gather_object":
        key = f"{unique_name}/g/2"  # the third rank's slot: both ranks read it

        def call(r):
            return ranks[r].prefixed(unique_name).all_gather_object("g", r, 3, r, timeout=5)
    else:
        key = f"{unique_name}/b/value"

        def call(r):
            return ranks[r].prefixed(unique_name).broadcast_object("b", None, is_source=False)

    attacker.set(key, pickle.dumps(_Payload(marker)))
    out = _ranks(call, 2)
    for r in range(2):
        assert isinstance(out[r], FastcommError), out[r]
        assert repr(key) in str(out[r]) and f"rank {r}" in str(out[r])
        assert "not a fastcomm store value" in str(out[r])
    assert not marker.exists()


def test_signed_values_are_checked_before_decoding(monkeypatch, unique_name, tmp_path):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    server = Store(is_server=True, timeout=5, rank=0)
    source = Store("127.0.0.1", server.port, timeout=5, rank=0).prefixed(unique_name)
    reader = Store("127.0.0.1", server.port, timeout=5, rank=1).prefixed(unique_name)
    attacker = _raw(server)
    assert source.signed and reader.signed

    source.broadcast_object("ok", (7, b"id"), is_source=True)
    assert reader.broadcast_object("ok", None, is_source=False) == (7, b"id")
    good = attacker.get(f"{unique_name}/ok/value")

    cases = {
        "tampered": good.replace(b"[7,", b"[8,"),
        "unsigned": encode_value((7, b"id"), f"{unique_name}/x/value", None),
        "other-secret": encode_value((7, b"id"), f"{unique_name}/x/value", b"k" * 16),
        "moved": good,  # a genuine value, copied under another key
        "pickle": pickle.dumps(_Payload(tmp_path / "ran")),
    }
    for name, data in cases.items():
        attacker.set(f"{unique_name}/{name}/value", data)
        with pytest.raises(FastcommError) as info:
            reader.broadcast_object(name, None, is_source=False, timeout=1)
        assert repr(f"{unique_name}/{name}/value") in str(info.value), name
        assert "rank 1" in str(info.value)
    assert not (tmp_path / "ran").exists()


def test_a_signed_value_needs_a_secret_to_be_read(monkeypatch, unique_name):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    server = Store(is_server=True, timeout=5)
    Store("127.0.0.1", server.port, timeout=5).prefixed(unique_name).broadcast_object(
        "v", 1, is_source=True
    )
    monkeypatch.delenv(SECRET_ENV)
    plain = Store("127.0.0.1", server.port, timeout=5).prefixed(unique_name)
    with pytest.raises(FastcommError, match="no job secret"):
        plain.broadcast_object("v", None, is_source=False)


def test_job_secret_sources(tmp_path):
    assert job_secret_from_env({}) is None
    assert job_secret_from_env({SECRET_ENV: SECRET}) == bytes.fromhex(SECRET)
    path = tmp_path / "secret"
    path.write_bytes(b"  a-file-secret-of-some-length\n")
    assert job_secret_from_env({SECRET_FILE_ENV: str(path)}) == b"a-file-secret-of-some-length"
    # the variable wins over the file
    both = {SECRET_ENV: SECRET, SECRET_FILE_ENV: str(path)}
    assert job_secret_from_env(both) == bytes.fromhex(SECRET)
    with pytest.raises(ValueError, match="hex"):
        job_secret_from_env({SECRET_ENV: "not hex"})
    with pytest.raises(ValueError, match="at least 16 bytes"):
        job_secret_from_env({SECRET_ENV: "abcd"})
    with pytest.raises(ValueError, match="cannot read"):
        job_secret_from_env({SECRET_FILE_ENV: str(tmp_path / "missing")})


# ---------------------------------------------------------------------- the server socket
def listening(port: int) -> list[str]:
    """``addr`` of every socket listening on ``port`` (from ``/proc/net/tcp{,6}``)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                raw = bytes.fromhex(addr)
                # /proc prints each 32-bit word in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                family = socket.AF_INET if width == 8 else socket.AF_INET6
                found.append(socket.inet_ntop(family, raw))
    return found


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "classic"])
def test_server_listens_on_its_host_only(use_libuv):
    store = _serve("127.0.0.1", 0, datetime.timedelta(seconds=5), use_libuv=use_libuv)
    assert store.libuvBackend == use_libuv
    assert listening(store.port) == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=5))
    client.set("k", b"v")
    assert store.get("k") == b"v"
    port = store.port
    del client, store
    assert listening(port) == []  # the store owned the socket it was handed


def test_store_server_is_not_on_every_interface(no_secret):
    server = Store("127.0.0.1", 0, is_server=True, timeout=5)
    assert listening(server.port) == ["127.0.0.1"]


@contextlib.contextmanager
def _held_port():
    """A loopback port held by a listener that accepts and never answers (not a store)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_port_in_use_is_named_not_a_timeout(no_secret):
    with _held_port() as port:
        start = time.monotonic()
        with pytest.raises(FastcommError) as info:
            Store("127.0.0.1", port, is_server=True, timeout=5, rank=0)
    assert not isinstance(info.value, StoreTimeoutError)
    assert f"port {port} on 127.0.0.1 is already in use" in str(info.value)
    assert "rank 0" in str(info.value) and time.monotonic() - start < 2


@pytest.mark.timeout(30)
def test_a_listener_that_is_not_a_store_is_named_not_waited_for(no_secret):
    """A port held by a program that accepts connections and never answers: torch's client
    handshake alone would wait forever; the client raises within its timeout + 2 s."""
    with _held_port() as port:
        start = time.monotonic()
        with pytest.raises(FastcommError) as info:
            Store("127.0.0.1", port, timeout=2, rank=1)
        elapsed = time.monotonic() - start
    assert not isinstance(info.value, StoreTimeoutError)
    message = str(info.value)
    assert f"port {port} on 127.0.0.1 is in use by a program that is not a store" in message
    assert "rank 1" in message and elapsed < 2 + 2 + 1


SERVER = """
import sys
from fastcomm.comm.store import Store
s = Store("127.0.0.1", 0, is_server=True, timeout=30)
print(s.port, flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(60)
def test_lost_server_is_named_within_the_timeout(no_secret):
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        ranks = [Store("127.0.0.1", port, timeout=20, rank=r) for r in range(2)]
        threading.Timer(0.5, proc.kill).start()
        start = time.monotonic()
        out = _ranks(lambda r: ranks[r].all_gather_object("g", r, 3, r, timeout=10), 2)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert elapsed < 10  # well within the timeout: the loss is seen, not waited out
    for r in range(2):
        assert isinstance(out[r], StoreTimeoutError), out[r]
        message = str(out[r])
        assert f"lost the connection to the store at 127.0.0.1:{port}" in message
        assert f"rank {r}" in message and "'g/2'" in message
