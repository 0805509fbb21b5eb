"""`peer_signal`, the barrier of the kernel collectives, in Triton's interpreter on CPU.

In one process the flag areas are rows of a tensor and the peers' arrivals are pre-set, so
every branch of the protocol is checked exactly (arrived, ahead, missing, stopped, sticky
failure), for the kernel (through an address table) and its torch reference alike. Across
real processes each rank maps its peers' flag areas in POSIX shared memory and the kernel
spins on them while the peers run: data written before a barrier is seen after it, and a rank
that never arrives is reported by the others within the spin bound.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import STATE, RankPool, map_peer_files

from .helpers import HAS_TRITON

pytestmark = [
    pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
    pytest.mark.timeout(300),
]

N = 3


@pytest.fixture
def kernels_triton(monkeypatch):
    monkeypatch.setenv("FASTCOMM_KERNELS", "triton")


def _flags(n_ranks: int = N, words: int = 8) -> torch.Tensor:
    return torch.zeros(n_ranks, words, dtype=torch.int64)


def _signal(impl: str, flags: torch.Tensor, rank: int, epoch: int, control, max_spins=50):
    from fastcomm.kernels import peer_signal, peer_signal_reference

    n_ranks, words = flags.shape
    if impl == "kernel":
        # workspaces of `words` int64 each; the flag area sits at the start of each
        table = torch.tensor([flags[r].data_ptr() for r in range(n_ranks)], dtype=torch.int64)
        peer_signal(table, flags_offset=0, rank=rank, epoch=epoch, control=control,
                    max_spins=max_spins)
    else:
        peer_signal_reference(list(flags), rank=rank, epoch=epoch, control=control,
                              max_spins=max_spins)


IMPLS = ["kernel", "reference"]


@pytest.mark.parametrize("impl", IMPLS)
def test_all_arrived_returns_and_announces_to_every_rank(kernels_triton, impl):
    flags = _flags()
    flags[1, 0] = 4  # rank 0 has announced 4 to rank 1 and rank 2 already
    flags[1, 2] = 4
    control = torch.zeros(3, dtype=torch.int64)
    _signal(impl, flags, rank=1, epoch=4, control=control)
    assert flags[:, 1].tolist() == [4, 4, 4]  # rank 1's word in every rank's area
    assert control.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_peer_already_at_the_next_barrier_counts_as_arrived(kernels_triton, impl):
    flags = _flags()
    flags[0, 1], flags[0, 2] = 7, 8
    control = torch.zeros(3, dtype=torch.int64)
    _signal(impl, flags, rank=0, epoch=7, control=control)
    assert control.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_missing_ranks_are_reported_after_the_spin_bound(kernels_triton, impl):
    from fastcomm.kernels import missing_ranks

    flags = _flags(5)
    flags[2, 0] = 3  # only rank 0 arrived at rank 2's barrier 3; ranks 1, 3, 4 are behind
    flags[2, 3] = 2
    control = torch.zeros(3, dtype=torch.int64)
    _signal(impl, flags, rank=2, epoch=3, control=control, max_spins=10)
    assert missing_ranks(int(control[1])) == [1, 3, 4]
    assert int(control[2]) == 3
    assert control[0] == 0
    assert flags[:, 2].tolist() == [3] * 5  # it did announce itself before waiting


@pytest.mark.parametrize("impl", IMPLS)
def test_zero_spins_still_sees_peers_that_arrived(kernels_triton, impl):
    flags = _flags(2)
    flags[0, 1] = 1
    control = torch.zeros(3, dtype=torch.int64)
    _signal(impl, flags, rank=0, epoch=1, control=control, max_spins=0)
    assert control.tolist() == [0, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("word", [0, 1], ids=["stop-requested", "earlier-failure"])
def test_stop_or_earlier_failure_returns_without_announcing(kernels_triton, impl, word):
    flags = _flags()
    control = torch.zeros(3, dtype=torch.int64)
    control[word] = 1 if word == 0 else 0b10
    before = control.clone()
    _signal(impl, flags, rank=0, epoch=1, control=control, max_spins=10**9)
    assert flags.count_nonzero() == 0
    assert torch.equal(control, before)  # the first failure's report is kept


def test_single_rank_barrier_passes(kernels_triton):
    flags = _flags(1)
    control = torch.zeros(3, dtype=torch.int64)
    _signal("kernel", flags, rank=0, epoch=1, control=control, max_spins=0)
    assert flags[0, 0] == 1 and control.tolist() == [0, 0, 0]


def test_bad_arguments_are_named():
    from fastcomm.kernels import peer_signal, peer_signal_reference

    table = torch.zeros(2, dtype=torch.int64)
    control = torch.zeros(3, dtype=torch.int64)
    kw = dict(flags_offset=0, rank=0, epoch=1, control=control, max_spins=1)
    with pytest.raises(ValueError, match="epoch must be >= 1"):
        peer_signal(table, **{**kw, "epoch": 0})
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        peer_signal(table, **{**kw, "rank": 2})
    with pytest.raises(ValueError, match="multiple of 8"):
        peer_signal(table, **{**kw, "flags_offset": 4})
    with pytest.raises(TypeError, match="base_table has dtype torch.int32"):
        peer_signal(table.int(), **kw)
    with pytest.raises(ValueError, match="needs 3"):
        peer_signal(table, **{**kw, "control": control[:2]})
    with pytest.raises(ValueError, match="max_spins must be >= 0"):
        peer_signal_reference([table, table], rank=0, epoch=1, control=control, max_spins=-1)


def test_no_torch_path_for_raw_addresses(monkeypatch):
    from fastcomm.kernels import peer_signal

    monkeypatch.setenv("FASTCOMM_KERNELS", "torch")
    with pytest.raises(RuntimeError, match="no torch path"):
        peer_signal(torch.zeros(2, dtype=torch.int64), flags_offset=0, rank=0, epoch=1,
                    control=torch.zeros(3, dtype=torch.int64), max_spins=1)


# ---------------------------------------------------------------------- across processes
AREA_BYTES = 4096  # flag area (first 8 * world bytes) + one data word per round at 1024


def _map_areas(name: str) -> None:
    """Maps every rank's flag area into this rank."""
    maps = map_peer_files(name, "signaltest", AREA_BYTES)
    words = [torch.frombuffer(m, dtype=torch.int64) for m in maps]
    table = torch.tensor([w.data_ptr() for w in words], dtype=torch.int64)
    STATE["signal"] = {"maps": maps, "words": words, "table": table, "epoch": 0,
                       "control": torch.zeros(3, dtype=torch.int64)}


