"""The flight recorder and the hang report on real ranks: shm, Gloo and hier.

Each check runs 3 ranks with a short collective timeout and suspect interval; one rank goes
wrong (sleeps in its data loader, calls another op, is SIGSTOPped or killed) and the others'
error carries the report's first line as a note, which must name the rank, the op, the
sequence number and the frame. The early warning's report (a request before the timeout) is
read from ``FASTCOMM_FLIGHT_DIR``.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from fastcomm.comm.errors import FastcommError
from fastcomm.comm.flight import FlightRecorder
from fastcomm.trace import analyze
from tests.harness import RankPool, fresh_comm, rank_store

TIMEOUT = 6.0
ENV = {"FASTCOMM_SUSPECT_S": "2", "FASTCOMM_FLIGHT_POLL_S": "0.5"}
WARMUP = 5  # calls before the faulty one: it is #6


def next_batch(name, others):
    """The data loader that never delivers, until every rank of `others` holds its report,
    which names this frame (looked for every 20 ms: a fixed sleep could end before the
    reports on a busy machine, and made every check wait it out)."""
    store, deadline = rank_store(), time.monotonic() + 60
    while not store.check([f"{name}/noted/{r}" for r in others]):
        assert time.monotonic() < deadline, f"rank 1: no report of {others} after 60 s"
        time.sleep(0.02)


def _note(exc):
    return next((n for n in getattr(exc, "__notes__", []) if n.startswith("flight report: ")),
                "").removeprefix("flight report: ")


def _run(backend, name, fault):
    """Every rank: WARMUP all_reduces, then rank 1 misbehaves as ``fault`` says; returns
    (rank, first line of the report from the error's note, or None)."""
    if backend == "hier":  # two namespaced hosts: ranks 0,1 on one, rank 2 on the other
        os.environ["FASTCOMM_HOST_ID"] = f"host{int(os.environ['RANK']) // 2}"
    try:
        comm = fresh_comm(backend, name, timeout=TIMEOUT)
    finally:
        os.environ.pop("FASTCOMM_HOST_ID", None)
    tensor = torch.ones(1024)
    for _ in range(WARMUP):
        comm.all_reduce(tensor)
    if comm.rank == 1:
        if fault == "sleep":
            next_batch(name, [r for r in range(comm.size) if r != comm.rank])
            comm.close()
            return comm.rank, None
        if fault == "other":
            try:
                comm.broadcast(torch.zeros(256, dtype=torch.int64), 0)
            except FastcommError as exc:
                return comm.rank, _note(exc)
            return comm.rank, None
        if fault == "stop":
            rank_store().set(f"{name}/stopped", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(tensor)
    except FastcommError as exc:
        if fault == "stop":
            _end_stopped(name, comm.size)
        if fault == "sleep":  # rank 1 may leave its data loader
            rank_store().set(f"{name}/noted/{comm.rank}", "1")
        return comm.rank, _note(exc)
    finally:
        comm.close()
    return comm.rank, None


def _end_stopped(name, size):
    """The last of the other ranks to hold its report kills the stopped rank 1, which the pool
    would otherwise wait for until the check's own timeout."""
    store = rank_store()
    if store.add(f"{name}/reported", 1) == size - 1:
        os.kill(int(store.get(f"{name}/stopped", 30)), signal.SIGKILL)


def _early_reports(folder):
    """First lines of the reports written before the timeout (request 1: the warning)."""
    out = []
    for root, _, files in os.walk(folder):
        for f in files:
            if f.startswith("report.rank"):
                with open(os.path.join(root, f)) as fh:
                    out.append((root, fh.readline().strip()))
    return sorted(out)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flight")
    with RankPool(3, env={**ENV, "FASTCOMM_FLIGHT_DIR": str(folder)}, timeout=60) as p:
        p.folder = folder
        yield p


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "gloo", "hier"])
def test_rank_in_its_data_loader(pool, backend):
    name = f"sleep-{backend}"
    results = pool.run(_run, backend, name, "sleep")
    for rank, line in results:
        if rank == 1:
            continue
        assert line.startswith(f"rank 1 never entered all_reduce #{WARMUP + 1} of {backend}"), line
        assert "ranks 0,2 waiting since" in line and "in next_batch" in line, line
        assert "test_flight.py:" in line, line
    early = [line for root, line in _early_reports(pool.folder) if f"{backend}{os.sep}1" in root]
    assert early and early[0].startswith("rank 1 never entered all_reduce #6"), early


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "gloo", "hier"])
def test_rank_calls_another_op(pool, backend):
    results = pool.run(_run, backend, f"other-{backend}", "other")
    lines = [line for _, line in results]
    assert any(line and line.startswith("ranks disagree at #6: ") for line in lines), lines
    line = next(x for x in lines if x)
    assert "ranks 0,2 all_reduce(float32, 1024 elements" in line, line
    assert "rank 1 broadcast(int64, 256 elements, src 0)" in line, line


