"""Host microseconds per call: fastcomm beside torch, for the calls a DDP makes every step.

What is measured is the host's work around the bytes (argument checks, planning, ``Work``
objects, launches), so the payloads are small and the collectives run at world size 1 (no
peer to wait for: the time is the host path alone). Cases:

- ``pack`` / ``unpack`` of 1, 16, 128, 500 and 6000 small tensors (the parameters of
  ``Linear(16, 16)`` layers: ``(16, 16)`` weights and ``(16,)`` biases), fp32. Providers:
  ``fastcomm-plan`` (`fastcomm.kernels.PackPlan`, planned once per bucket as a DDP holds it),
  ``fastcomm`` (`fastcomm.kernels.pack`/``unpack``, unplanned), ``torch-foreach``
  (``torch._foreach_copy_`` into views made once, what torch DDP does) and ``torch-cat``
  (``torch.cat`` of flattened tensors, pack only). ``pack+average`` folds a 1/4 scale in,
  against torch DDP's ``_foreach_copy_`` then ``div_``.
- ``all_reduce`` of 4 KiB fp32 on CPU: ``fastcomm-shm`` (its compiled core),
  ``fastcomm-shm-python`` (``ShmOptions(compiled=False)``), ``fastcomm-gloo`` and ``torch-gloo``
  (``dist.all_reduce``), synchronous and ``async_op=True`` + ``wait()``.
- ``work``: a finished ``Work`` waited on (``fastcomm``) against a resolved
  ``torch.futures.Future`` (``torch-future``): the per-collective bookkeeping.
- ``quantize`` of 4 KiB fp32 to int8 codes with block scales: ``fastcomm`` against the same
  arithmetic in plain torch operations (``torch-ops``).
- On CUDA (marked ``gpu``): pack of the same buckets (``fastcomm-plan``, ``fastcomm``
  (Triton), ``torch-foreach``) and ``all_reduce`` of 4 KiB over NCCL (``fastcomm-nccl``
  against ``torch-nccl``); each timed call issues `CUDA_CALLS` operations and synchronizes
  once, so the figure is host-bound time per operation.

Every case runs with one torch thread. A table of medians per call, with each fastcomm
provider's ratio to the torch provider of the same case, is printed at the end of the module.
Quick mode (``--benchmark-disable``, as CI runs it) calls every case once: seconds in all.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch
import torch.distributed as dist

from fastcomm import kernels

QUICK = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or "--benchmark-disable" in sys.argv
HAS_CUDA = torch.cuda.is_available()
COUNTS = [1, 16, 128, 500, 6000]
CUDA_CALLS = 20
needs_cuda = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

_ROWS: list[dict] = []  # {case, provider, us}: the table printed at the end


def _shapes(count: int) -> list[tuple[int, ...]]:
    """`count` parameters of Linear(16, 16) layers: weight, bias, weight, ..."""
    return [(16, 16) if i % 2 == 0 else (16,) for i in range(count)]


class Bucket:
    """One bucket's tensors, its flat buffer and what each provider plans once."""

    def __init__(self, count: int, device: str) -> None:
        g = torch.Generator().manual_seed(count)
        self.tensors = [torch.randn(s, generator=g).to(device) for s in _shapes(count)]
        self.flat = torch.empty(sum(t.numel() for t in self.tensors), device=device)
        self.views = [
            part.view(t.shape)
            for part, t in zip(self.flat.split([t.numel() for t in self.tensors]), self.tensors,
                               strict=True)
        ]
        self.plan = kernels.PackPlan(self.tensors)

    def pack(self, provider: str):
        tensors, flat, views, plan = self.tensors, self.flat, self.views, self.plan
        return {
            "fastcomm-plan": lambda: plan.pack(tensors, flat),
            "fastcomm": lambda: kernels.pack(tensors, flat),
            "torch-foreach": lambda: torch._foreach_copy_(views, tensors),
            "torch-cat": lambda: torch.cat([t.view(-1) for t in tensors], out=flat),
        }[provider]

    def unpack(self, provider: str):
        tensors, flat, views, plan = self.tensors, self.flat, self.views, self.plan
        return {
            "fastcomm-plan": lambda: plan.unpack(flat, tensors),
            "fastcomm": lambda: kernels.unpack(flat, tensors),
            "torch-foreach": lambda: torch._foreach_copy_(tensors, views),
        }[provider]


@pytest.fixture(scope="module")
def buckets():
    made: dict[tuple[int, str], Bucket] = {}

    def get(count: int, device: str = "cpu") -> Bucket:
        if (count, device) not in made:
            made[(count, device)] = Bucket(count, device)
        return made[(count, device)]

    return get


