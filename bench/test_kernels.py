"""fastcomm.kernels throughput against the torch ways of doing the same.

Buckets (fp32): ``8x1M`` (8 tensors of 1M elements, 32 MiB), ``500x4K`` (500 tensors of 4K
elements, 8 MiB) and ``bert-layer`` (the 12 parameters of a BERT-base layer, 27 MiB: a
DDP-sized bucket of mixed sizes). Throughput counts bytes read + written. Providers:

- ``fastcomm``: `pack`/`unpack`/`quantize`/`dequantize` (on CPU: the torch reference path,
  which is what CPU tensors get; ``extra_info["backend"]`` says which ran);
- ``fastcomm-plan``: pack/unpack through a `PackPlan` made once (what a DDP bucket does);
- ``torch-copy-loop``: one ``copy_`` per tensor (what a naive reducer does);
- ``torch-cat``: ``torch.cat(..., out=)``; ``torch-foreach``: ``torch._foreach_copy_``;
- ``torch-flat-copy``: one ``copy_`` of a flat buffer of the same size (the ideal);
- ``fastcomm-graph`` (GPU): the pack/unpack a DDP bucket replays from a CUDA graph
  (``RelocatablePlan``; the unpack also measures), the timed calls captured in one graph:
  the device's time without the host's; ``torch-cat-graph`` / ``torch-foreach-graph``: the
  torch op captured the same way, its fair reference;
- ``torch`` (quantize/dequantize): the reference written in torch ops.

``test_copy_bandwidth`` measures ``copy_`` of one large buffer, the physical limit; the
other tests report ``fraction_of_copy`` against it (run it in the same session). On a GPU
each timed call runs enough back-to-back ops to move ~256 MB, then synchronizes. On CPU the
buckets shrink so that ``pytest bench/test_kernels.py --benchmark-disable`` takes seconds.
"""

import pytest
import torch