def test_recorder_ring_wraps():
    recorder = FlightRecorder("t", 0, 1, capacity=4)
    tensor = torch.ones(3)
    for _ in range(6):
        recorder.end(recorder.issue("all_reduce", tensor, None))
    seq = recorder.issue("broadcast", tensor, 0)
    rows = recorder.entries()
    assert [r["seq"] for r in rows] == [4, 5, 6, 7]
    assert rows[-1]["state"] == "started"
    assert rows[-1]["desc"] == "broadcast(float32, 3 elements, src 0)"
    assert recorder.in_flight()[:2] == (seq, "broadcast") and recorder.last_done() == 6


def test_tensors_taking_turns_are_described_right():
    """The recorder remembers the last two tensors' shapes: a send's and a receive's buffer
    taking turns, a third tensor, and a new tensor where a dead one was, each described as
    it is."""
    recorder = FlightRecorder("t", 0, 2, capacity=16)
    a, b, c = torch.ones(3), torch.zeros(5, dtype=torch.int64), torch.ones(2, 4)
    for tensor in (a, b, a, b, c, a, c, b):
        recorder.returned(recorder.issue("send", tensor, 1))
    descs = [row["desc"] for row in recorder.entries()]
    want = {id(a): "float32, 3 elements", id(b): "int64, 5 elements", id(c): "float32, 8"}
    for desc, tensor in zip(descs, (a, b, a, b, c, a, c, b), strict=True):
        assert want[id(tensor)] in desc, descs
    del a, b  # a new tensor may take a dead one's address: described anew
    d = torch.ones(7, dtype=torch.float16)
    recorder.returned(recorder.issue("recv", d, 1))
    assert "float16, 7 elements" in recorder.entries(last=1)[0]["desc"]


def test_returned_and_pending_calls():
    """A synchronous call that returned ends with one store when untimed, by ``end`` when
    timed; a call left pending stays in flight whatever returns after it."""
    recorder = FlightRecorder("t", 0, 1, capacity=16)
    tensor = torch.ones(3)
    for _ in range(9):  # seqs 1..9: 8 is timed
        recorder.returned(recorder.issue("gather", tensor, 0))
    rows = recorder.entries()
    assert [r["state"] for r in rows] == ["completed"] * 9 and recorder.in_flight() is None
    assert rows[7]["issued"] is not None and rows[7]["ended"] is not None  # timed: both stamps
    pending = recorder.issue("recv", tensor, 1)
    recorder.pending(pending)
    for _ in range(3):
        recorder.returned(recorder.issue("send", tensor, 1))
    assert recorder.entries(last=4)[0]["state"] == "issued"
    assert recorder.in_flight()[:2] == (pending, "recv") and recorder.last_done() == 13
    recorder.end(pending)
    assert recorder.entries(last=4)[0]["state"] == "completed" and recorder.in_flight() is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault,why", [("stop", "is stopped"), ("kill", "exited")])
@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_rank_stopped_or_killed(pool, backend, fault, why):
    # the others finish within TIMEOUT and the report; a stopped rank 1 never returns
    failure = pool.expect_failure(_run, backend, f"{fault}-{backend}", fault,
                                  timeout=TIMEOUT + 19)
    assert 1 in failure.unfinished or 1 in failure.errors, failure
    lines = [line for rank, line in failure.results.values() if rank != 1]
    assert len(lines) == 2, failure
    for line in lines:
        assert line.startswith("rank 1 (host "), line
        assert "stopped answering at" in line and why in line, line


def test_profiler_ranges_and_latency():
    from fastcomm.comm import new_communicator
    from fastcomm.comm.store import Store

    store = Store(is_server=True, timeout=30)
    comm = new_communicator("shm", store=store.prefixed("prof", rank=0), rank=0, size=1,
                            timeout=30, watch=False)
    try:
        x = torch.ones(1024)
        comm.all_reduce(x)  # outside the profiler: no range
        with torch.profiler.profile() as prof:
            comm.all_reduce(x)
            comm.broadcast(x, 0, async_op=True).wait()
        names = [e.name for e in prof.events()]
        assert names.count("fastcomm.shm.all_reduce") == 1, names
        assert names.count("fastcomm.shm.broadcast") == 1, names
        from fastcomm.ddp import DDP

        model = DDP(torch.nn.Linear(8, 2), comm=comm)
        with torch.profiler.profile() as prof:
            model(torch.ones(4, 8)).sum().backward()
        names = [e.name for e in prof.events()]
        assert any(n.startswith("fastcomm.ddp.bucket") for n in names), names
        from fastcomm.comm.flight import SAMPLE

        for _ in range(2 * SAMPLE):  # every SAMPLE-th call is timed: two or three of these
            comm.all_reduce(x)
        latency = comm.stats.latency()
        assert 2 <= latency["all_reduce"][4096]["count"] <= 3, latency
        assert 0 < latency["all_reduce"][4096]["p50"] <= latency["all_reduce"][4096]["p99"]
    finally:
        comm.close()


class _Event:
    """A CUDA event stand-in (no CUDA here): done or never done."""

    def __init__(self, done):
        self.done = done

    def query(self):
        return self.done


