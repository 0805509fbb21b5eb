"""What each gradient-compression hook buys: bytes on the wire, codec time, break-even link.

Published studies find that compression rarely beats a 16-bit allreduce on fast links. This
file measures the two figures that decide it for every hook and derives the third.

1. ``test_wire_bytes[hook]``: a real 2-rank DDP (CPU ranks over Gloo, one thread each) of
   ``Linear(W, W) + ReLU`` x D trains with the hook; each step, every communicator the hook
   uses counts its payload (``comm.stats``): the DDP's own and, for the two-phase hooks (int8,
   fp8, PowerSGD), the private one they split off for their second phase
   (``state.phases.second``). Bytes on the wire are what a rank *sends* under the usual
   algorithms: ring allreduce 2(n-1)/n of its payload, pairwise all_to_all (n-1)/n, ring
   all_gather its chunk to each of n-1 peers. ``B`` is the allreduce-equivalent size (the
   fp32 allreduce that sends as much; at n = 2 it equals the bytes sent), which does not
   depend on n (int8/fp8: up to their padding to n x 256 elements). The timed function is
   one training step; its time (loopback, two ranks sharing this machine) is no link figure.
2. ``test_codec_time[hook]``: what the hook computes on one rank per bucket, reproduced with
   the same ``fastcomm.kernels`` calls in the same order (``_make_codec``), received buffers
   stood in for by the local ones of the same size: fp32 (DDP without a hook) and fp16/bf16:
   the averaging pack + the unpack into ``.grad``; int8/fp8: pack, quantize with error
   feedback, dequantize the n chunks and sum them, re-quantize the owned chunk, dequantize,
   unpack; PowerSGD: pack, error feedback, P = MQ, orthogonalize P, Q = M^T P, M = PQ^T, the
   new residual, unpack. GB/s = fp32 bucket bytes per second. Each timed round is preceded by
   the fp32 and fp16 codecs (timed by hand, order alternating; every codec on its own copy of
   the gradients); a hook's extra time over a baseline is the median of the per-round
   differences (fp32's own row, a second fp32 codec, shows the noise floor). Bucket:
   ``Linear(W, W)`` layers -- on a GPU 6 of them (24 MiB, what the 25 MiB cap holds), on CPU
   one (4 MiB, the torch reference, one thread: what one rank of this machine has).
3. ``test_break_even``: the model and the table, printed.

Model (per bucket, n ranks, link bandwidth ``bw``, latency ``alpha`` per message step): a
hook's collectives take ``S*alpha + 2(n-1)/n * B/bw``, with ``S`` = 2(n-1) per allreduce and
n-1 per all_to_all or all_gather (counted from ``comm.stats.calls``); codec and collectives
run one after the other (no overlap). A hook beats a baseline below

    bw* = 2(n-1)/n * (B_base - B_hook) / (t_hook - t_base + alpha * (S_hook - S_base))

where ``t`` are codec times (the baseline's own pack/unpack is subtracted: DDP does that
work too) and a bucket's ``B`` is its fp32 size times the per-step ratio measured in DDP
(the reproduction's own buffers must agree within 5 %; int8/fp8 differ by padding only).
"always": fewer bytes and no more time; "never": no fewer bytes. The codec times measured
here are used for n = 8 too (int8/fp8 re-quantize 1/n of the bucket: n = 2 overstates their
time a little). ``alpha`` defaults to 5 us (``FASTCOMM_BENCH_ALPHA_US``).

Quick mode (``--benchmark-disable`` or ``FASTCOMM_BENCH_QUICK=1``): width 128, 2 DDP steps,
1-3 codec rounds: a smoke test of a few seconds.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import pytest
import torch

from fastcomm import kernels
from tests.harness import STATE, RankPool

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
HOOKS = ["fp32", "fp16", "bf16", "int8", "fp8", "powersgd-r1", "powersgd-r4"]
BASELINES = ("fp32", "fp16")
WORLDS = (2, 8)
ALPHA_S = float(os.environ.get("FASTCOMM_BENCH_ALPHA_US", "5")) * 1e-6
BLOCK = kernels.DEFAULT_BLOCK  # what QuantizeState uses by default
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

# Bytes a rank sends per byte of payload, and message steps, per collective on n ranks.
_SENT = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
}
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),
    "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
}

_WIRE: dict[str, dict] = {}  # hook -> per-step figures of test_wire_bytes
_CODEC: dict[str, dict] = {}  # hook -> per-bucket figures of test_codec_time


@dataclass(frozen=True)
class Config:
    quick: bool
    width: int  # of every Linear layer, in the DDP model and in the codec bucket
    depth: int  # Linear layers of the DDP model
    batch: int
    steps: int  # measured DDP steps per hook (after 2 warm-up steps)
    bucket_layers: int  # Linear(width, width) layers in the codec bucket
    rounds: int  # timed codec rounds


@pytest.fixture(scope="module")
def cfg(request) -> Config:
    quick = bool(os.environ.get("FASTCOMM_BENCH_QUICK")) or request.config.getoption(
        "benchmark_disable"
    )
    if quick:
        return Config(True, 128, 3, 8, 2, 1, 3)
    return Config(False, 1024, 6, 32, 5, 6 if ON_GPU else 1, 100)


# ---------------------------------------------------------------------- rank side
def _hook_and_state(name: str, comm):
    from fastcomm.ddp import hooks

    if name == "fp32":
        return None, None
    if name in _DTYPES:
        return getattr(hooks, f"{name}_compress_hook"), None
    if name in _QDTYPES:
        return getattr(hooks, f"{name}_compress_hook"), hooks.QuantizeState(comm, block=BLOCK)
    rank = int(name.removeprefix("powersgd-r"))
    state = hooks.PowerSGDState(comm, matrix_approximation_rank=rank, start_powerSGD_iter=1)
    return hooks.powersgd_hook, state


def setup_ddp(hook: str, width: int, depth: int, batch: int) -> dict:
    from torch import nn

    from fastcomm.ddp import DDP
    from tests.harness import rank_comm

    torch.set_num_threads(1)
    comm = rank_comm("gloo")
    torch.manual_seed(0)
    layers = [m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())]
    model = DDP(nn.Sequential(*layers), comm=comm)
    fn, state = _hook_and_state(hook, comm)
    if fn is not None:
        model.register_comm_hook(state, fn)
    gen = torch.Generator().manual_seed(int(os.environ["RANK"]))
    STATE["compression"] = {
        "model": model,
        "state": state,
        "opt": torch.optim.SGD(model.parameters(), lr=1e-3),
        "x": torch.randn(batch, width, generator=gen),
        "y": torch.randn(batch, width, generator=gen),
    }
    for _ in range(2):  # the first step records the arrival order; buckets rebuilt after it
        train_step()
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "buckets": len(model.reducer.buckets),
    }


def _comms() -> list:
    b = STATE["compression"]
    comms = [b["model"].comm]
    phases = getattr(b["state"], "phases", None)
    if phases is not None and phases.second is not None:
        comms.append(phases.second)
    return comms


def train_step() -> dict:
    """One step; the payload bytes and calls of every communicator of the hook during it."""
    b = STATE["compression"]
    comms = _comms()
    for c in comms:
        c.stats.reset()
    start = time.perf_counter()
    b["opt"].zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(b["model"](b["x"]), b["y"]).backward()
    b["opt"].step()
    seconds = time.perf_counter() - start
    payload: dict[str, int] = {}
    calls: dict[str, int] = {}
    for c in comms:
        for op, v in c.stats.bytes.items():
            payload[op] = payload.get(op, 0) + v
        for op, v in c.stats.calls.items():
            calls[op] = calls.get(op, 0) + v
    return {"seconds": seconds, "payload": payload, "calls": calls}


def teardown_ddp() -> None:
    b = STATE.pop("compression", None)
    phases = getattr(b and b["state"], "phases", None)
    if phases is not None and phases.second is not None:
        phases.second.close()


# ---------------------------------------------------------------------- wire bytes
@pytest.fixture(scope="module")
def ranks():
    with RankPool(2, env={"TRITON_INTERPRET": "0"}, timeout=300) as pool:
        yield pool


def _sent_bytes(payload: dict[str, int], n: int) -> float:
    unknown = set(payload) - set(_SENT)
    if unknown:
        raise AssertionError(f"no wire model for {sorted(unknown)} (payload {payload})")
    return sum(v * _SENT[op](n) for op, v in payload.items())


@pytest.mark.parametrize("hook", HOOKS)
def test_wire_bytes(benchmark, ranks, cfg, hook):
    info = ranks.run(setup_ddp, hook, cfg.width, cfg.depth, cfg.batch)[0]
    samples: list[list[dict]] = []
    try:
        benchmark.pedantic(
            lambda: samples.append(ranks.run(train_step)), rounds=cfg.steps, iterations=1
        )
        while len(samples) < cfg.steps:  # --benchmark-disable runs the target once
            samples.append(ranks.run(train_step))
    finally:
        ranks.run(teardown_ddp)
    n = ranks.world_size
    for per_rank in samples:  # every rank hands the same payload to the collectives
        assert all(r["payload"] == per_rank[0]["payload"] for r in per_rank), per_rank
    sent = [_sent_bytes(s[0]["payload"], n) for s in samples]
    assert len(set(sent)) == 1, f"{hook}: bytes per step vary: {sent}"
    calls = samples[0][0]["calls"]
    row = {
        "sent_bytes": sent[0],
        "B": sent[0] / _SENT["all_reduce"](n),  # allreduce-equivalent bytes per step
        "payload": samples[0][0]["payload"],
        "calls": calls,
        "buckets": info["buckets"],
        "params": info["params"],
        "steps_per_bucket": {
            m: sum(c * _STEPS[op](m) for op, c in calls.items()) / info["buckets"]
            for m in WORLDS
        },
    }
    _WIRE[hook] = row
    step_s = statistics.median(max(r["seconds"] for r in s) for s in samples)
    benchmark.extra_info.update(
        hook=hook,
        ranks=n,
        params=info["params"],
        buckets=info["buckets"],
        payload_bytes_per_step=row["payload"],
        calls_per_step=calls,
        sent_bytes_per_rank_per_step=int(row["sent_bytes"]),
        allreduce_equiv_bytes_per_step=int(row["B"]),
        step_ms_loopback=round(1e3 * step_s, 2),
    )
    if "fp32" in _WIRE:
        row["ratio"] = row["B"] / _WIRE["fp32"]["B"]
        benchmark.extra_info["ratio_to_fp32"] = round(row["ratio"], 5)
    assert row["B"] > 0


# ---------------------------------------------------------------------- codec time
@pytest.fixture(scope="module")
def one_thread():
    """On CPU, one intra-op thread: what each rank of this 2-core machine has."""
    before = torch.get_num_threads()
    if not ON_GPU:
        torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _bucket(cfg: Config) -> list[torch.Tensor]:
    """A bucket's gradients, in DDP's order (last layer first), of gradient-like size."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(cfg.width,), (cfg.width, cfg.width)] * cfg.bucket_layers
    return [(1e-3 * torch.randn(s, generator=gen)).to(DEVICE) for s in shapes]


