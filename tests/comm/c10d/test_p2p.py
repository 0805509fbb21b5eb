"""Point-to-point of backend ``fastcomm`` on the shm communicator, against Gloo, on 2 and 3 ranks.

Every call (``send``/``recv``, ``isend``/``irecv``, ``recv(src=None)``, ``batch_isend_irecv``)
runs on a fastcomm default group and on a Gloo group over the same ranks, and the values must be
equal bit for bit (and equal to the values computed locally), for every dtype and a
non-contiguous tensor; the fastcomm group's methods are counted so that no call reaches Gloo.
Then what Gloo cannot be compared on: tags received out of order (a message of several
mailbox chunks set aside), any-source receives, a size or dtype mismatch raising on both ranks
naming both and leaving the group usable, 64 MiB exchanged both ways in one batch, a peer that
never sends; and torch's pipelining schedules trained on each backend to the same parameters.
"""

from __future__ import annotations

import os
import signal
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import fastcomm  # noqa: F401 - registers the backend
from tests.harness import STATE, RankPool, env_rank, env_world, poll_barrier, rank_store

pytestmark = pytest.mark.timeout(240)

DTYPES = ["float32", "float64", "bfloat16", "float16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64", "complex128"]


def _groups():
    """``(fastcomm default group, Gloo group)``, made once per rank."""
    if "p2p_groups" not in STATE:
        store = dist.PrefixStore("c10d-p2p", rank_store().torch_store)
        dist.init_process_group("fastcomm", rank=env_rank(), world_size=env_world(), store=store,
                                timeout=timedelta(seconds=60))
        STATE["p2p_groups"] = (dist.group.WORLD, dist.new_group(backend="gloo"))
    return STATE["p2p_groups"]