def test_stream_work_that_never_completes():
    """NCCL's path: an EventWork whose event never completes stays in flight until the
    stream's watchdog times it out; the record then names the call, and the report the rank
    that never issued it."""
    from fastcomm.comm.errors import CommTimeoutError
    from fastcomm.comm.stream import EventWork, StreamWatchdog

    recorders = [FlightRecorder("nccl", r, 2) for r in range(2)]
    stuck = threading.Event()

    def on_stuck(work):
        stuck.set()
        return CommTimeoutError(f"rank 0: {work.op} timed out")

    dogs = [StreamWatchdog(f"test-watchdog{r}", 0.2, 0.02, on_stuck) for r in range(2)]
    x = torch.ones(16)
    try:
        for rank, recorder in enumerate(recorders):
            dog = dogs[rank]
            calls = 3 if rank == 0 else 2  # rank 1 never issues #3
            for i in range(calls):
                seq = recorder.issue("all_reduce", x, None)
                work = EventWork("all_reduce", rank, x, torch.device("cuda", 0),
                                 _Event(i < 2), (x,), None)
                recorder.finish(seq, work)
                with dog.lock:
                    dog.track(work)
        assert recorders[0].in_flight()[:2] == (3, "all_reduce")
        assert stuck.wait(10)
        deadline = time.monotonic() + 10
        while (recorders[0].entries()[-1]["state"] != "failed"
               or recorders[1].in_flight()) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for dog in dogs:
            dog.close()
    states = [e["state"] for e in recorders[0].entries()]
    assert states == ["completed", "completed", "failed"], states
    dumps = {r: {"rank": r, "size": 2, "host": "h", "pid": 100 + r,
                 "recorders": [{"name": "nccl", "main": True, "seq": rec.seq,
                                "entries": rec.entries()}],
                 "where": "train.py:12 in step" if r == 0 else "train.py:5 in next_batch"}
             for r, rec in enumerate(recorders)}
    line = analyze(dumps, {}, 2, "nccl")[0]
    assert line.startswith("rank 1 never entered all_reduce #3 of nccl (rank 0 waiting since "
                           ), line
    assert line.endswith("rank 1 is at train.py:5 in next_batch"), line


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_async_call_ends_when_its_work_does(backend):
    from fastcomm.comm import new_communicator
    from fastcomm.comm.store import Store

    store = Store(is_server=True, timeout=30)
    comm = new_communicator(backend, store=store.prefixed("async", rank=0), rank=0, size=1,
                            timeout=30, watch=False)
    try:
        work = comm.all_reduce(torch.ones(8), async_op=True)
        work.wait()
        comm.barrier()
        rows = comm.flight.entries()
        assert [(r["op"], r["state"]) for r in rows] == [("all_reduce", "completed"),
                                                         ("barrier", "completed")], rows
        assert rows[0]["desc"] == "all_reduce(float32, 8 elements, op sum)", rows
    finally:
        comm.close()


def _dump(rank: int, entries: list[dict], where: str = "train.py:10 in step") -> dict:
    return {"rank": rank, "host": "h", "pid": 100 + rank, "where": where,
            "recorders": [{"main": True, "seq": entries[-1]["seq"], "entries": entries}]}


def _call(seq: int, state: str, issued: float) -> dict:
    return {"seq": seq, "op": "all_reduce", "desc": "all_reduce(float32, 4 elements)",
            "state": state, "issued": issued}


@pytest.mark.parametrize("exited", ["after the wait began", "before it"])
def test_a_rank_that_never_entered_comes_before_one_that_left_the_wait(exited):
    """4 ranks: 0 and 1 wait in #5 since t0, 3 stopped before it (its last call #4), and 2
    left no record (it exited). Where 2's last heartbeat came after t0 (it gave up on the wait,
    say), rank 3 is the cause and 2 is named after it; where it came before, 2 is the cause."""
    t0 = time.time() - 30
    done = [_call(s, "completed", t0 - 5 + s) for s in range(1, 5)]
    dumps = {r: _dump(r, [*done, _call(5, "started", t0)]) for r in (0, 1)}
    dumps[3] = _dump(3, done, where="train.py:42 in next_batch")
    beat_time = t0 + 20 if exited == "after the wait began" else t0 - 10
    beats = {r: {"host": "h", "time": t0 + 25, "poll": 1.0} for r in (0, 1, 3)}
    beats[2] = {"host": "h", "time": beat_time, "poll": 1.0, "status": "exited", "pid": 102}
    line = analyze(dumps, beats, 4, "world")[0]
    if exited == "after the wait began":
        assert line.startswith("rank 3 never entered all_reduce #5 of world (ranks 0,1 "), line
        assert "rank 3 is at train.py:42 in next_batch" in line, line
        assert "rank 2 (host h) stopped answering" in line and "(pid 102 exited)" in line, line
    else:
        assert line.startswith("rank 2 (host h) stopped answering at "), line
        assert "ranks 0,1 waiting in all_reduce #5 of world" in line, line
