"""The shm communicator's send/recv: the compiled core's chunk calls on their own, then real ranks.

One process first drives two ``SmallCore`` objects (rank 0 and rank 1) over one buffer laid out
as a 2-rank segment: every status of ``send``/``recv``, and that a wait status writes nothing.
Then two real ranks, each side compiled or not (``ShmOptions(compiled=False)``: the Python path
of the same protocol), move every dtype at the sizes around one mailbox slot (4 KiB mailboxes:
4032 bytes a chunk) in both directions, bit for bit; a synchronous call takes the caller's
thread (no executor is ever started), an asynchronous one the peer's executor, in issue order.
Failures: a size mismatch raises on the receiver naming both sizes, a peer that never sends or
never receives times out naming the rank and the op, a peer that closes or aborts while we wait
raises ``CommAbortedError`` at once.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np
import pytest
import torch

from fastcomm.comm import (
    SUPPORTED_DTYPES,
    CommAbortedError,
    CommTimeoutError,
    FastcommError,
    ShmCommunicator,
    ShmOptions,
)
from fastcomm.comm.shm.core import BUILT
from fastcomm.comm.shm.rounds import pair_words
from fastcomm.comm.shm.segment import Layout
from tests.harness import pool_fixture, rank_store

if BUILT:  # the extension itself, driven directly
    from fastcomm.comm.shm import _core as core
else:
    core = None
needs_core = pytest.mark.skipif(core is None, reason="the compiled core was not built")
MBOX = 4096
ROOM = MBOX - 64  # bytes of one chunk: a mailbox slot less its header
SIDES = {"C-C": (True, True), "C-Py": (True, False), "Py-C": (False, True)}


# ------------------------------------------------------------------ the core in one process
def two_cores():
    """Rank 0's and rank 1's SmallCore over one buffer laid out as a 2-rank segment, as
    ``SegmentSchedules`` builds them; and the buffer's words."""
    layout = Layout(2, 4096, MBOX)
    words = np.zeros(layout.total // 8, dtype=np.uint64)
    cores = []
    for me in range(2):
        peer = 1 - me
        p2p = [idx for r in range(2) for idx in pair_words(layout, me, r)]
        boxes = [0] * 4 * 2
        boxes[4 * peer : 4 * peer + 4] = [layout.mailbox(me, peer, 0), layout.mailbox(me, peer, 1),
                                          layout.mailbox(peer, me, 0), layout.mailbox(peer, me, 1)]
        cores.append(core.SmallCore(
            words, me, [layout.seq(r) // 8 for r in range(2)],
            [layout.misc(r, 0) // 8 for r in range(2)],
            [layout.misc(r, w) // 8 for r in range(2) for w in (4, 5, 8, 9)],
            [layout.slot(h, r) for h in range(2) for r in range(2)], 4096, p2p, boxes, MBOX,
        ))
    return cores, words, layout


@needs_core
def test_core_chunks_statuses_and_waits_that_write_nothing():
    (c0, c1), words, layout = two_cores()
    sent01, acked01 = layout.sent(0, 1) // 8, layout.acked(1, 0) // 8
    out = torch.full((8,), -1, dtype=torch.int64)
    # no message yet: nothing copied, nothing acknowledged
    assert c1.recv(out.data_ptr(), 64, 64, 0, 0, 1000) == core.MESSAGE_WAIT
    assert (out == -1).all() and words[acked01] == 0
    msgs = [torch.arange(8, dtype=torch.int64) + 100 * i for i in range(3)]
    assert c0.send(msgs[0].data_ptr(), 64, 64, 1, 0, 0) == core.DONE
    assert c0.send(msgs[1].data_ptr(), 64, 64, 1, 1, 0) == core.DONE
    assert words[sent01] == 2
    assert words[layout.mailbox(0, 1, 1) // 8] == 64  # slot 1's header: the total
    # chunk 2 needs slot 0, whose chunk 0 was not taken: nothing written
    before = words[layout.mailbox(0, 1, 0) // 8 : layout.mailbox(0, 1, 0) // 8 + 16].copy()
    assert c0.send(msgs[2].data_ptr(), 64, 64, 1, 2, 1000) == core.SLOT_WAIT
    assert words[sent01] == 2
    assert (words[layout.mailbox(0, 1, 0) // 8 :][:16] == before).all()
    # a receiver of another size: nothing copied, not acknowledged; the right size then takes it
    assert c1.recv(out.data_ptr(), 56, 56, 0, 0, 0) == core.SIZE_MISMATCH
    assert (out == -1).all() and words[acked01] == 0
    assert c1.recv(out.data_ptr(), 64, 64, 0, 0, 0) == core.DONE
    assert torch.equal(out, msgs[0]) and words[acked01] == 1
    assert c0.send(msgs[2].data_ptr(), 64, 64, 1, 2, 0) == core.DONE
    for k in (1, 2):
        assert c1.recv(out.data_ptr(), 64, 64, 0, k, 0) == core.DONE
        assert torch.equal(out, msgs[k])
    assert words[acked01] == 3 and words[sent01] == 3
    # an empty message: a header and a counter, no bytes (any address)
    assert c1.send(0, 0, 0, 0, 0, 0) == core.DONE
    assert c0.recv(0, 0, 0, 1, 0, 0) == core.DONE


@needs_core
def test_core_send_recv_arguments_are_checked():
    (c0, _), words, _ = two_cores()
    user = torch.zeros(ROOM + 8, dtype=torch.uint8)
    for args, error, message in [
        ((user.data_ptr(), ROOM + 1, 1, 1, 0, 0), ValueError, "nbytes must be in"),
        ((user.data_ptr(), 4, 4, 0, 0, 0), ValueError, "peer 0 is this rank"),
        ((user.data_ptr(), 4, 4, 2, 0, 0), ValueError, "peer must be in"),
        ((user.data_ptr(), 4, -1, 1, 0, 0), ValueError, "total must be in"),
        ((user.data_ptr(), 4, 4, 1, -1, 0), ValueError, "k must be in"),
        ((0, 4, 4, 1, 0, 0), ValueError, "null address"),
        ((user.data_ptr(), 4, 4, 1, 0, -1), ValueError, "spin_ns must be in"),
        ((user.data_ptr(), 4.0, 4, 1, 0, 0), TypeError, "nbytes must be an int"),
        ((user.data_ptr(), 4), TypeError, "takes 6 arguments"),
    ]:
        for fn in (c0.send, c0.recv):
            with pytest.raises(error, match=message):
                fn(*args)
    assert not words.any(), "a rejected call wrote to the segment"
    plain = core.SmallCore(words, 0, [0, 1], [2, 3], list(range(4, 12)), [0, 0, 0, 0], 64)
    with pytest.raises(ValueError, match="without mailboxes"):
        plain.send(user.data_ptr(), 4, 4, 1, 0, 0)
    with pytest.raises(TypeError, match="together or none"):
        core.SmallCore(words, 0, [0, 1], [2, 3], list(range(4, 12)), [0, 0, 0, 0], 64, [0] * 8)
    with pytest.raises(ValueError, match="mbox_bytes must be in"):
        core.SmallCore(words, 0, [0, 1], [2, 3], list(range(4, 12)), [0, 0, 0, 0], 64,
                       [0] * 8, [0] * 8, 64)
    with pytest.raises(ValueError, match="p2p_idx must be in"):  # its announcement: past the end
        core.SmallCore(words, 0, [0, 1], [2, 3], list(range(4, 12)), [0, 0, 0, 0], 64,
                       [len(words) - 1] * 8, [0] * 8, MBOX)
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        core.SmallCore(words, 0, [0, 1], [2, 3], list(range(4, 12)), [0, 0, 0, 0], 64,
                       [0] * 8, [4] * 8, MBOX)


# ------------------------------------------------------------------ checks (run on every rank)
def p2p_comm(name: str, compiled: bool, timeout: float = 30.0, **options) -> ShmCommunicator:
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    return ShmCommunicator(
        rank_store().prefixed(name, rank=rank), rank, int(os.environ["WORLD_SIZE"]), timeout,
        options=ShmOptions(slot_bytes=4096, mbox_bytes=MBOX, compiled=compiled, **options),
    )


class CountingCore:
    """A chunk call of the streams, counting its calls in ``calls[name]``."""

    def __init__(self, inner, name: str, calls: Counter) -> None:
        self.inner, self.name, self.calls = inner, name, calls

    def __call__(self, *args):
        self.calls[self.name] += 1
        return self.inner(*args)


def payload(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    """Random bits of ``dtype`` (any bytes: NaNs too, compared as bytes)."""
    gen = torch.Generator().manual_seed(seed)
    esize = torch.empty(0, dtype=dtype).element_size()
    return torch.randint(0, 256, (numel * esize,), dtype=torch.uint8, generator=gen).view(dtype)


def message_sizes(dtype: torch.dtype) -> list[int]:
    """Element counts: none, one, exactly one chunk, one chunk + 1 element, three chunks + 5."""
    esize = torch.empty(0, dtype=dtype).element_size()
    return [0, 1, ROOM // esize, ROOM // esize + 1, 3 * ROOM // esize + 5]


def echo(comm, message: torch.Tensor, got: torch.Tensor, peer: int) -> None:
    """Rank 0 sends ``message`` and receives it back into ``got``; rank 1 receives into ``got``
    and sends that back."""
    if comm.rank == 0:
        comm.send(message, peer)
        comm.recv(got, peer)
    else:
        comm.recv(got, peer)
        comm.send(got, peer)


def check_messages(name: str, sides: tuple[bool, bool]):
    """Rank 0 sends every message to rank 1, rank 1 echoes it back; both compare bytes."""
    rank = int(os.environ["RANK"])
    comm = p2p_comm(name, compiled=sides[rank])
    sched = comm._schedules
    streams = sched.streams
    if sched.compiled is not None:  # count the chunk calls (each one call of the core)
        streams.send_chunk = CountingCore(streams.send_chunk, "send", calls := Counter())
        streams.recv_chunk = CountingCore(streams.recv_chunk, "recv", calls)
    peer, chunks, seed = 1 - rank, 0, 0
    for dtype in SUPPORTED_DTYPES:
        for numel in message_sizes(dtype):
            seed += 1
            expected = payload(dtype, numel, seed)
            got = torch.full_like(expected.view(torch.uint8), 0xA5).view(dtype)
            echo(comm, expected, got, peer)
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), (dtype, numel)
            chunks += max(1, -(-expected.nbytes // ROOM))
    shaped = payload(torch.float32, 12, 99).view(3, 4)  # any shape goes as its bytes
    scalar = torch.tensor(7, dtype=torch.int64)  # a 0-dim tensor: one element
    for t in (shaped, scalar):
        got = torch.zeros_like(t)
        echo(comm, t, got, peer)
        assert torch.equal(got, t)
    assert comm._p2p == {}, "a synchronous send/recv started an executor"
    assert streams.sent[peer] == streams.received[peer] == chunks + 2
    calls = dict(calls) if sched.compiled is not None else None
    comm.close()
    return chunks + 2, calls


def check_async_in_issue_order(name: str, compiled: bool):
    """Asynchronous sends and receives on the peers' executors, then synchronous ones behind
    them: every message lands in issue order."""
    rank = int(os.environ["RANK"])
    comm = p2p_comm(name, compiled=compiled)
    msgs = [torch.full((n,), float(i)) for i, n in enumerate([3, ROOM // 4, ROOM // 4 + 1, 2])]
    if rank == 0:
        works = [comm.send(m, 1, async_op=True) for m in msgs[:3]]
        comm.send(msgs[3], 1)  # behind the pending ones, or inline once they are done
        for work in works:
            work.wait(timeout=30)
        got = []
    else:
        got = [torch.empty_like(m) for m in msgs]
        works = [comm.recv(g, 0, async_op=True) for g in got[:2]]
        comm.recv(got[2], 0)
        for work in works:
            work.wait(timeout=30)
        work = comm.recv(got[3], 0, async_op=True)
        work.wait(timeout=30)
        for g, m in zip(got, msgs, strict=True):
            assert torch.equal(g, m)
    executors = sorted(comm._p2p)
    comm.close()
    return executors


def check_size_mismatch(name: str, compiled: bool):
    """Rank 1 expects 12 bytes where rank 0 sends 10: rank 1 raises naming both."""
    rank = int(os.environ["RANK"])
    comm = p2p_comm(name, compiled=compiled)
    try:
        if rank == 0:
            comm.send(torch.zeros(10, dtype=torch.uint8), 1)
            return None
        with pytest.raises(FastcommError) as info:
            comm.recv(torch.zeros(3, dtype=torch.float32), 0)
        with pytest.raises(CommAbortedError):  # the communicator failed: it refuses the next
            comm.recv(torch.zeros(10, dtype=torch.uint8), 0)
        return str(info.value)
    finally:
        comm.close()


def check_peer_never_arrives(name: str, compiled: bool, op: str):
    """Rank 1's recv (or its third send, both slots full) waits on rank 0, which stays open
    and does nothing: a CommTimeoutError within the timeout, naming rank 0 and the op."""
    rank = int(os.environ["RANK"])
    timeout = 1.0
    comm = p2p_comm(name, compiled=compiled, timeout=timeout)
    store = rank_store().prefixed(name, rank=rank)
    try:
        if rank == 0:
            store.wait(["rank1-done"], 30)
            return None
        start = time.monotonic()
        with pytest.raises(CommTimeoutError) as info:
            if op == "recv":
                comm.recv(torch.zeros(4), 0)
            else:
                for _ in range(3):  # two fill the mailbox slots, the third waits for a slot
                    comm.send(torch.zeros(4), 0)
        elapsed = time.monotonic() - start
        store.set("rank1-done", "1")
        assert timeout <= elapsed < timeout + 2.0, elapsed
        return str(info.value)
    finally:
        comm.close()


def check_peer_gone_while_waiting(name: str, compiled: bool, how: str):
    """Rank 1 waits in recv from rank 0, which closes its communicator or aborts (a recv of
    the wrong size) meanwhile: rank 1 raises CommAbortedError long before its timeout."""
    rank = int(os.environ["RANK"])
    # no spin, no yield: rank 1 sleeps at once, announcing itself (the word after its acked
    # counter), and rank 0 acts once it has (not after a fixed sleep, which a busy machine
    # could make end before rank 1 waits)
    comm = p2p_comm(name, compiled=compiled, timeout=60.0, spin_us=0.0, yield_us=0.0)
    try:
        if rank == 0:
            words = comm._flags.words
            announce = comm._seg.layout.acked(1, 0) // 8 + 1
            deadline = time.monotonic() + 30
            while words[announce] != 1:
                assert time.monotonic() < deadline, "rank 0: rank 1 never slept in its recv"
                time.sleep(0.001)
            if how == "close":
                comm.close()
            else:
                with pytest.raises(FastcommError, match="expected 8 bytes but rank 1 sent 4"):
                    comm.recv(torch.zeros(8, dtype=torch.uint8), 1)
            return None
        if how == "abort":
            comm.send(torch.zeros(4, dtype=torch.uint8), 0)  # fits a slot: returns at once
        start = time.monotonic()
        with pytest.raises(CommAbortedError) as info:
            comm.recv(torch.zeros(4), 0)
        assert time.monotonic() - start < 30.0  # not the 60 s timeout
        return str(info.value)
    finally:
        comm.close()


def check_sleeper_announces_itself(name: str, compiled: bool):
    """A receiver with no spin and no yield sleeps at once, announcing itself in the word after
    its acked counter; the sender sees the announcement, sends, and the receiver clears it."""
    rank = int(os.environ["RANK"])
    comm = p2p_comm(name, compiled=compiled, spin_us=0.0, yield_us=0.0)
    layout, words = comm._seg.layout, comm._flags.words
    announce = layout.acked(1, 0) // 8 + 1
    try:
        if rank == 0:
            deadline = time.monotonic() + 20
            while words[announce] != 1:
                assert time.monotonic() < deadline, "rank 1 never announced that it sleeps"
                time.sleep(0.001)
            comm.send(torch.arange(5.0), 1)
            return None
        got = torch.zeros(5)
        comm.recv(got, 0)
        assert torch.equal(got, torch.arange(5.0)) and words[announce] == 0
        return None
    finally:
        comm.close()


# ------------------------------------------------------------------ pytest side
pool = pool_fixture(2, env={"CUDA_VISIBLE_DEVICES": ""}, timeout=90)


@pytest.mark.parametrize("sides", list(SIDES), ids=str)
def test_every_dtype_and_size_both_ways(pool, unique_name, sides):
    compiled = SIDES[sides]
    results = pool.run(check_messages, unique_name, compiled)
    chunks = results[0][0]
    for rank, (_, calls) in enumerate(results):
        if compiled[rank] and core is not None:  # every chunk went through the core
            assert calls["send"] >= chunks and calls["recv"] >= chunks, calls
        else:
            assert calls is None


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_async_send_recv_keep_issue_order(pool, unique_name, compiled):
    executors = pool.run(check_async_in_issue_order, unique_name, compiled)
    assert executors == [[("send", 1)], [("recv", 0)]]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_size_mismatch_raises_on_the_receiver_naming_both(pool, unique_name, compiled):
    message = pool.run(check_size_mismatch, unique_name, compiled)[1]
    assert "recv from rank 0 expected 12 bytes but rank 0 sent 10" in message, message


@pytest.mark.parametrize("op", ["recv", "send"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_peer_that_never_arrives_times_out(pool, unique_name, compiled, op):
    message = pool.run(check_peer_never_arrives, unique_name, compiled, op)[1]
    assert f"rank 1: {op} timed out" in message and "rank(s) [0] never arrived" in message, (
        message
    )


@pytest.mark.parametrize("how", ["close", "abort"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_peer_gone_while_we_wait_aborts_the_wait(pool, unique_name, compiled, how):
    message = pool.run(check_peer_gone_while_waiting, unique_name, compiled, how)[1]
    why = "rank 0 closed the communicator" if how == "close" else "rank 0 aborted: recv failed"
    assert "rank 1: recv failed" in message and why in message, message


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_sleeping_receiver_announces_itself_and_is_woken(pool, unique_name, compiled):
    pool.run(check_sleeper_announces_itself, unique_name, compiled)