from fastcomm.kernels import (
    PackPlan,
    RelocatablePlan,
    dequantize,
    dequantize_reference,
    kernel_backend,
    pack,
    quantize,
    quantize_reference,
    unpack,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
SHRINK = 1 if ON_GPU else 16  # CPU: 1/16 of the element counts

_BERT_LAYER = [(768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
               (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)]
CASES = {
    "8x1M": [(2**20 // SHRINK,)] * 8,
    "500x4K": [(4096 // SHRINK,)] * 500,
    "bert-layer": [(s[0] // SHRINK, *s[1:]) for s in _BERT_LAYER],
}
_COPY = {}  # "gbps": copy bandwidth measured by test_copy_bandwidth


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


def timed(fn, nbytes):
    """A benchmark target: enough calls of `fn` to move ~256 MB (GPU), then a sync."""
    reps = max(1, (256 << 20) // max(nbytes, 1)) if ON_GPU else 1

    def run():
        for _ in range(reps):
            fn()
        sync()

    fn()  # warm up: compile, build and cache block tables
    sync()
    return run, reps


def fraction(gbps):
    if gbps is None or "gbps" not in _COPY:
        return None
    return round(gbps / _COPY["gbps"], 3)


def bucket(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(DEVICE) for s in CASES[case]]


def test_copy_bandwidth(benchmark, throughput):
    n = (1 << 28 if ON_GPU else 1 << 24) // 4  # 256 MiB on GPU, 16 MiB on CPU, fp32
    src, dst = torch.randn(n, device=DEVICE), torch.empty(n, device=DEVICE)
    nbytes = 2 * src.numel() * src.element_size()
    run, reps = timed(lambda: dst.copy_(src), nbytes)
    benchmark(run)
    gbps = throughput(benchmark, nbytes, reps, op="copy", provider="torch-copy")
    if gbps is not None:
        _COPY["gbps"] = gbps


PACK_PROVIDERS = ["fastcomm", "fastcomm-plan", "fastcomm-graph", "torch-copy-loop", "torch-cat",
                  "torch-cat-graph", "torch-foreach", "torch-flat-copy"]
GRAPHED = {"fastcomm-graph", "torch-cat-graph", "torch-foreach-graph"}


def graphed(fn, reps: int):
    """`reps` calls of `fn` captured in one CUDA graph (after a warm call): its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph.replay


def timed_provider(provider: str, fn, nbytes: int):
    """`timed` for eager providers; for the graphed ones, one replay of all the calls."""
    if provider not in GRAPHED:
        return timed(fn, nbytes)
    if not ON_GPU:
        pytest.skip("CUDA graphs need a GPU")
    reps = max(1, (256 << 20) // max(nbytes, 1))
    return timed(graphed(fn, reps), nbytes * reps)[0], reps


def relocatable(tensors):
    """A `RelocatablePlan` of `tensors` pointed at them (what a DDP bucket's graph runs)."""
    plan = RelocatablePlan([t.numel() for t in tensors], tensors[0].dtype, tensors[0].device)
    assert plan.set_addresses([t.data_ptr() for t in tensors], torch.cuda.current_stream())
    return plan


@pytest.mark.parametrize("provider", PACK_PROVIDERS)
@pytest.mark.parametrize("case", list(CASES))
def test_pack(benchmark, throughput, case, provider):
    tensors = bucket(case)
    numels = [t.numel() for t in tensors]
    out = torch.empty(sum(numels), device=DEVICE)
    views = list(out.split(numels))
    flat_tensors = [t.view(-1) for t in tensors]
    plan = PackPlan(tensors)
    fns = {
        "fastcomm": lambda: pack(tensors, out=out),
        "fastcomm-plan": lambda: plan.pack(tensors, out),
        "torch-cat-graph": lambda: torch.cat(flat_tensors, out=out),
        "torch-copy-loop": lambda: [v.copy_(t) for v, t in zip(views, flat_tensors, strict=True)],
        "torch-cat": lambda: torch.cat(flat_tensors, out=out),
        "torch-foreach": lambda: torch._foreach_copy_(views, flat_tensors),
    }
    if provider == "torch-flat-copy":
        src = torch.cat(flat_tensors)
        fns[provider] = lambda: out.copy_(src)
    if provider == "fastcomm-graph" and ON_GPU:
        moving = relocatable(tensors)

        def graph_pack():
            moving.relocate()
            moving.pack(out, 1.0)

        fns[provider] = graph_pack
    nbytes = 2 * out.numel() * out.element_size()
    if provider not in fns:
        pytest.skip("CUDA graphs need a GPU")
    run, reps = timed_provider(provider, fns[provider], nbytes)
    benchmark(run)
    assert torch.equal(out, torch.cat(flat_tensors))
    gbps = throughput(benchmark, nbytes, reps, op="pack", case=case, provider=provider,
                      backend=_backend(provider), n_tensors=len(tensors))
    benchmark.extra_info["fraction_of_copy"] = fraction(gbps)


UNPACK_PROVIDERS = ["fastcomm", "fastcomm-plan", "fastcomm-graph", "torch-copy-loop",
                    "torch-foreach", "torch-foreach-graph", "torch-flat-copy"]


@pytest.mark.parametrize("provider", UNPACK_PROVIDERS)
@pytest.mark.parametrize("case", list(CASES))
def test_unpack(benchmark, throughput, case, provider):
    tensors = bucket(case)
    numels = [t.numel() for t in tensors]
    flat = torch.randn(sum(numels), device=DEVICE)
    views = [v.view(t.shape) for v, t in zip(flat.split(numels), tensors, strict=True)]
    dst = torch.empty_like(flat)
    plan = PackPlan(tensors)
    fns = {
        "fastcomm": lambda: unpack(flat, tensors),
        "fastcomm-plan": lambda: plan.unpack(flat, tensors),
        "torch-copy-loop": lambda: [t.copy_(v) for t, v in zip(tensors, views, strict=True)],
        "torch-foreach": lambda: torch._foreach_copy_(tensors, views),
        "torch-foreach-graph": lambda: torch._foreach_copy_(tensors, views),
        "torch-flat-copy": lambda: dst.copy_(flat),
    }
    if provider == "fastcomm-graph" and ON_GPU:
        moving = relocatable(tensors)
        stats = torch.zeros(2, device=DEVICE)

        def graph_unpack():
            moving.relocate()
            moving.unpack_measured(flat, stats)

        fns[provider] = graph_unpack
    nbytes = 2 * flat.numel() * flat.element_size()
    if provider not in fns:
        pytest.skip("CUDA graphs need a GPU")
    run, reps = timed_provider(provider, fns[provider], nbytes)
    benchmark(run)
    if provider != "torch-flat-copy":
        assert torch.equal(torch.cat([t.view(-1) for t in tensors]), flat)
    gbps = throughput(benchmark, nbytes, reps, op="unpack", case=case, provider=provider,
                      backend=_backend(provider), n_tensors=len(tensors))
    benchmark.extra_info["fraction_of_copy"] = fraction(gbps)


@pytest.mark.parametrize("provider", ["fastcomm", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_quantize(benchmark, throughput, case, provider):
    """int8, blocks of 256, with error feedback: the compressed-allreduce send side."""
    x = torch.cat([t.view(-1) for t in bucket(case)])
    error = torch.zeros_like(x)
    fn = quantize if provider == "fastcomm" else quantize_reference
    # x read, error read and written, codes written; scales (4 bytes per 256) on top.
    nbytes = x.numel() * (4 + 4 + 4 + 1) + (x.numel() // 256) * 4
    run, reps = timed(lambda: fn(x, dtype=torch.int8, block=256, error=error), nbytes)
    benchmark(run)
    gbps = throughput(benchmark, nbytes, reps, op="quantize", case=case, provider=provider,
                      backend=_backend(provider))
    benchmark.extra_info["fraction_of_copy"] = fraction(gbps)


@pytest.mark.parametrize("provider", ["fastcomm", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_dequantize(benchmark, throughput, case, provider):
    """Accumulate a peer's int8 chunk into an fp32 sum: the compressed-allreduce reduce side."""
    x = torch.cat([t.view(-1) for t in bucket(case)])
    q, scales = quantize(x, dtype=torch.int8, block=256)
    acc = torch.zeros_like(x)
    fn = dequantize if provider == "fastcomm" else dequantize_reference
    nbytes = x.numel() * (1 + 4 + 4) + scales.numel() * 4
    run, reps = timed(lambda: fn(q, scales, out=acc, accumulate=True), nbytes)
    benchmark(run)
    gbps = throughput(benchmark, nbytes, reps, op="dequantize", case=case, provider=provider,
                      backend=_backend(provider))
    benchmark.extra_info["fraction_of_copy"] = fraction(gbps)


def _backend(provider):
    if not provider.startswith("fastcomm"):
        return "torch"
    backend = kernel_backend(DEVICE)
    return backend if ON_GPU else f"{backend} (CPU: fastcomm runs its torch reference)"