@pytest.fixture(scope="module", autouse=True)
def host_table(request):
    """One torch thread (host cost, not intra-op parallelism, is measured; a multi-threaded
    ``cat`` of hundreds of tiny inputs only adds thread hand-offs), and the table at the end."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    rows = [r for r in _ROWS if r["us"] is not None]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if not rows or reporter is None:
        return
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        _write_table(reporter, rows)


def _write_table(reporter, rows: list[dict]) -> None:
    reporter.write_line("")
    reporter.write_line("host microseconds per call (median), ratio to the torch provider")
    torch_us = {r["case"]: r["us"] for r in rows if r["provider"].startswith("torch")
                and r["provider"] != "torch-cat"}
    width = max(len(r["case"]) for r in rows)
    for r in rows:
        base = torch_us.get(r["case"])
        ratio = f"{r['us'] / base:6.2f}x" if base and not r["provider"].startswith("torch") else ""
        line = f"{r['case']:<{width}}  {r['provider']:<14} {r['us']:10.1f} us  {ratio}"
        reporter.write_line(line)


def _record(benchmark, case: str, provider: str, per_call: int = 1) -> None:
    stats = getattr(benchmark, "stats", None)
    us = stats.stats.median * 1e6 / per_call if stats is not None else None
    benchmark.extra_info.update(case=case, provider=provider)
    if us is not None:
        benchmark.extra_info["us_per_call"] = round(us, 2)
    _ROWS.append({"case": case, "provider": provider, "us": us})


# ---------------------------------------------------------------------- CPU: pack / unpack
@pytest.mark.parametrize("provider", ["fastcomm-plan", "fastcomm", "torch-foreach", "torch-cat"])
@pytest.mark.parametrize("count", COUNTS)
def test_pack(benchmark, buckets, count, provider):
    bucket = buckets(count)
    fn = bucket.pack(provider)
    fn()
    assert torch.equal(bucket.flat, torch.cat([t.reshape(-1) for t in bucket.tensors]))
    benchmark.group = f"pack-{count}"
    benchmark(fn)
    _record(benchmark, f"pack {count} tensors", provider)


@pytest.mark.parametrize("provider", ["fastcomm-plan", "fastcomm", "torch-foreach"])
@pytest.mark.parametrize("count", COUNTS)
def test_pack_average(benchmark, buckets, count, provider):
    """Pack with the 1/world averaging folded in (a DDP of 4 ranks), against torch DDP's
    ``_foreach_copy_`` then ``div_`` of the bucket."""
    bucket = buckets(count)
    tensors, flat, views, plan = bucket.tensors, bucket.flat, bucket.views, bucket.plan
    if provider == "fastcomm-plan":
        def fn():
            plan.pack(tensors, flat, scale=0.25)
    elif provider == "fastcomm":
        def fn():
            kernels.pack(tensors, flat, scale=0.25)
    else:
        def fn():
            torch._foreach_copy_(views, tensors)
            flat.div_(4)
    fn()
    assert torch.equal(bucket.flat, torch.cat([t.reshape(-1) for t in tensors]) / 4)
    benchmark.group = f"pack-average-{count}"
    benchmark(fn)
    _record(benchmark, f"pack+average {count}", provider)


@pytest.mark.parametrize("provider", ["fastcomm-plan", "fastcomm", "torch-foreach"])
@pytest.mark.parametrize("count", COUNTS)
def test_unpack(benchmark, buckets, count, provider):
    bucket = buckets(count)
    fn = bucket.unpack(provider)
    benchmark.group = f"unpack-{count}"
    benchmark(fn)
    _record(benchmark, f"unpack {count} tensors", provider)


# ---------------------------------------------------------------------- CPU: collectives
@pytest.fixture(scope="module")
def cpu_comms():
    """World-size-1 communicators: fastcomm shm and Gloo, torch's Gloo group."""
    from fastcomm.comm import GlooCommunicator, ShmCommunicator, ShmOptions, Store

    store = Store(is_server=True, timeout=60)
    comms = {
        "fastcomm-shm": ShmCommunicator(store.prefixed("host/shm", rank=0), 0, 1, 60),
        "fastcomm-shm-python": ShmCommunicator(
            store.prefixed("host/shm-python", rank=0), 0, 1, 60,
            options=ShmOptions(compiled=False),
        ),
        "fastcomm-gloo": GlooCommunicator(store.prefixed("host/gloo", rank=0), 0, 1, 60),
    }
    owner = not dist.is_initialized()
    if owner:
        torch_store = store.prefixed("host/torch", rank=0).torch_store
        dist.init_process_group("gloo", store=torch_store, rank=0, world_size=1)
    group = dist.new_group([0], backend="gloo")
    comms["torch-gloo"] = _TorchGroup(group)
    yield comms
    for name in ("fastcomm-shm", "fastcomm-shm-python", "fastcomm-gloo"):
        comms[name].close()
    if owner:
        dist.destroy_process_group()


