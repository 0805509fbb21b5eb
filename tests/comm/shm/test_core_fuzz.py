"""Hostile input: the compiled core's Python API under hypothesis, in a child process.

The child drives every entry point of ``_core`` (``reduce``, ``SmallCore(...)`` with and without
its mailboxes, each of its collectives and its ``send``/``recv``, an uninitialised and a
re-initialised ``SmallCore``) with random kinds, ops, counts, slot and mailbox sizes, world
sizes, term counts, stages, halves, roots, chunk numbers and peer states, and with invalid
values in any one argument (out of range as the C type, past 32 or 64 bits, not an int, a null
address, a wrong argument count). Addresses always point to real buffers of the bytes the call
names (the core's contract, ``_core.c``), except where a call names 0 bytes: then any address
goes. A valid call must return a status, an invalid one raise ``ValueError`` or ``TypeError``;
a signal (SIGSEGV, SIGFPE, SIGBUS) kills only the child, and the test reports it with the last
call the child made. The child loads the extension by its path, without torch, so the whole
test takes a few seconds for more than 10,000 calls.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest

MIN_CALLS = 10_000
SPECS_PER_EXAMPLE = 2  # SmallCore calls drawn per example, each run in 24 peer states
REDUCES_PER_EXAMPLE = 4
MAX_EXAMPLES = 240


def test_fuzzed_core_calls_never_crash():
    from fastcomm.comm.shm.core import BUILT  # here: the child imports neither fastcomm nor torch

    if not BUILT:
        pytest.skip("the compiled core was not built (no C compiler at install)")
    pytest.importorskip("hypothesis")  # the test extra
    from fastcomm.comm.shm import _core

    with tempfile.NamedTemporaryFile("w+b", suffix=".fuzzlog") as log:
        child = subprocess.run(
            [sys.executable, __file__, _core.__file__, log.name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        last_call = open(log.name, "rb").read().rstrip(b"\0 ").decode("utf-8", "replace")
    if child.returncode < 0:
        name = signal.Signals(-child.returncode).name
        pytest.fail(f"the core died of {name} at its call:\n{last_call}\n{child.stderr[-3000:]}")
    assert child.returncode == 0, f"{child.stdout[-2000:]}\n{child.stderr[-3000:]}"
    calls = int(child.stdout.split("calls=")[-1].split()[0])
    assert calls >= MIN_CALLS, child.stdout


# ---------------------------------------------------------------------------- the child side
def _child(core_path: str, log_path: str) -> None:  # noqa: C901 - one generator per entry point
    import faulthandler
    import importlib.util
    import itertools

    import numpy as np
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    faulthandler.enable()
    spec = importlib.util.spec_from_file_location("fastcomm.comm.shm._core", core_path)
    core = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core)
    log = os.open(log_path, os.O_WRONLY)
    calls = [0]
    kind_size = {core.KIND_F32: 4, core.KIND_F64: 8, core.KIND_I8: 1, core.KIND_U8: 1,
                 core.KIND_I32: 4, core.KIND_I64: 8}
    # buffers the addresses point into: every call's bytes fit (8 ranks x 4 KiB slots)
    user_bytes = 8 * 4096 + 64
    buffers = [np.zeros(user_bytes // 8, dtype=np.int64) for _ in range(4)]
    for i, buf in enumerate(buffers):
        buf.view(np.uint8)[:] = np.random.default_rng(i).integers(0, 256, user_bytes,
                                                                  dtype=np.uint8)
    addresses = [buf.ctypes.data for buf in buffers]

    def call(fn, *args, valid: bool) -> None:
        shown = [f"[{a[0]}, ... ({len(a)} addresses)]" if isinstance(a, list) and len(a) > 4
                 else repr(a) for a in args]
        record = f"{getattr(fn, '__qualname__', fn)}({', '.join(shown)}) valid={valid}".encode()
        os.pwrite(log, record[:8191].ljust(8192, b"\0"), 0)
        calls[0] += 1
        try:
            result = fn(*args)
        except (ValueError, TypeError) as exc:
            if valid:
                raise AssertionError(f"a valid call raised {exc!r}: {record!r}") from exc
            return
        if not valid:
            raise AssertionError(f"an invalid call returned {result!r}: {record!r}")
        if fn is not core.reduce and result not in range(7):
            raise AssertionError(f"status {result!r}: {record!r}")

    def bad_int(lo: int, hi: int):
        """Values a [lo, hi] argument must refuse, as the C type it becomes."""
        values = [lo - 1, hi + 1, 2**32 + lo, 2**64 + lo, -(2**63), 2**100, -(2**100)]
        values = [v for v in values if not lo <= v <= hi]  # 2**32 is a valid spin, say
        return st.sampled_from([*values, 1.0, None, "0"])

    bad_u64 = st.sampled_from([-1, 2**64, 2**65 + 3, -(2**100), 0.0, None, b"1"])

    def address(draw, nbytes: int):
        if nbytes == 0 and draw(st.booleans()):
            return draw(st.sampled_from([0, 0xDEAD0000, 2**64 - 1]))  # 0 bytes: any address
        return draw(st.sampled_from(addresses))

    @st.composite
    def core_call(draw, size: int, slot_bytes: int):
        """A SmallCore method and its arguments (stage and half filled in by the caller), the
        descriptor B the core will store, and whether the arguments are valid."""
        what = draw(st.sampled_from(["all_reduce", "broadcast", "all_gather", "reduce_scatter",
                                     "all_to_all", "barrier"]))
        kind = draw(st.sampled_from(sorted(kind_size)))
        esize = kind_size[kind]
        op = draw(st.integers(0, 2))
        root = draw(st.integers(-1, size - 1))
        src = draw(st.integers(0, size - 1))
        if what == "all_reduce":
            limit = slot_bytes // esize
        elif what == "reduce_scatter":
            limit = slot_bytes // esize // size
        elif what == "all_to_all":
            limit = slot_bytes // size
        else:
            limit = slot_bytes
        count = draw(st.integers(0, limit) | st.sampled_from([0, limit]))
        nbytes = {"all_reduce": count * esize, "reduce_scatter": count * esize}.get(what, count)
        out_bytes = {"all_gather": nbytes * size, "all_to_all": nbytes * size,
                     "reduce_scatter": nbytes}.get(what, nbytes)
        in_bytes = {"reduce_scatter": nbytes * size, "all_to_all": nbytes * size}.get(
            what, nbytes)
        out, flat = address(draw, out_bytes), address(draw, in_bytes)
        code_a = draw(st.integers(0, 2**64 - 1))
        enter, target = draw(st.integers(0, 3)), draw(st.integers(0, 2**64 - 1))
        spin = draw(st.sampled_from([0, 0, 0, 1000]))
        head = {
            "all_reduce": [out, count, kind, op, root],
            "broadcast": [out, count, src],
            "all_gather": [out, flat, count],
            "reduce_scatter": [out, flat, count, kind, op],
            "all_to_all": [out, flat, count],
            "barrier": [],
        }[what]
        bounds = {  # per argument: (lo, hi) as the C type checks it, or "u64"
            "all_reduce": ["u64", (0, limit), (0, 5), (0, 2), (-1, size - 1)],
            "broadcast": ["u64", (0, limit), (0, size - 1)],
            "all_gather": ["u64", "u64", (0, limit)],
            "reduce_scatter": ["u64", "u64", (0, limit), (0, 5), (0, 2)],
            "all_to_all": ["u64", "u64", (0, limit)],
            "barrier": [],
        }[what] + ["u64", (0, 1), "u64", "u64", (0, 2), (0, core.MAX_SPIN_NS)]
        args, valid, keep = head + [code_a, 0, enter, target, 0, spin], True, ()
        mode = draw(st.sampled_from(["valid"] * 6 + ["bad value", "bad count", "null"]))
        if mode == "bad value":
            i = draw(st.integers(0, len(args) - 1))
            args[i] = draw(bad_u64 if bounds[i] == "u64" else bad_int(*bounds[i]))
            valid, keep = False, (i - len(args),)
        elif mode == "bad count":
            if draw(st.booleans()) or not head:
                args.append(0)
            else:
                args.pop(0)
            valid = False
        elif mode == "null" and head and max(out_bytes, in_bytes) > 0:
            args[0 if out_bytes > 0 else 1] = 0
            valid = False
        code_b = {"all_reduce": root + 1, "broadcast": src + 1}.get(what, 0)
        return what, args, code_b, valid, keep

    @st.composite
    def p2p_call(draw, size: int, rank: int, mbox_bytes: int):
        """A send or recv and its arguments, the header the peer's chunk will hold, and
        whether the arguments are valid."""
        what = draw(st.sampled_from(["send", "recv"]))
        room = mbox_bytes - 64
        nbytes = draw(st.integers(0, room) | st.sampled_from([0, room]))
        total = draw(st.sampled_from([nbytes, 0, 2**63 - 1]) | st.integers(0, 2**63 - 1))
        peers = [p for p in range(size) if p != rank]
        peer = draw(st.sampled_from(peers)) if peers else 0
        k = draw(st.sampled_from([0, 1, 2, 3, 2**64 - 1]) | st.integers(0, 2**64 - 1))
        spin = draw(st.sampled_from([0, 0, 0, 1000]))
        args = [address(draw, nbytes), nbytes, total, peer, k, spin]
        valid = bool(peers)
        bounds = ["u64", (0, room), (0, 2**63 - 1), (0, size - 1), "u64", (0, core.MAX_SPIN_NS)]
        mode = draw(st.sampled_from(["valid"] * 6 + ["bad value", "bad count", "null", "self"]))
        if mode == "bad value":
            i = draw(st.integers(0, len(args) - 1))
            args[i] = draw(bad_u64 if bounds[i] == "u64" else bad_int(*bounds[i]))
            valid = False
        elif mode == "bad count":
            args = args + [0] if draw(st.booleans()) else args[1:]
            valid = False
        elif mode == "null" and nbytes > 0:
            args[0], valid = 0, False
        elif mode == "self":
            args[3], valid = rank, False
        return what, args, total, valid

    @settings(max_examples=MAX_EXAMPLES // 2, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data(), size=st.integers(1, 8), mbox_bytes=st.sampled_from([72, 128, 4096]))
    def fuzz_p2p(data, size, mbox_bytes):
        # a segment: per rank 8 control words (seq, waiting_on, descriptors 2 .. 5), then
        # 4 x 2 counter words (each counter, then its announcement) per peer; then one 8-byte
        # slot per half and rank, then 4 mailboxes per rank
        rank = data.draw(st.integers(0, size - 1))
        counters = 8 * size
        nwords = 8 * size + 8 * size + 2 * size + 4 * size * mbox_bytes // 8
        words = np.zeros(nwords, dtype=np.int64).view(np.uint64)
        slots = [8 * (16 * size + i) for i in range(2 * size)]
        boxes = [8 * (18 * size) + i * mbox_bytes for i in range(4 * size)]
        p2p_idx = [counters + 2 * i for i in range(4 * size)]
        layout = [[8 * p for p in range(size)], [8 * p + 1 for p in range(size)],
                  [8 * p + j for p in range(size) for j in (2, 3, 4, 5)], slots, 8]
        if rank == 0 or data.draw(st.booleans()):  # no mailboxes: send and recv refuse
            bare_p2p = core.SmallCore(words, rank, *layout)
            call(bare_p2p.send, addresses[0], 0, 0, (rank + 1) % size, 0, 0, valid=False)
        extra = [p2p_idx, boxes, mbox_bytes]
        small = core.SmallCore(words, rank, *layout, *extra)
        i = data.draw(st.integers(0, 3))
        bad_extra = list(extra)
        if i == 3:  # two of the three
            bad_extra = bad_extra[:2]
        elif i == 2:
            bad_extra[2] = data.draw(st.sampled_from([64, 0, nwords * 8 + 1, -1, 2**64, 1.5]))
        else:
            n = len(extra[i])
            past = nwords - 1 if i == 0 else nwords * 8 - mbox_bytes + 1
            bad_extra[i] = data.draw(st.sampled_from(
                [[past] * n, [-1] * n, extra[i][:-1], [2**70] * n, [1.5] * n, None, [4] * n]
                if i == 1 else [[past] * n, [-1] * n, extra[i][:-1], [2**70] * n, None]))
        call(core.SmallCore, words, rank, *layout, *bad_extra, valid=False)
        bare = core.SmallCore.__new__(core.SmallCore)
        call(bare.recv, addresses[0], 0, 0, 0, 0, 0, valid=False)
        for _ in range(SPECS_PER_EXAMPLE):
            what, args, total, valid = data.draw(p2p_call(size, rank, mbox_bytes))
            fn = getattr(small, what)
            peer = args[3] if len(args) == 6 and isinstance(args[3], int) else 0
            for arrived, same in itertools.product((0, 1), (0, 1)):
                for r in range(size):  # every counter reached or not
                    for j in range(4):
                        words[counters + 8 * r + 2 * j] = 2**63 if arrived else 0
                if 0 <= peer < size:  # the peer's chunks hold this call's total or not
                    for j in (2, 3):
                        words[boxes[4 * peer + j] // 8] = total if same else total ^ 1
                call(fn, *args, valid=valid)

    @st.composite
    def reduce_call(draw):
        kind = draw(st.sampled_from(sorted(kind_size)))
        esize = kind_size[kind]
        op = draw(st.integers(0, 2))
        nterms = draw(st.sampled_from([1, 2, 3, 5, 8, 127, 128, 255, 256, 257, 300]))
        numel = draw(st.integers(0, 64 if nterms > 8 else 4097) | st.sampled_from([0, 1]))
        nbytes = numel * esize
        out = address(draw, nbytes)
        terms = [address(draw, nbytes) for _ in range(min(nterms, 8))]
        terms = (terms * (nterms // len(terms) + 1))[:nterms]
        scale_ok = op == 0 and kind in (core.KIND_F32, core.KIND_F64)
        scale = draw(st.sampled_from([1.0, 0.5, 1 / 3, -7.0, 1e300, float("inf"), float("nan")])
                     if scale_ok else st.just(1.0))
        args, valid = [out, terms, numel, kind, op, scale], True
        mode = draw(st.sampled_from(["valid"] * 5 + ["kind", "op", "numel", "terms", "scale"]))
        if mode == "kind":
            args[3], valid = draw(bad_int(0, 5)), False
        elif mode == "op":
            args[4], valid = draw(bad_int(0, 2)), False
        elif mode == "numel":
            args[2], valid = draw(st.sampled_from([-1, 2**62, 2**64, 1.5, None])), False
        elif mode == "terms":
            args[1] = draw(st.sampled_from([[], [-1], [None], ["x"], 5, [0] * 4097,
                                            [2**64] + terms]))
            valid = False
        elif mode == "scale" and not scale_ok:
            args[5], valid = 0.5, False
        return args, valid

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data(), size=st.integers(1, 8), slot_bytes=st.sampled_from([8, 100, 4096]))
    def fuzz(data, size, slot_bytes):
        # a segment: 8 control words per rank (seq, waiting_on, descriptors at 8p + 2 .. 5),
        # then 2 x size slots
        nwords = 8 * size + 2 * size * ((slot_bytes + 7) // 8)
        words = np.zeros(nwords, dtype=np.int64).view(np.uint64)
        stride = (slot_bytes + 7) // 8 * 8
        slots = [8 * 8 * size + i * stride for i in range(2 * size)]
        rank = data.draw(st.integers(0, size - 1))
        layout = [[8 * p for p in range(size)], [8 * p + 1 for p in range(size)],
                  [8 * p + j for p in range(size) for j in (2, 3, 4, 5)], slots, slot_bytes]
        small = core.SmallCore(words, rank, *layout)
        call(small.__init__, words, rank, *layout, valid=False)  # re-initialised: refused
        bad_layout = list(layout)
        i = data.draw(st.integers(0, 4))
        n = len(layout[i]) if i < 4 else 0
        past = nwords * 8 if i == 3 else nwords  # a slot offset in bytes, an index in words
        bad_layout[i] = data.draw(st.sampled_from(
            [0, -1, 2**64, nwords * 8 + 1] if i == 4
            else [[past] * n, [-1] * n, layout[i][:-1], [2**70] * n, [1.5] * n, None]))
        call(core.SmallCore, words, rank, *bad_layout, valid=False)
        bare = core.SmallCore.__new__(core.SmallCore)
        call(bare.barrier, 0, 0, 0, 1, 0, 0, valid=False)
        for _ in range(REDUCES_PER_EXAMPLE):
            args, valid = data.draw(reduce_call())
            call(core.reduce, *args, valid=valid)
        for _ in range(SPECS_PER_EXAMPLE):
            what, args, code_b, valid, keep = data.draw(core_call(size, slot_bytes))
            fn, n = getattr(small, what), len(args)
            # every stage and half, the peers there or not, their descriptors this call's or not
            for stage, half, arrived, same in itertools.product(range(3), range(2), *[(0, 1)] * 2):
                if n >= 6 and -5 not in keep:  # not where a bad value was put, nor past the end
                    args[n - 5] = half
                if n >= 6 and -2 not in keep:
                    args[n - 2] = stage
                half = args[n - 5] if n >= 6 and args[n - 5] in (0, 1) else 0
                for p in range(size):
                    words[8 * p] = 2**63 if arrived else 0
                    words[8 * p + 2 + half] = args[n - 6] if same and valid else p
                    words[8 * p + 4 + half] = code_b if same else 7
                call(fn, *args, valid=valid)

    # and, whatever the draws, the edges of every kind's term count (256 int8 terms divided by
    # 256 cast to int8, 0, was SIGFPE)
    for kind, op, nterms, numel in itertools.product(
        sorted(kind_size), range(3), [1, 2, 127, 128, 255, 256, 257, 300], [1, 33]
    ):
        terms = (addresses[1:] * nterms)[:nterms]
        call(core.reduce, addresses[0], terms, numel, kind, op, 1.0, valid=True)
    fuzz()
    fuzz_p2p()
    print(f"calls={calls[0]}")


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
