"""Hostile input to the launcher: nothing read back from its stores runs, a single-node job
listens on loopback only, and bad settings end in one line (exit 2), never a traceback, with no
temporary folder left behind.

The "attacker" is a plain torch ``TCPStore`` client of the test process: any process that
reaches a store's port can do what it does.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import socket
import time

import pytest
import torch.distributed as dist

from fastcomm.comm.errors import FastcommError
from fastcomm.comm.store import Store, encode_value
from fastcomm.launch.config import LaunchConfig
from fastcomm.launch.errors import Failure, LaunchError
from fastcomm.launch.rendezvous import (
    NodeInfo,
    Rendezvous,
    RoundEnd,
    read_failures,
    write_failures,
)
from fastcomm.settings import JOB_SECRET, JOB_SECRET_FILE

from ._util import clean_env, finish, kill_all, run, script, start, wait_files, wait_gone

pytestmark = pytest.mark.timeout(60)


class _Payload:
    """Unpickling it creates ``path``: a marker that foreign code ran."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _temp_folders(directory) -> list[str]:
    return sorted(p.name for p in directory.glob("fastcomm_launch_*"))


def _raw_client(host: str, port: int) -> dist.TCPStore:
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))


# ---------------------------------------------------------------------- rendezvous values
def _rendezvous(secret):
    server = Store("127.0.0.1", 0, is_server=True, timeout=5, _secret=secret)
    config = LaunchConfig(entrypoint="train.py", run_id="job", read_timeout=2.0)
    node = NodeInfo(agent_id="a", host="h", addr="127.0.0.1", nproc=1, role="default", pid=1)
    return server, Rendezvous(server, config, node, lambda: None)


@pytest.mark.parametrize("secret", [None, b"k" * 32], ids=["unsigned", "signed"])
def test_rendezvous_and_failure_values_never_run(tmp_path, secret):
    marker = tmp_path / "ran"
    server, rdzv = _rendezvous(secret)
    attacker = _raw_client("127.0.0.1", server.port)
    round_store = rdzv.round_store(0)
    payload = pickle.dumps(_Payload(marker))
    reads = {
        "end": lambda: rdzv.end_of(0),
        "closed": lambda: rdzv._closed(0),
        "restarts": lambda: rdzv.restarts_of(0),
        "node/0": lambda: rdzv._complete(0, 1, 0),
        "failures/0": lambda: read_failures(round_store, "failures/0"),
    }
    for key, read in reads.items():
        full = f"fastcomm.launch/job/r0/{key}"
        attacker.set(full, payload)
        with pytest.raises(FastcommError, match="not a fastcomm store value") as info:
            read()
        assert repr(full) in str(info.value), key
    assert not marker.exists()


def test_rendezvous_values_are_type_checked():
    server, rdzv = _rendezvous(None)
    round_store = rdzv.round_store(0)
    bad = {
        "end": ("failure", [{"rank": "zero"}]),
        "closed": 10**9,
        "restarts": "0; rm -rf /",
        "failures/0": [{"rank": 1}],
    }
    for key, value in bad.items():
        round_store.set(key, round_store.encode(key, value))
    for key, read in (
        ("end", lambda: rdzv.end_of(0)),
        ("closed", lambda: rdzv._closed(0)),
        ("restarts", lambda: rdzv.restarts_of(0)),
        ("failures/0", lambda: read_failures(round_store, "failures/0")),
    ):
        with pytest.raises(LaunchError) as info:
            read()
        assert f"fastcomm.launch/job/r0/{key}" in str(info.value)
    # what the agents write reads back the same
    failure = Failure(rank=1, local_rank=1, group_rank=0, host="h", pid=9, exitcode=-9,
                      timestamp=1.5, message="boom")
    write_failures(round_store, "failures/1", [failure])
    assert read_failures(round_store, "failures/1") == [failure]
    assert rdzv.end_round(1, RoundEnd.FAILURE, [failure]) == (RoundEnd.FAILURE, [failure])


def test_signed_rendezvous_refuses_unsigned_values():
    server, rdzv = _rendezvous(b"k" * 32)
    forged = encode_value(("success", None), "fastcomm.launch/job/r0/end", None)
    _raw_client("127.0.0.1", server.port).set("fastcomm.launch/job/r0/end", forged)
    with pytest.raises(FastcommError, match="not signed"):
        rdzv.end_of(0)