def _unmap_areas() -> None:
    state = STATE.pop("signal", None)
    if state is not None:
        del state["words"], state["table"]
        for m in state["maps"]:
            m.close()


def _barrier(max_spins: int) -> None:
    from fastcomm.kernels import peer_signal

    state = STATE["signal"]
    state["epoch"] += 1
    peer_signal(state["table"], flags_offset=0, rank=int(os.environ["RANK"]),
                epoch=state["epoch"], control=state["control"], max_spins=max_spins)


def barriers_order_writes(rounds: int) -> list[list[int]]:
    """Each round every rank writes a value, meets the others, reads every peer's value."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    words = STATE["signal"]["words"]
    seen = []
    for i in range(rounds):
        words[rank][128] = 1000 * i + rank  # word 128 = byte 1024, past the flag area
        _barrier(10**9)
        seen.append([int(words[p][128]) for p in range(world)])
        _barrier(10**9)  # nobody overwrites its word while a peer may still read it
    assert STATE["signal"]["control"].tolist() == [0, 0, 0]
    return seen


def barrier_without(absent: int, max_spins: int) -> list[int]:
    """Every rank but `absent` enters one barrier; returns (mask, epoch) of the report."""
    from fastcomm.kernels import missing_ranks

    if int(os.environ["RANK"]) == absent:
        return []
    _barrier(max_spins)
    control = STATE["signal"]["control"]
    return [missing_ranks(int(control[1])), int(control[2])]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"world{n}")
def pool(request):
    with RankPool(request.param, env={"FASTCOMM_KERNELS": "triton"}, timeout=120) as p:
        p.run(_map_areas, f"w{request.param}-{os.getpid()}")
        yield p
        p.run(_unmap_areas)


def test_barrier_orders_writes_between_processes(pool):
    world = pool.world_size
    for seen in pool.run(barriers_order_writes, 3):
        assert seen == [[1000 * i + p for p in range(world)] for i in range(3)]


def test_rank_that_never_arrives_is_reported_by_the_others(pool):
    # last check on this pool: the barrier counts diverge from here
    results = pool.run(barrier_without, pool.world_size - 1, 200)
    for rank, result in enumerate(results[:-1]):
        assert result[0] == [pool.world_size - 1], f"rank {rank}: {result}"
    epochs = {r[1] for r in results[:-1]}
    assert len(epochs) == 1


# ---------------------------------------------------------------------- compiled for sm_90
# The interpreter ignores memory-ordering semantics and accepts code the compiler may reject,
# so the kernels are also compiled to PTX for an sm_90 GPU (Triton bundles ptxas), in a
# subprocess: a process whose triton was imported in interpreter mode cannot compile.
_PROBE = r"""
import inspect, os, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastcomm.kernels import _peer_reduce, _peer_signal