def _make_codec(hook: str, grads: list[torch.Tensor], world: int = 2):
    """``(fn, B)``: fn does what `hook` computes per bucket on one rank (DDP's pack/unpack
    included); B is the allreduce-equivalent size of the buffers it would communicate."""
    n = sum(g.numel() for g in grads)
    outs = [torch.empty_like(g) for g in grads]  # the .grad the reducer unpacks into
    scale = 1.0 / world
    if hook in _DTYPES:
        dtype = _DTYPES[hook]
        flat = torch.empty(n, dtype=dtype, device=DEVICE)

        def cast():
            kernels.pack(grads, flat, scale=scale, dtype=dtype)
            # all_reduce(flat)
            kernels.unpack(flat, outs)

        return cast, n * flat.element_size()
    if hook in _QDTYPES:
        qdtype = _QDTYPES[hook]
        chunk = -(-n // (world * BLOCK)) * BLOCK
        x = torch.zeros(chunk * world, device=DEVICE)
        error = torch.zeros_like(x)

        def quantized():
            kernels.pack(grads, x[:n], scale=scale, dtype=torch.float32)
            q, scales = kernels.quantize(x, dtype=qdtype, block=BLOCK, error=error)
            # all_to_all(q), all_to_all(scales): n chunks of my share arrive, as big as q
            parts = kernels.dequantize(q, scales, block=BLOCK).view(world, chunk)
            kernels.quantize(parts.sum(0), dtype=qdtype, block=BLOCK)
            # all_gather of the re-quantized chunks: a buffer as big as q arrives
            kernels.dequantize(q, scales, out=x, block=BLOCK)
            kernels.unpack(x[:n], outs)

        return quantized, x.numel() + 4 * (x.numel() // BLOCK)
    return _make_powersgd(int(hook.removeprefix("powersgd-r")), grads, outs, scale)


def _make_powersgd(r: int, grads, outs, scale: float):
    from fastcomm.ddp.hooks.powersgd import _orthogonalize_  # the hook's own

    n = sum(g.numel() for g in grads)
    flat = torch.empty(n, device=DEVICE)
    error = torch.zeros_like(flat)
    matrices, plain, qs = [], [], []
    offset = 0
    for g in grads:  # PowerSGDState's default min_compression_rate = 2
        view = flat[offset : offset + g.numel()]
        offset += g.numel()
        rows, cols = (g.shape[0], g.numel() // g.shape[0]) if g.dim() > 1 else (0, 0)
        if g.dim() > 1 and rows * cols >= 2 * r * (rows + cols):
            matrices.append(view.view(rows, cols))
            q = torch.randn(cols, r, generator=torch.Generator().manual_seed(offset))
            _orthogonalize_(q, 0.0)
            qs.append(q.to(DEVICE))
        else:
            plain.append(view)
    n_plain = sum(v.numel() for v in plain)
    first = torch.empty(n_plain + sum(m.shape[0] * r for m in matrices), device=DEVICE)
    second = torch.empty(sum(m.shape[1] * r for m in matrices), device=DEVICE)

    def powersgd():
        kernels.pack(grads, flat)
        flat.add_(error)
        local = flat.clone()
        if plain:
            kernels.pack(plain, first[:n_plain])
        ps, off = [], n_plain
        for mat, q in zip(matrices, qs, strict=True):
            p = first[off : off + mat.shape[0] * r].view(mat.shape[0], r)
            torch.matmul(mat, q, out=p)
            off += p.numel()
            ps.append(p)
        # all_reduce(first)
        off = 0
        for mat, p in zip(matrices, ps, strict=True):
            _orthogonalize_(p, 0.0)
            torch.matmul(mat.t(), p, out=second[off : off + mat.shape[1] * r].view(-1, r))
            off += mat.shape[1] * r
        # all_reduce(second)
        second.mul_(scale)
        off = 0
        for i, (mat, p) in enumerate(zip(matrices, ps, strict=True)):
            q = second[off : off + mat.shape[1] * r].view(-1, r)
            off += q.numel()
            torch.matmul(p, q.t(), out=mat)
            qs[i] = q.clone()
        if plain:
            kernels.unpack(first[:n_plain], plain, scale=scale)
        torch.sub(local, flat, out=error)
        kernels.unpack(flat, outs)

    return powersgd, 4 * (first.numel() + second.numel())


def _timed(fn, nbytes: int, record: list[float]):
    """Calls `fn` (on a GPU enough times to cover ~256 MB, then syncs); appends s per call."""
    reps = max(1, (256 << 20) // nbytes) if ON_GPU else 1

    def run():
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if ON_GPU:
            torch.cuda.synchronize()
        record.append((time.perf_counter() - start) / reps)

    return run


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4)
    return q1, q2, q3


@pytest.mark.parametrize("hook", HOOKS)
def test_codec_time(benchmark, cfg, one_thread, hook):
    # Each codec gets its own copy of the gradients: no codec reads what another just cached.
    target, b_buffers = _make_codec(hook, _bucket(cfg))
    bases = {b: _make_codec(b, _bucket(cfg))[0] for b in BASELINES}
    bucket_bytes = 4 * sum(g.numel() for g in _bucket(cfg))
    times: dict[str, list[float]] = {h: [] for h in ("hook", *BASELINES)}
    runs = {b: _timed(fn, bucket_bytes, times[b]) for b, fn in bases.items()}
    runs["hook"] = _timed(target, bucket_bytes, times["hook"])
    for h, run in runs.items():  # warm-up: first-call allocations, Triton compiles
        run()
        times[h].clear()
    turn = [0]

    def baselines():  # interleaved with every timed round, order alternating
        turn[0] += 1
        for b in BASELINES[:: 1 if turn[0] % 2 else -1]:
            runs[b]()

    benchmark.pedantic(runs["hook"], setup=baselines, rounds=cfg.rounds, iterations=1)
    seconds = statistics.median(times["hook"])
    # The hook's extra time over a baseline: median of the per-round (paired) differences,
    # steadier than a difference of medians on a shared machine.
    deltas = {
        b: _quartiles([h - t for h, t in zip(times["hook"], times[b], strict=True)])
        for b in BASELINES
    }
    row = {
        "seconds": seconds,
        "delta": {b: q[1] for b, q in deltas.items()},
        "delta_iqr": {b: q[2] - q[0] for b, q in deltas.items()},
        "bucket_bytes": bucket_bytes,
        "B_buffers": b_buffers,
    }
    _CODEC[hook] = row
    benchmark.extra_info.update(
        hook=hook,
        device=str(DEVICE),
        backend=kernels.kernel_backend(DEVICE),
        bucket_bytes_fp32=bucket_bytes,
        bucket_layers=f"{cfg.bucket_layers} x Linear({cfg.width}, {cfg.width})",
        codec_ms=round(1e3 * seconds, 4),
        codec_gbps=round(bucket_bytes / seconds / 1e9, 3),
        interleaved_codec_ms={b: round(1e3 * statistics.median(times[b]), 4) for b in BASELINES},
        extra_ms_over={b: [round(1e3 * x, 4) for x in q] for b, q in deltas.items()},
        allreduce_equiv_bytes_per_bucket=b_buffers,
    )
    if hook in _WIRE and "fp32" in _WIRE:
        # The reproduction must communicate what the hook does in DDP (int8/fp8 differ
        # by their padding only).
        ratio_buffers = b_buffers / bucket_bytes
        assert abs(ratio_buffers / _WIRE[hook]["ratio"] - 1) < 0.05, (
            ratio_buffers,
            _WIRE[hook]["ratio"],
        )
        for base in BASELINES:
            for n in WORLDS:
                bw = _break_even(hook, base, n)
                if bw is not None:
                    benchmark.extra_info[f"break_even_gbps_vs_{base}_n{n}"] = (
                        bw if isinstance(bw, str) else round(bw, 4)
                    )
    assert seconds > 0


# ---------------------------------------------------------------------- break-even
def _break_even(hook: str, base: str, n: int) -> float | str | None:
    """bw* in GB/s below which `hook` beats `base` (see the module docstring)."""
    if hook == base or base not in _WIRE or hook not in _WIRE or hook not in _CODEC:
        return None
    codec = _CODEC[hook]
    bucket = codec["bucket_bytes"]  # the fp32 bucket; the wire ratios scale it
    d_bytes = bucket * (_WIRE[base]["ratio"] - _WIRE[hook]["ratio"])
    d_steps = _WIRE[hook]["steps_per_bucket"][n] - _WIRE[base]["steps_per_bucket"][n]
    d_time = codec["delta"][base] + ALPHA_S * d_steps
    if d_bytes <= 0:
        return "never"
    if d_time <= 0:
        return "always"
    return _SENT["all_reduce"](n) * d_bytes / d_time / 1e9


def _fmt_bw(bw) -> str:
    if bw is None:
        return "-"
    return bw if isinstance(bw, str) else f"{bw:.3g}"


def test_break_even(cfg, capsys):
    hooks = [h for h in HOOKS if h in _WIRE and h in _CODEC]
    if "fp32" not in _WIRE or not hooks:
        pytest.skip("needs test_wire_bytes and test_codec_time in the same session")
    fp32 = _WIRE["fp32"]
    bucket = _CODEC[hooks[0]]["bucket_bytes"]
    where = f"{DEVICE}, {kernels.kernel_backend(DEVICE)} kernels" + (
        "" if ON_GPU else ", 1 thread"
    )
    lines = [
        "",
        f"Compression hooks: DDP of {cfg.depth} x Linear({cfg.width}, {cfg.width}) "
        f"({fp32['params'] / 1e6:.2f}M params, {fp32['buckets']} buckets), 2 ranks; codec "
        f"bucket {bucket / 2**20:.2f} MiB fp32 ({where}); alpha = {ALPHA_S * 1e6:g} us"
        + ("  [quick mode: smoke figures]" if cfg.quick else ""),
        f"{'hook':<12} {'MB/step':>8} {'x fp32':>7} {'codec ms':>9} {'GB/s':>6} "
        f"{'+ms/fp32':>9} {'(IQR)':>7} | {'bw* vs fp32 n=2':>15} {'n=8':>6} | "
        f"{'vs fp16 n=2':>11} {'n=8':>6}   (GB/s)",
    ]
    for h in hooks:
        w, c = _WIRE[h], _CODEC[h]
        bw = [_fmt_bw(_break_even(h, b, n)) for b in BASELINES for n in WORLDS]
        lines.append(
            f"{h:<12} {w['sent_bytes'] / 1e6:8.3f} {w['ratio']:7.4f} {1e3 * c['seconds']:9.3f} "
            f"{c['bucket_bytes'] / c['seconds'] / 1e9:6.2f} "
            f"{1e3 * c['delta']['fp32']:+9.3f} {1e3 * c['delta_iqr']['fp32']:7.3f} | "
            f"{bw[0]:>15} {bw[1]:>6} | {bw[2]:>11} {bw[3]:>6}"
        )
    lines.append(
        "MB/step: bytes each rank sends per step (n=2; = allreduce-equivalent B). +ms/fp32: "
        "codec time over DDP's own pack/unpack (median of paired rounds; fp32's row is the "
        "noise floor). bw*: the hook wins on links slower than this."
    )
    with capsys.disabled():
        print("\n".join(lines))
    assert len(lines) > 4