@contextmanager
def _counting(group):
    """Counts the fastcomm group's p2p methods torch calls and the calls handed to Gloo."""
    cls = type(group)
    names = ("send", "recv", "recv_anysource", "_forward", "_start_coalescing",
             "_end_coalescing")
    # each method patched on the class that defines it (the group's own or a base's)
    owners = {name: next(k for k in cls.__mro__ if name in k.__dict__) for name in names}
    saved = {name: owners[name].__dict__[name] for name in names}
    calls = Counter()

    def counted(name, fn):
        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return fn(self, *args, **kwargs)
        return wrapper

    for name, fn in saved.items():
        setattr(owners[name], name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(owners[name], name, fn)


def _value(rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype is torch.bool:
        return torch.rand(numel, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(numel, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=gen, dtype=torch.int64).to(dtype)


def _calls(group, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
    """Every p2p call on ``group``: a ring of send/recv, of isend/irecv, of one batch; any-source
    receives on rank 0; a non-contiguous tensor each way. Returns what this rank received."""
    r, n = env_rank(), env_world()
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = []
    out = torch.empty(numel, dtype=dtype)
    if r % 2 == 0:  # sync: evens send first (a Gloo send of a big message waits for its recv)
        dist.send(_value(r, numel, dtype, 1), nxt, group=group)
        dist.recv(out, prv, group=group)
    else:
        dist.recv(out, prv, group=group)
        dist.send(_value(r, numel, dtype, 1), nxt, group=group)
    got.append(out.clone())
    out = torch.empty(numel, dtype=dtype)
    works = [dist.irecv(out, prv, group=group), dist.isend(_value(r, numel, dtype, 2), nxt,
                                                           group=group)]
    for work in works:
        work.wait()
    got.append(out.clone())
    outs = [torch.empty(numel, dtype=dtype) for _ in range(2)]
    ops = [dist.P2POp(dist.isend, _value(r, numel, dtype, 3), nxt, group=group),
           dist.P2POp(dist.irecv, outs[0], prv, group=group),
           dist.P2POp(dist.isend, _value(r, numel, dtype, 4), prv, group=group),
           dist.P2POp(dist.irecv, outs[1], nxt, group=group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    got.extend(outs)
    if r == 0:  # any source (a tag of its own): one message from every other rank
        rows = {}
        for _ in range(n - 1):
            row = torch.empty(numel, dtype=dtype)
            src = dist.recv(row, group=group, tag=5)
            rows[src] = row
        got.extend(rows[s] for s in range(1, n))
        got.append(torch.tensor(sorted(rows)))
    else:
        dist.send(_value(r, numel, dtype, 5), 0, group=group, tag=5)
    # non-contiguous: a transposed view each way (Gloo refuses them: it gets copies)
    square = _value(r, 16, dtype, 6).view(4, 4).t()
    into = torch.zeros(4, 4, dtype=dtype).t()
    if group is not dist.group.WORLD:
        square, into = square.contiguous(), into.contiguous()
    works = [dist.isend(square, nxt, group=group), dist.irecv(into, prv, group=group)]
    for work in works:
        work.wait()
    got.append(into.contiguous().view(-1))
    return got


def _expected(dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
    r, n = env_rank(), env_world()
    nxt, prv = (r + 1) % n, (r - 1) % n
    want = [_value(prv, numel, dtype, 1), _value(prv, numel, dtype, 2),
            _value(prv, numel, dtype, 3), _value(nxt, numel, dtype, 4)]
    if r == 0:
        want.extend(_value(s, numel, dtype, 5) for s in range(1, n))
        want.append(torch.arange(1, n))
    want.append(_value(prv, 16, dtype, 6).view(4, 4).t().contiguous().view(-1))
    return want


def check_calls_against_gloo(dtype_name: str, numel: int):
    dtype = getattr(torch, dtype_name)
    fast, gloo = _groups()
    with _counting(fast) as calls:
        mine = _calls(fast, dtype, numel)
    want = _expected(dtype, numel)
    # Gloo's any-source receive refuses an empty tensor (its enforce "offset < size")
    theirs = _calls(gloo, dtype, numel) if numel else want
    for a, b, c in zip(mine, theirs, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), (dtype_name, a, b)
        assert torch.equal(a, c.to(a.dtype))
    n = env_world()
    sends = 1 + 1 + 2 + (0 if env_rank() == 0 else 1) + 1
    recvs = 1 + 1 + 2 + 1
    expected = {"send": sends, "recv": recvs}
    if env_rank() == 0:
        expected |= {"recv_anysource": n - 1}
    assert dict(calls) == expected, calls  # nothing handed to Gloo, no coalescing
    return "ok"


def check_tags_out_of_order(numel: int):
    """Rank 0 sends tags 1, 2, 3 to rank 1, which receives 3, 1 then 2 (sync and async)."""
    fast, _ = _groups()
    r = env_rank()
    if r == 0:
        for tag in (1, 2, 3):
            dist.isend(_value(0, numel, torch.float32, tag), 1, group=fast, tag=tag)
        dist.send(_value(0, 3, torch.int16, 9), 1, group=fast, tag=-7)
        dist.barrier(group=fast)
        return "ok"
    if r == 1:
        got = {tag: torch.empty(numel) for tag in (1, 2, 3)}
        dist.recv(got[3], 0, group=fast, tag=3)
        first = dist.irecv(got[1], 0, group=fast, tag=1)
        second = dist.irecv(got[2], 0, group=fast, tag=2)
        second.wait()
        first.wait()
        small = torch.empty(3, dtype=torch.int16)
        dist.recv(small, 0, group=fast, tag=-7)
        for tag, t in got.items():
            assert torch.equal(t, _value(0, numel, torch.float32, tag)), tag
        assert torch.equal(small, _value(0, 3, torch.int16, 9))
    dist.barrier(group=fast)
    return "ok"


def check_any_source_sources():
    """Every rank but 0 sends its rank to 0 twice under two tags; rank 0 receives tag 2 from any
    source first, and ``irecv(src=None)``'s work reports the sender."""
    fast, _ = _groups()
    r, n = env_rank(), env_world()
    if r:
        dist.send(torch.tensor([r, 1]), 0, group=fast, tag=1)
        dist.send(torch.tensor([r, 2]), 0, group=fast, tag=2)
        return []
    seen = []
    for tag in (2, 1):
        for _ in range(n - 1):
            t = torch.empty(2, dtype=torch.int64)
            work = dist.irecv(t, group=fast, tag=tag)
            work.wait()
            src = work._source_rank()
            assert t.tolist() == [src, tag], (t, src, tag)
            seen.append(src)
    return seen


def check_mismatch(kind: str):
    """Rank 0 sends, rank 1 receives another size (or dtype): both raise, naming both; then
    the pair still works."""
    fast, _ = _groups()
    r = env_rank()
    message = None
    if r == 0:
        dist.send(torch.ones(10), 1, group=fast)
    elif r == 1:
        into = torch.empty(12) if kind == "size" else torch.empty(10, dtype=torch.int32)
        try:
            dist.recv(into, 0, group=fast)
        except ValueError as exc:
            message = str(exc)
    dist.barrier(group=fast)
    if r == 0:  # the notice was written before rank 1 reached the barrier
        try:
            dist.recv(torch.empty(2), 1, group=fast)
        except ValueError as exc:
            message = str(exc)
    if r in (0, 1):  # still usable, both ways
        peer = 1 - r
        out = torch.empty(2)
        works = [dist.isend(torch.full((2,), float(r)), peer, group=fast),
                 dist.irecv(out, peer, group=fast)]
        for w in works:
            w.wait()
        assert out.tolist() == [float(peer)] * 2
    dist.barrier(group=fast)
    return message


def check_large_both_ways(mib: int):
    """One batch of ``mib`` MiB each way between every pair of neighbours."""
    fast, gloo = _groups()
    r, n = env_rank(), env_world()
    numel = mib << 18
    results = []
    for group in (fast, gloo):
        outs = [torch.empty(numel) for _ in range(2)]
        ops = [dist.P2POp(dist.isend, _value(r, numel, torch.float32, 7), (r + 1) % n,
                          group=group),
               dist.P2POp(dist.irecv, outs[0], (r - 1) % n, group=group),
               dist.P2POp(dist.isend, _value(r, numel, torch.float32, 8), (r - 1) % n,
                          group=group),
               dist.P2POp(dist.irecv, outs[1], (r + 1) % n, group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        results.append(outs)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(results[0][0], _value((r - 1) % n, numel, torch.float32, 7))
    return "ok"


def check_peer_never_sends(timeout_s: float):
    """A receive nobody answers raises within the group's timeout, naming rank, op and peer."""
    _groups()
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    message = None
    if env_rank() == 0:
        work = dist.irecv(torch.empty(2), 1, group=group)
        with pytest.raises(TimeoutError, match="passed after"):  # this wait's own limit
            work.wait(timedelta(seconds=0.2))
        assert not work.is_completed()
        try:
            work.wait()  # the group's timeout: the operation fails
        except RuntimeError as exc:
            message = str(exc)
        with pytest.raises(RuntimeError) as again:  # and stays failed
            work.wait()
        assert str(again.value) == message and work.is_completed() and not work.is_success()
    poll_barrier(f"p2p-never/{STATE.setdefault('never', 0)}")
    STATE["never"] += 1
    dist.destroy_process_group(group)
    return message


# ---------------------------------------------------------------------- pipelining
def _pipeline(backend_group, schedule_name: str, steps: int = 3):
    """Trains an 8-layer MLP split over the ranks with ``schedule_name``; returns this rank's
    parameters and losses."""
    from torch.distributed.pipelining import PipelineStage, schedules

    r, n = env_rank(), env_world()
    per_rank = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    stages_total = n * per_rank
    width, layers_per_stage = 16, 2
    torch.manual_seed(0)
    full = [torch.nn.Linear(width, width) for _ in range(stages_total * layers_per_stage)]
    mods, stages = [], []
    for local in range(per_rank):
        index = r + local * n
        block = torch.nn.Sequential(*[m for i in range(layers_per_stage)
                                      for m in (full[index * layers_per_stage + i],
                                                torch.nn.GELU())])
        mods.append(block)
        stages.append(PipelineStage(block, index, stages_total, torch.device("cpu"),
                                    group=backend_group))
    cls = getattr(schedules, schedule_name)
    loss_fn = torch.nn.MSELoss()
    schedule = cls(stages if per_rank > 1 else stages[0], n_microbatches=4, loss_fn=loss_fn)
    params = [p for m in mods for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, width, generator=gen)
        y = torch.randn(16, width, generator=gen)
        opt.zero_grad()
        step_losses = []
        if r == 0:
            schedule.step(x, target=y, losses=step_losses)
        elif r == n - 1:
            schedule.step(target=y, losses=step_losses)
        else:
            schedule.step()
        opt.step()
        losses.append([float(v) for v in step_losses])
    return [p.detach().clone() for p in params], losses


def check_pipeline(schedule_name: str):
    fast, gloo = _groups()
    with _counting(fast) as calls:
        fast_params, fast_losses = _pipeline(fast, schedule_name)
    gloo_params, gloo_losses = _pipeline(gloo, schedule_name)
    assert calls["_forward"] == 0 and calls["send"] + calls["recv"] > 0, calls
    for a, b in zip(fast_params, gloo_params, strict=True):
        assert torch.equal(a, b)
    assert fast_losses == gloo_losses
    return "ok"


# ---------------------------------------------------------------------- the checks
# 2 and 3 ranks on the compiled core; 2 ranks on the pure-Python path of the same protocol
# (FASTCOMM_SHM_COMPILED=0: what runs where no C compiler was found at install)
@pytest.fixture(scope="module", params=[(2, "1"), (3, "1"), (2, "0")],
                ids=["2ranks", "3ranks", "2ranks-python"])
def pool(request):
    size, compiled = request.param
    env = {"OMP_NUM_THREADS": "1", "FASTCOMM_SHM_COMPILED": compiled}
    with RankPool(size, timeout=180, env=env) as p:
        yield p


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_call_equals_gloo(pool, dtype):
    assert pool.run(check_calls_against_gloo, dtype, 37) == ["ok"] * pool.world_size


@pytest.mark.parametrize("numel", [0, 1, 1 << 10, 300_000])  # 300k floats: several chunks
def test_every_call_equals_gloo_by_size(pool, numel):
    assert pool.run(check_calls_against_gloo, "float32", numel) == ["ok"] * pool.world_size


@pytest.mark.parametrize("numel", [5, 200_000])
def test_tags_out_of_order(pool, numel):
    pool.run(check_tags_out_of_order, numel)


def test_any_source_reports_the_sender(pool):
    seen = pool.run(check_any_source_sources)[0]
    n = pool.world_size
    assert sorted(seen[: n - 1]) == list(range(1, n)) and sorted(seen[n - 1:]) == list(range(1, n))


@pytest.mark.parametrize("kind", ["size", "dtype"])
def test_mismatch_raises_on_both_ranks_naming_both(pool, kind):
    messages = pool.run(check_mismatch, kind)
    sender, receiver = messages[0], messages[1]
    theirs = "12 x float32 (48 bytes)" if kind == "size" else "10 x int32 (40 bytes)"
    assert receiver.startswith("rank 1: recv from rank 0") and "10 x float32 (40 bytes)" in \
        receiver and theirs in receiver, receiver
    assert sender.startswith("rank 0: send to rank 1") and "10 x float32 (40 bytes)" in sender \
        and theirs in sender, sender


def test_64_mib_both_ways_in_one_batch(pool):
    pool.run(check_large_both_ways, 64)


def test_a_peer_that_never_sends_times_out(pool):
    message = pool.run(check_peer_never_sends, 2.0)[0]
    assert message.startswith("rank 0: recv from rank 1") and "timed out" in message, message


@pytest.mark.parametrize("schedule", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_pipeline_schedules_train_to_gloos_parameters(pool, schedule):
    pool.run(check_pipeline, schedule)


def check_engine_path() -> bool:
    fast, _ = _groups()
    return fast.communicator.mailboxes._compiled


def test_the_pool_runs_the_path_it_names(pool):
    compiled = pool.env["FASTCOMM_SHM_COMPILED"] == "1"
    from fastcomm.comm.shm import core

    if not core.BUILT:
        pytest.skip("the compiled core was not built (no C compiler at install)")
    assert pool.run(check_engine_path) == [compiled] * pool.world_size


def check_send_to_self():
    """``isend`` to this rank (torch's ``isend`` lets it through; Gloo fails it with "Pair is
    not connected"): a ValueError naming the rank and the peer, before anything is sent."""
    fast, _ = _groups()
    r = env_rank()
    with pytest.raises(ValueError) as info:
        dist.isend(torch.ones(5), r, group=fast)
    assert str(info.value).startswith(f"rank {r}: send: peer rank {r} must be another rank")
    out = torch.ones(2)  # nothing was sent: the group still works
    dist.all_reduce(out, group=fast)
    assert out.tolist() == [float(env_world())] * 2
    return "ok"


def test_send_to_self_is_refused(pool):
    pool.run(check_send_to_self)


def check_torch_calls_are_recorded():
    """The calls the group runs without the communicator's methods (the short way of gather
    and split all_to_all_single, point-to-point on the engine) are in its flight record."""
    fast, _ = _groups()
    recorder = fast.communicator.flight
    rank, world = env_rank(), env_world()
    first = recorder.seq + 1
    x = torch.arange(2 * world, dtype=torch.float32)
    outs = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, outs, dst=0, group=fast)
    dist.all_to_all_single(torch.empty_like(x), x, [2] * world, [2] * world, group=fast)
    send = dist.isend(x, (rank + 1) % world, group=fast)
    recv = dist.irecv(torch.empty_like(x), (rank - 1) % world, group=fast)
    send.wait()
    recv.wait()
    return [(e["op"], e["state"]) for e in recorder.entries() if e["seq"] >= first]


def test_torch_calls_are_recorded(pool):
    expected = [("gather", "completed"), ("all_to_all_v", "completed"), ("send", "completed"),
                ("recv", "completed")]
    assert pool.run(check_torch_calls_are_recorded) == [expected] * pool.world_size


def _record(recorder, first: int) -> list[tuple]:
    """The recorded calls from ``first`` on, without their times."""
    return [(e["op"], e["state"], e["dtype"], e["numel"], e["root"], e["desc"])
            for e in recorder.entries() if e["seq"] >= first]


def check_lane_matches_the_python_path():
    """The compiled lane (``group._lane``) takes the usual send and recv, and leaves the same
    statistics, flight record, handles and version counter as the Python path does with the
    lane turned off; with the pure-Python core there is no lane."""
    fast, _ = _groups()
    rank, world = env_rank(), env_world()
    peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
    for work in dist.batch_isend_irecv([  # the first call builds the engine and its lane
            dist.P2POp(dist.isend, torch.ones(1), peer_to, group=fast),
            dist.P2POp(dist.irecv, torch.empty(1), peer_from, group=fast)]):
        work.wait()
    comm, recorder = fast.communicator, fast.communicator.flight
    seen = {}
    for lane_on in (True, False):
        x = torch.arange(16, dtype=torch.float64) + rank
        out = torch.empty(16, dtype=torch.float64)
        saved = fast._lane
        if not lane_on:
            fast._lane = None
        try:
            calls, sent = dict(comm.stats.calls), dict(comm.stats.bytes)
            first, version = recorder.seq + 1, out._version
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer_to, group=fast),
                                            dist.P2POp(dist.irecv, out, peer_from, group=fast)])
            for work in works:
                work.wait()
            assert torch.equal(out, torch.arange(16, dtype=torch.float64) + peer_from)
            assert works[1]._source_rank() == peer_from and works[1].result() == [out]
            assert works[0].result() == [x] and works[0].is_completed()
            seen[lane_on] = (
                comm.stats.calls.get("send", 0) - calls.get("send", 0),
                comm.stats.calls.get("recv", 0) - calls.get("recv", 0),
                comm.stats.bytes.get("send", 0) - sent.get("send", 0),
                out._version - version,
                _record(recorder, first),
            )
        finally:
            fast._lane = saved
    return fast._lane is not None, seen[True] == seen[False], seen[True]


def check_lane_declines_other_calls():
    """What the lane leaves to the Python path returns ``None`` with nothing done (statistics
    and record unchanged); a receive whose message does not come within the spin budget
    returns ``False``, nothing done; the call then works through torch."""
    fast, _ = _groups()
    rank = env_rank()
    peer = 1 - rank
    dist.barrier(group=fast)
    if fast._lane is None:  # the first call builds the engine and its lane
        work = dist.isend(torch.ones(1), peer, group=fast)
        dist.recv(torch.empty(1), peer, group=fast)
        work.wait()
    lane = fast._lane
    comm, recorder = fast.communicator, fast.communicator.flight
    calls, seq = dict(comm.stats.calls), recorder.seq
    x = torch.ones(8)
    declined = [
        lane.send([x[::2]], peer, 0),  # not contiguous
        lane.send([torch.nn.Parameter(x)], peer, 0),  # a subclass
        lane.send([x.to_sparse()], peer, 0),
        lane.send([x], True, 0),  # a bool is no rank
        lane.send([x], rank, 0),  # this rank
        lane.send([x], peer, 1 << 63),  # beyond int64
        lane.send([x, x], peer, 0),
        lane.send((x,), peer, 0),
        lane.recv([torch.empty(1 << 22)], peer, 0),  # more than one chunk
    ]
    with torch.profiler.profile():
        declined.append(lane.send([x], peer, 0))  # the Python path opens the range
    assert declined == [None] * len(declined), declined
    assert dict(comm.stats.calls) == calls and recorder.seq == seq
    poll_barrier("lane-declines")
    if rank == 0:
        early = lane.recv([torch.empty(8)], peer, 0)  # rank 1 sends only after the barrier
        assert early is False, early
        assert dict(comm.stats.calls) == calls and recorder.seq == seq
    poll_barrier("lane-declines-early")
    if rank == 1:
        dist.send(torch.full((8,), 3.0), 0, group=fast)
    else:
        out = torch.empty(8)
        dist.recv(out, 1, group=fast)
        assert out.tolist() == [3.0] * 8
    return "ok"


def check_lane_reuses_only_free_handles():
    """A finished handle the caller still holds is never handed out again; one nobody holds is."""
    fast, _ = _groups()
    rank = env_rank()
    peer = 1 - rank
    held = []
    for i in range(4):
        x = torch.full((4,), float(i))
        out = torch.empty(4)
        if rank == 0:
            held.append(dist.isend(x, peer, group=fast))
            held.append(dist.irecv(out, peer, group=fast))
        else:
            held.append(dist.irecv(out, peer, group=fast))
            held.append(dist.isend(x, peer, group=fast))
        for work in held[-2:]:
            work.wait()
        assert out.tolist() == [float(i)] * 4
    assert len({id(w) for w in held}) == len(held)
    for i, work in enumerate(held):
        (tensor,) = work.result()
        assert tensor.tolist() == [float(i // 2)] * 4
    refs = []
    for _ in range(6):  # nothing kept: the lane hands out a handle it made before
        # (a send: its slot is free, the lane takes it; a receive may find its message set
        # aside by the engine's thread, which the Python path takes)
        if rank == 0:
            work = dist.isend(torch.ones(2), peer, group=fast)
            work.wait()
            refs.append(weakref.ref(work))
            del work
        else:
            dist.recv(torch.empty(2), peer, group=fast)
        dist.barrier(group=fast)
    alive = {id(ref()) for ref in refs if ref() is not None}
    return len(alive), sum(ref() is None for ref in refs)


def check_unwanted_message_stays_in_the_mailbox():
    """A receive posted before its message came completes in the engine's progress, which
    leaves the next message from the same rank in the mailbox (no receive wants it yet)
    instead of setting it aside; the next receive takes it from there."""
    fast, _ = _groups()
    if env_rank() == 1:
        poll_barrier("unwanted-posted")
        dist.send(torch.full((4,), 1.0), 0, group=fast)
        dist.send(torch.full((4,), 2.0), 0, group=fast)  # the pair's second slot
        poll_barrier("unwanted-sent")
        return None
    first, second = torch.empty(4), torch.empty(4)
    work = dist.irecv(first, 1, group=fast)  # nothing sent yet: posted
    poll_barrier("unwanted-posted")
    poll_barrier("unwanted-sent")
    work.wait()
    engine = fast._mailboxes
    set_aside, in_mailbox = len(engine._stash[1]), engine._streams.header(1) is not None
    dist.recv(second, 1, group=fast)
    return first.tolist(), second.tolist(), set_aside, in_mailbox


def test_an_unwanted_message_stays_in_the_mailbox(pool):
    if pool.world_size != 2:
        pytest.skip("2 ranks")
    result = pool.run(check_unwanted_message_stays_in_the_mailbox)[0]
    assert result == ([1.0] * 4, [2.0] * 4, 0, True), result


def test_lane_matches_the_python_path(pool):
    results = pool.run(check_lane_matches_the_python_path)
    compiled = pool.env["FASTCOMM_SHM_COMPILED"] == "1"
    from fastcomm.comm.shm import core

    for has_lane, same, (sends, recvs, nbytes, version, record) in results:
        assert has_lane == (compiled and core.BUILT)
        assert same, results
        assert (sends, recvs, nbytes, version) == (1, 1, 128, 1)
        assert [(op, state) for op, state, *_ in record] == [("send", "completed"),
                                                             ("recv", "completed")]
        assert record[0][2:4] == ("float64", 16), record
        assert {record[0][4], record[1][4]} <= set(range(pool.world_size)), record


def test_lane_declines_other_calls(pool):
    from fastcomm.comm.shm import core

    if pool.env["FASTCOMM_SHM_COMPILED"] != "1" or pool.world_size != 2 or not core.BUILT:
        pytest.skip("the lane: the compiled core, 2 ranks")
    assert pool.run(check_lane_declines_other_calls) == ["ok", "ok"]


def test_lane_reuses_only_free_handles(pool):
    if pool.world_size != 2:
        pytest.skip("2 ranks")
    kinds = pool.run(check_lane_reuses_only_free_handles)
    from fastcomm.comm.shm import core

    if pool.env["FASTCOMM_SHM_COMPILED"] == "1" and core.BUILT:
        # every handle of the six sends is one the lane still keeps (none was dropped)
        assert kinds[0][0] in (1, 2) and kinds[0][1] == 0, kinds


def check_recv_from_a_killed_rank():
    group, _ = _groups()
    dead = env_world() - 1
    dist.barrier(group=group)
    if env_rank() == dead:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.recv(torch.empty(4), src=dead, group=group)
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, time.monotonic() - start, str(exc)
    raise AssertionError(f"rank {env_rank()}: recv from a killed rank returned")


def test_recv_from_a_killed_rank_fails_fast(pool):
    """A receive from a rank that died fails within a fraction of the group's 60 s timeout,
    naming it (last in the module: the pool restarts its ranks after it)."""
    failure = pool.expect_failure(check_recv_from_a_killed_rank)
    dead = pool.world_size - 1
    assert list(failure.errors) == [dead], failure.errors
    for rank in range(dead):
        kind, elapsed, message = failure.results[rank]
        assert kind == "PeerLostError", message
        assert f"recv from rank {dead}" in message and "exited" in message, message
        assert elapsed < 20, (elapsed, message)