def compile_ptx(kernel, types, constexprs, num_warps):
    names = list(inspect.signature(kernel.fn).parameters)
    src = ASTSource(
        fn=kernel,
        signature={n: "constexpr" if n in constexprs else types[n] for n in names},
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
    )
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

out = sys.argv[1]
types = dict(base_table="*i64", flags_offset="i32", control_addr="i64", rank="i32",
             epoch="i64", max_spins="i64")
for n in (2, 5):
    ptx = compile_ptx(_peer_signal._peer_signal_kernel, types,
                      dict(N_RANKS=n, BLOCK_R=triton.next_power_of_2(n), STOP_EVERY=64), 1)
    open(os.path.join(out, f"signal-{n}.ptx"), "w").write(ptx)
types = dict(src_table="*i64", dst_table="*i64", src_offset="i64", dst_offset="i64",
             numel="i32", scale="fp32")
for name in ("float32", "float16", "bfloat16"):
    dtype = getattr(tl, name)
    ptx = compile_ptx(_peer_reduce._peer_reduce_kernel, types,
                      dict(N_SRC=2, N_DST=2, DTYPE=dtype, COMPUTE=tl.float32, OP=0,
                           APPLY_SCALE=True, BLOCK=_peer_reduce.BLOCK), 4)
    open(os.path.join(out, f"reduce-{name}.ptx"), "w").write(ptx)
"""


@pytest.fixture(scope="module")
def ptx(tmp_path_factory):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path_factory.mktemp("signal-ptx")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, "-c", _PROBE, str(out)], env=env,
                         capture_output=True, text=True, timeout=300)
    if run.returncode and "ptxas" in run.stderr:  # pragma: no cover - no CUDA backend
        pytest.skip(f"cannot compile for CUDA here: {run.stderr[-500:]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return {p.stem: p.read_text() for p in out.glob("*.ptx")}


@pytest.mark.parametrize("n_ranks", [2, 5])
def test_signal_compiles_with_system_scope_release_and_acquire(ptx, n_ranks):
    import re

    text = ptx[f"signal-{n_ranks}"]
    # the announcement publishes the data written before it to other processes and GPUs
    assert re.search(r"atom\.global\.sys\.release\.exch\.b64", text), text[-2000:]
    # the wait orders the reads after it (the next kernels) after the peers' announcements
    assert re.search(r"atom\.global\.sys\.acquire\.add\.u64", text)
    # the host's stop word is re-read from memory, never cached in a register
    assert len(re.findall(r"ld\.volatile\.global\.b64", text)) >= 3


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_reduce_with_offsets_compiles(ptx, dtype_name):
    assert "ld.global" in ptx[f"reduce-{dtype_name}"]