# ---------------------------------------------------------------------- a standalone job
def _listening_sockets(pid: int) -> list[str]:
    """``addr:port`` of the TCP sockets process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in open(table).read().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            addr, port = cols[1].split(":")
            raw = bytes.fromhex(addr)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(f"{socket.inet_ntop(family, raw)}:{int(port, 16)}")
    return found


HOLD = """
    import json, os, sys, time
    out = sys.argv[1]
    record = {k: os.environ.get(k) for k in ("FASTCOMM_JOB_SECRET", "FASTCOMM_JOB_SECRET_FILE",
                                             "MASTER_ADDR", "MASTER_PORT")}
    with open(os.path.join(out, "tmp_" + os.environ["RANK"]), "w") as fh:
        json.dump(record, fh)
    os.replace(os.path.join(out, "tmp_" + os.environ["RANK"]),
               os.path.join(out, "rec_" + os.environ["RANK"]))
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)
"""


def test_standalone_job_listens_on_loopback_only(tmp_path):
    """Both stores of a standalone job (rendezvous and workers') listen on 127.0.0.1; the
    workers get the job's random secret (and not the launcher's secret file variable)."""
    path = script(tmp_path, "hold.py", HOLD)
    env = clean_env(TMPDIR=str(tmp_path), **{JOB_SECRET_FILE.name: ""})
    proc = start(["--standalone", "--nproc-per-node", "2", path, tmp_path], tmp_path, env=env)
    try:
        records = [json.loads(p.read_text()) for p in wait_files(tmp_path, "rec_*", 2, proc=proc)]
        sockets = _listening_sockets(proc.pid)
        (tmp_path / "go").touch()
        result = finish(proc, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.returncode == 0, result.stderr
    assert len(sockets) == 2 and all(s.startswith("127.0.0.1:") for s in sockets), sockets
    assert f"127.0.0.1:{records[0]['MASTER_PORT']}" in sockets
    secrets = {r["FASTCOMM_JOB_SECRET"] for r in records}
    assert len(secrets) == 1 and re.fullmatch(r"[0-9a-f]{64}", secrets.pop())
    assert {r["FASTCOMM_JOB_SECRET_FILE"] for r in records} == {None}
    assert _temp_folders(tmp_path) == []


PROBE = """
    import json, os, sys, time
    from fastcomm.comm.errors import FastcommError
    from fastcomm.comm.store import Store

    out, rank = sys.argv[1], int(os.environ["RANK"])
    store = Store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=20,
                  rank=rank).prefixed("probe")
    if rank == 0:
        with open(os.path.join(out, "port.tmp"), "w") as fh:
            fh.write(os.environ["MASTER_ADDR"] + " " + os.environ["MASTER_PORT"])
        os.replace(os.path.join(out, "port.tmp"), os.path.join(out, "port"))
    while not os.path.exists(os.path.join(out, "go")):
        time.sleep(0.05)
    errors = []
    for call in (lambda: store.all_gather_object("g", rank, 3, rank),
                 lambda: store.broadcast_object("b", None, is_source=False),
                 lambda: store.broadcast_object("j", None, is_source=False)):
        try:
            errors.append("returned %r" % (call(),))
        except FastcommError as exc:
            errors.append(str(exc))
    with open(os.path.join(out, "errors_%d.json" % rank), "w") as fh:
        json.dump(errors, fh)