class _TorchGroup:
    """``dist.all_reduce`` on one group, called like a fastcomm communicator."""

    def __init__(self, group) -> None:
        self.group = group

    def all_reduce(self, tensor, async_op=False):
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    "provider", ["fastcomm-shm", "fastcomm-shm-python", "fastcomm-gloo", "torch-gloo"]
)
def test_all_reduce_4k(benchmark, cpu_comms, provider, mode):
    comm = cpu_comms[provider]
    x = torch.ones(1024)
    if mode == "sync":
        def fn():
            comm.all_reduce(x)
    else:
        def fn():
            comm.all_reduce(x, async_op=True).wait()
    fn()
    assert torch.equal(x, torch.ones(1024))  # world size 1: the sum is the input
    benchmark.group = f"all_reduce-4k-{mode}"
    benchmark(fn)
    _record(benchmark, f"all_reduce 4 KiB {mode} (CPU)", provider)


# ---------------------------------------------------------------------- CPU: Work, quantize
@pytest.mark.parametrize("provider", ["fastcomm", "torch-future"])
def test_work(benchmark, provider):
    from fastcomm.comm.work import completed_work

    out = torch.ones(1)
    if provider == "fastcomm":
        def fn():
            completed_work("all_reduce", 0, out).wait()
    else:
        def fn():
            future = torch.futures.Future()
            future.set_result(out)
            future.wait()
    benchmark.group = "work"
    benchmark(fn)
    _record(benchmark, "finished Work + wait", provider)


@pytest.mark.parametrize("provider", ["fastcomm", "torch-ops"])
def test_quantize_4k(benchmark, provider):
    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    if provider == "fastcomm":
        def fn():
            return kernels.quantize(x, dtype=torch.int8)
    else:
        def fn():  # the same block-wise symmetric quantization in plain torch ops
            blocks = x.view(-1, kernels.DEFAULT_BLOCK)
            scales = blocks.abs().amax(1, keepdim=True) / 127
            return torch.round(blocks / scales).clamp_(-127, 127).to(torch.int8), scales
    benchmark.group = "quantize-4k"
    benchmark(fn)
    _record(benchmark, "quantize 4 KiB", provider)


# ---------------------------------------------------------------------- CUDA
def _cuda_loop(fn):
    def run():
        for _ in range(CUDA_CALLS):
            fn()
        torch.cuda.synchronize()

    return run


@pytest.mark.parametrize("provider", ["fastcomm-plan", "fastcomm", "torch-foreach"])
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda, id="cuda")])
def test_pack_cuda(benchmark, buckets, count, provider, _):
    bucket = buckets(count, "cuda")
    fn = bucket.pack(provider)
    fn()
    torch.cuda.synchronize()
    assert torch.equal(bucket.flat, torch.cat([t.reshape(-1) for t in bucket.tensors]))
    benchmark.group = f"pack-{count}-cuda"
    benchmark(_cuda_loop(fn))
    _record(benchmark, f"pack {count} tensors (CUDA)", provider, CUDA_CALLS)


@pytest.fixture(scope="module")
def nccl_comms():
    from fastcomm.comm import NcclCommunicator, Store
    from fastcomm.comm.nccl import cupy_nccl

    if cupy_nccl() is None:
        pytest.skip("CuPy NCCL bindings not loadable")
    store = Store(is_server=True, timeout=60)
    comms = {"fastcomm-nccl": NcclCommunicator(store.prefixed("host/nccl", rank=0), 0, 1, 60)}
    owner = not dist.is_initialized()
    if owner:
        torch_store = store.prefixed("host/torch-nccl", rank=0).torch_store
        dist.init_process_group("nccl", store=torch_store, rank=0, world_size=1)
    comms["torch-nccl"] = _TorchGroup(dist.new_group([0], backend="nccl"))
    yield comms
    comms["fastcomm-nccl"].close()
    if owner:
        dist.destroy_process_group()


@pytest.mark.parametrize("provider", ["fastcomm-nccl", "torch-nccl"])
@pytest.mark.parametrize("_", [pytest.param(None, marks=needs_cuda, id="cuda")])
def test_all_reduce_4k_nccl(benchmark, nccl_comms, provider, _):
    comm = nccl_comms[provider]
    x = torch.ones(1024, device="cuda")
    fn = _cuda_loop(lambda: comm.all_reduce(x))
    fn()
    assert torch.equal(x, torch.ones_like(x))
    benchmark.group = "all_reduce-4k-nccl"
    benchmark(fn)
    _record(benchmark, "all_reduce 4 KiB (NCCL)", provider, CUDA_CALLS)
