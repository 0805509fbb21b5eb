"""Design probes for the CUDA hot path, one GPU, one process (no test, a printout).

    python bench/gpu_probe.py            # all probes
    python bench/gpu_probe.py sweep      # the pack/unpack block sizes alone
    python bench/gpu_probe.py graph      # host cost of a bucket chain, eager and replayed

``sweep``: `PackPlan` pack (plain and scaled) and unpack on the kernel benchmark's buckets,
for each (BLOCK, num_warps), against ``torch.cat``/``_foreach_copy_`` and a flat copy
(TB/s counting bytes read and written, the median of ``triton.testing.do_bench``).

``graph``: one bucket's pack -> NCCL all-reduce (world 1, through CuPy) -> unpack, made
eagerly and replayed from a captured CUDA graph: host microseconds per bucket and the
results of both compared; plus the host cost of the calls the eager path makes per bucket.
"""

# ruff: noqa: B023 (each lambda is timed at once, inside the iteration that made it)

import statistics
import sys
import time

import torch
import triton.testing

from fastcomm.kernels import PackPlan, _pack, _plan

DEV = torch.device("cuda", 0)
_BERT = [(768, 2304), (2304,), (768, 768), (768,), (768,), (768,),
         (768, 3072), (3072,), (3072, 768), (768,), (768,), (768,)]
CASES = {"8x1M": [(1 << 20,)] * 8, "500x4K": [(4096,)] * 500, "bert-layer": _BERT}


def tbps(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e12


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def sweep():
    n = 1 << 26
    a, b = torch.empty(n, device=DEV), torch.empty(n, device=DEV)
    copy = tbps(8 * n, bench(lambda: b.copy_(a)))
    print(f"device copy 256 MiB: {copy:.2f} TB/s")
    for case, shapes in CASES.items():
        g = [torch.randn(s, device=DEV) for s in shapes]
        total = sum(t.numel() for t in g)
        flat = torch.empty(total, device=DEV)
        nbytes = 8 * total
        flat_1d = [t.view(-1) for t in g]
        views = list(torch._utils._unflatten_dense_tensors(flat, g))
        cat = tbps(nbytes, bench(lambda: torch.cat(flat_1d, out=flat)))
        fe = tbps(nbytes, bench(lambda: torch._foreach_copy_(views, g)))
        fe_back = tbps(nbytes, bench(lambda: torch._foreach_copy_(g, views)))
        fcopy = tbps(nbytes, bench(lambda: flat.copy_(a[:total])))
        print(f"\n{case}: cat {cat:.2f}  foreach {fe:.2f}  foreach-unpack {fe_back:.2f}  "
              f"flat copy {fcopy:.2f} TB/s")
        for block in (1024, 2048, 4096, 8192, 16384):
            for warps in (4, 8, 16):
                if block // (32 * warps) < 4:
                    continue
                _pack.BLOCK = _plan.BLOCK = block
                _pack.NUM_WARPS = warps
                plan = PackPlan(g)
                plan.pack(g, flat, scale=0.5)
                plan.unpack(flat, g, scale=0.5)
                t_scaled = tbps(nbytes, bench(lambda: plan.pack(g, flat, scale=0.5)))
                # scale 1 on 8x1M takes _foreach_copy_ (64 MiB limit); the launch directly:
                tables = plan.block_tables(g, flat)
                t_plain = tbps(nbytes, bench(lambda: _pack.launch_pack(tables, flat, 1.0)))
                t_un = tbps(nbytes, bench(lambda: plan.unpack(flat, g, scale=0.5)))
                t_acc = tbps(12 * total, bench(lambda: plan.unpack(flat, g, accumulate=True)))
                print(f"  BLOCK {block:6d} warps {warps:2d}: pack {t_plain:.2f}  "
                      f"pack*s {t_scaled:.2f}  unpack*s {t_un:.2f}  unpack+= {t_acc:.2f}")
    _pack.BLOCK = _plan.BLOCK = 4096
    _pack.NUM_WARPS = 4


def host_us(fn, reps=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps // 5):
            fn()
        samples.append((time.perf_counter() - t0) / (reps // 5) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def graph():
    import cupy
    from cupy.cuda import nccl

    print("\nNCCL", nccl.get_version(), "cupy", cupy.__version__)
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    for case in ("8x1M", "bert-layer", "500x4K"):
        g = [torch.randn(s, device=DEV) for s in CASES[case]]
        total = sum(t.numel() for t in g)
        flat = torch.empty(total, device=DEV)
        plan = PackPlan(g)
        avg = getattr(nccl, "NCCL_AVG", 4)

        def chain(stream=None):
            s = torch.cuda.current_stream().cuda_stream if stream is None else stream
            plan.pack(g, flat, scale=0.5)
            comm.allReduce(flat.data_ptr(), flat.data_ptr(), total, nccl.NCCL_FLOAT32, avg, s)
            plan.unpack(flat, g, scale=2.0)

        ref = [t.clone() for t in g]
        chain()
        torch.cuda.synchronize()
        ok_eager = all(torch.equal(a, b) for a, b in zip(ref, g, strict=True))
        eager = host_us(chain)
        gr = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chain()
        torch.cuda.current_stream().wait_stream(side)
        try:
            with torch.cuda.graph(gr):
                chain()
            for t, r in zip(g, ref, strict=True):
                t.copy_(r)
            gr.replay()
            torch.cuda.synchronize()
            ok_graph = all(torch.equal(a, b) for a, b in zip(ref, g, strict=True))
            replay = host_us(gr.replay)
            dev_ms = bench(gr.replay)
            dev_eager = bench(chain)
            print(f"{case}: eager chain {eager:.1f} us host, replay {replay:.1f} us host; "
                  f"device {dev_eager * 1e3:.1f} / {dev_ms * 1e3:.1f} us; results equal: "
                  f"eager {ok_eager}, graph {ok_graph}")
        except Exception as exc:
            print(f"{case}: capture failed: {type(exc).__name__}: {exc}")
    # host cost of the eager path's pieces
    ev = torch.cuda.Event()
    print("current_stream()", f"{host_us(torch.cuda.current_stream):.2f} us")
    print("torch.cuda.Event()", f"{host_us(torch.cuda.Event):.2f} us")
    print("event.record()", f"{host_us(ev.record):.2f} us")
    print("event.query()", f"{host_us(ev.query):.2f} us")
    x = torch.empty(1 << 20, device=DEV)
    def all_reduce():
        stream = torch.cuda.current_stream().cuda_stream
        comm.allReduce(x.data_ptr(), x.data_ptr(), x.numel(), nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       stream)

    print("cupy allReduce 4 MiB", f"{host_us(all_reduce):.2f} us")


if __name__ == "__main__":
    which = sys.argv[1:] or ["sweep", "graph"]
    torch.cuda.init()
    print(torch.cuda.get_device_name(0), torch.__version__)
    for name in which:
        {"sweep": sweep, "graph": graph}[name]()