"""


def test_foreign_values_in_a_running_job_never_run(tmp_path):
    """A process that reaches the workers' store writes a pickle into the keys that
    ``all_gather_object`` and ``broadcast_object`` read, and well-formed but unsigned JSON into
    another: every rank refuses each, naming the key; the pickle never runs."""
    marker = tmp_path / "ran"
    path = script(tmp_path, "probe.py", PROBE)
    env = clean_env(TMPDIR=str(tmp_path))
    proc = start(["--nproc-per-node", "2", path, tmp_path], tmp_path, env=env)
    try:
        [port_file] = wait_files(tmp_path, "port", 1, proc=proc)
        host, port = port_file.read_text().split()
        attacker = _raw_client(host, int(port))
        attacker.set("probe/g/2", pickle.dumps(_Payload(marker)))
        attacker.set("probe/b/value", pickle.dumps(_Payload(marker)))
        attacker.set("probe/j/value", encode_value(("forged",), "probe/j/value", None))
        (tmp_path / "go").touch()
        result = finish(proc, timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        gathered, broadcast, unsigned = json.loads((tmp_path / f"errors_{rank}.json").read_text())
        assert "'probe/g/2'" in gathered and "not a fastcomm store value" in gathered
        assert "'probe/b/value'" in broadcast and "not a fastcomm store value" in broadcast
        assert "'probe/j/value'" in unsigned and "not signed" in unsigned
        assert f"rank {rank}" in gathered
    assert not marker.exists()
    assert _temp_folders(tmp_path) == []


# ---------------------------------------------------------------------- bad settings
def _one_line_usage_error(result, tmp_path, needle):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("fastcomm-run:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr
    assert _temp_folders(tmp_path) == []


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--monitor-interval", "inf"], "--monitor-interval must be a finite number"),
        (["--log-dir", "/proc/no/such/dir"], "cannot be created"),
    ],
    ids=["monitor-inf", "log-dir"],
)
def test_bad_settings_are_one_line_without_traceback(tmp_path, flags, needle):
    path = script(tmp_path, "train.py", "print('started')\n")
    result = run([*flags, path], tmp_path, env=clean_env(TMPDIR=str(tmp_path)), timeout=30)
    _one_line_usage_error(result, tmp_path, needle)
    assert "started" not in result.stdout


def test_port_in_use_is_named(tmp_path):
    path = script(tmp_path, "train.py", "print('started')\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run(
            ["--nproc-per-node", "2", "--master-port", port, path],
            tmp_path,
            env=clean_env(TMPDIR=str(tmp_path)),
            timeout=30,
        )
    _one_line_usage_error(result, tmp_path, f"port {port} on 127.0.0.1 is already in use")
    assert "started" not in result.stdout and "timed out" not in result.stderr


def test_rendezvous_port_held_by_a_program_that_is_not_a_store(tmp_path):
    """c10d on the endpoint host: the port cannot be served and what holds it never answers
    (torch's client would wait for its handshake forever): one usage line, well within the
    join timeout."""
    path = script(tmp_path, "train.py", "print('started')\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        flags = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                 f"127.0.0.1:{port}", "--rdzv-conf", "join_timeout=60,last_call_timeout=1"]
        start = time.monotonic()
        result = run([*flags, path], tmp_path, env=clean_env(TMPDIR=str(tmp_path)), timeout=40)
        elapsed = time.monotonic() - start
    _one_line_usage_error(result, tmp_path, f"port {port} on 127.0.0.1 is already in use")
    assert "started" not in result.stdout and elapsed < 30


# ---------------------------------------------------------------------- leftovers
POLITE = """
    import signal, sys, time

    def on_term(signum, frame):
        open(sys.argv[1], "w").close()
        sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    open(sys.argv[2], "w").close()
    time.sleep(60)
"""

STUBBORN = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(sys.argv[1], "w").close()
    time.sleep(60)
"""

LEAVES_CHILDREN = """
    import os, subprocess, sys, time
    out, rank = sys.argv[1], os.environ["RANK"]
    up = [os.path.join(out, f"up_{kind}_{rank}") for kind in ("polite", "stubborn")]
    kids = [
        subprocess.Popen([sys.executable, os.path.join(out, "polite.py"),
                          os.path.join(out, "term_" + rank), up[0]]),
        subprocess.Popen([sys.executable, os.path.join(out, "stubborn.py"), up[1]]),
    ]
    while not all(os.path.exists(p) for p in up):  # handlers installed
        time.sleep(0.02)
    with open(os.path.join(out, "pids_" + rank), "w") as fh:
        fh.write(" ".join(str(k.pid) for k in kids))
"""


def test_leftovers_get_sigterm_then_sigkill(tmp_path):
    """Workers exit 0 leaving two background processes each: all get SIGTERM first (the polite
    ones write a marker on it), those that ignore it are SIGKILLed after --shutdown-timeout."""
    script(tmp_path, "polite.py", POLITE)
    script(tmp_path, "stubborn.py", STUBBORN)
    path = script(tmp_path, "leaves.py", LEAVES_CHILDREN)
    env = clean_env(TMPDIR=str(tmp_path))
    proc = start(
        ["--nproc-per-node", "2", "--shutdown-timeout", "1", path, tmp_path], tmp_path, env=env
    )
    result = finish(proc, timeout=40)
    pids = [int(p) for f in tmp_path.glob("pids_*") for p in f.read_text().split()]
    try:
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in tmp_path.glob("term_*")) == ["term_0", "term_1"]
        assert len(pids) == 4 and wait_gone(pids, timeout=5) == []
        assert _temp_folders(tmp_path) == []
    finally:
        kill_all(pids)


def test_secret_flags_are_checked(tmp_path, monkeypatch):
    from fastcomm.launch.cli import get_parser, parse_config

    path = script(tmp_path, "train.py", "pass\n")
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    monkeypatch.delenv(JOB_SECRET.name, raising=False)
    monkeypatch.delenv(JOB_SECRET_FILE.name, raising=False)
    cfg = parse_config(get_parser().parse_args(["--job-secret-file", str(secret), str(path)]))
    assert cfg.job_secret == b"0123456789abcdef0123456789abcdef"
    assert "job_secret=" not in repr(cfg)  # never printed
    monkeypatch.setenv(JOB_SECRET.name, "ab" * 16)
    assert parse_config(get_parser().parse_args([str(path)])).job_secret == b"\xab" * 16
