"""Turns pytest-benchmark JSON from ``bench/`` into PNG charts.

    python bench/plot.py bench/results/cpu-2026-11-22.json [--out bench/results]

Charts, each written when the JSON holds its benchmarks:

- ``collectives_<op>.png``, one per op: latency and bus bandwidth against message size, one
  line per provider and world size (the ``"collectives"`` rows of ``bench/test_collectives.py``,
  MPICH included), the single-process copy reference as horizontal lines;
- ``collectives_busbw.png``: bus bandwidth of every op on one page, the smallest world's rows;
- ``ddp_step.png``: training-step time per provider and the speedup over torch DDP
  (``bench/test_ddp.py``);
- ``ddp_gpu.png``: per model, the GPU training step of fastcomm DDP (replayed and eager),
  torch DDP and no DDP, interleaved (``bench/test_ddp_gpu.py``);
- ``torch_backend.png``: torch DDP and FSDP2 steps on the ``fastcomm`` torch.distributed
  backend against Gloo, from the interleaved rounds (``bench/test_torch_backend.py``);
- ``kernels.png``: pack/unpack/quantize GB/s per provider and bucket, against the one-buffer
  copy bandwidth (``bench/test_kernels.py``);
- ``compression.png``: bytes on the wire per step and break-even link bandwidth per hook
  (``bench/test_compression.py``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

try:  # the plot extra; without it this module still imports (main says what to install)
    import matplotlib
except ImportError:
    matplotlib = None
else:
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


def _save(fig, path: Path, title: str | None = None, fontsize: int = 9) -> Path:
    """Writes `fig` to `path` (120 dpi, titled `title` when given) and closes it."""
    if title is not None:
        fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load(paths: list[Path]) -> tuple[list[dict], list[dict], dict]:
    """All benchmarks, all collectives rows, and the machine info of the first file."""
    benchmarks, collectives, machine = [], [], {}
    for path in paths:
        data = json.loads(path.read_text())
        benchmarks += data.get("benchmarks", [])
        collectives += data.get("collectives", [])
        machine = machine or data.get("machine_info", {})
    return benchmarks, collectives, machine


def _size_label(nbytes: float) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= div:
            return f"{nbytes / div:g} {unit}"
    return f"{nbytes:g} B"


def plot_collectives(rows: list[dict], out: Path, title: str) -> Path | None:
    """Overview: busbw of every op on one page, the smallest world's rows."""
    rows = [r for r in rows if r["op"] != "copy"]
    if not rows:
        return None
    world = min(r.get("world", 2) for r in rows)
    rows = [r for r in rows if r.get("world", 2) == world]
    ops = sorted({r["op"] for r in rows}, key=_op_key)
    cols = min(4, len(ops))
    nrows = -(-len(ops) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.6 * nrows), squeeze=False)
    for ax, op in zip(axes.flat, ops, strict=False):
        lines = defaultdict(list)
        for r in rows:
            if r["op"] == op:
                lines[r["provider"]].append((r["bytes"], r["busbw"]))
        for provider, points in sorted(lines.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=provider)
        _size_axis(ax, sorted({p for pts in lines.values() for p, _ in pts}))
        ax.set_yscale("log")
        ax.set_title(f"{op}, {world} ranks")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    return _save(fig, out / "collectives_busbw.png", title)


_OPS = ["all_reduce", "all_gather", "all_gather_list", "reduce_scatter", "reduce_scatter_list",
        "broadcast", "all_to_all", "send_recv"]
_STYLES = ["-", "--", ":", "-."]  # one per world size


def _op_key(op: str) -> tuple[int, str]:
    return (_OPS.index(op) if op in _OPS else len(_OPS), op)


def _size_axis(ax, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ticks = [s for s in sizes if s & (s - 1) == 0 and (s.bit_length() - 1) % 4 == 0] or sizes
    ax.set_xticks(ticks)
    ax.set_xticklabels([_size_label(t) for t in ticks], fontsize=8)
    ax.set_xlabel("message size")
    ax.grid(True, which="both", alpha=0.3)


def plot_collective_ops(rows: list[dict], out: Path, title: str) -> list[Path]:
    """One chart per op (``collectives_<op>.png``): latency and bus bandwidth against size,
    a colour per provider, a line style per world size; the copy reference
    (``test_copy_reference``'s largest buffer, its fastest round: the limit, not a typical
    copy) as horizontal lines on the bandwidth panel."""
    copies = {}
    for r in rows:
        if r["op"] == "copy" and r["bytes"] >= copies.get(r["provider"], (0, 0))[0]:
            copies[r["provider"]] = (r["bytes"], r.get("algbw_best", r["algbw"]))
    rows = [r for r in rows if r["op"] != "copy"]
    providers = sorted({r["provider"] for r in rows})
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    worlds = sorted({r.get("world", 2) for r in rows})
    paths = []
    for op in sorted({r["op"] for r in rows}, key=_op_key):
        fig, (lat, bw) = plt.subplots(1, 2, figsize=(10, 3.9))
        lines = defaultdict(list)
        for r in rows:
            if r["op"] == op:
                lines[(r["provider"], r.get("world", 2))].append((r["bytes"], r["us"], r["busbw"]))
        for (provider, world), points in sorted(lines.items()):
            points.sort()
            style = dict(color=colors[provider], marker="o", markersize=3,
                         linestyle=_STYLES[worlds.index(world) % len(_STYLES)],
                         label=f"{provider}, {world} ranks")
            lat.plot([p[0] for p in points], [p[1] for p in points], **style)
            bw.plot([p[0] for p in points], [p[2] for p in points], **style)
        for i, (name, (nbytes, gbps)) in enumerate(sorted(copies.items())):
            bw.axhline(gbps, color="k", linewidth=0.8, linestyle=_STYLES[i % len(_STYLES)],
                       label=f"{name} ({_size_label(nbytes)})")
        sizes = sorted({p[0] for pts in lines.values() for p in pts})
        for ax in (lat, bw):
            _size_axis(ax, sizes)
            ax.set_yscale("log")
        lat.set_ylabel("median time per call (us)")
        bw.set_ylabel("bus bandwidth (GB/s)")
        lat.set_title(f"{op}: latency", fontsize=9)
        bw.set_title(f"{op}: bus bandwidth", fontsize=9)
        bw.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
        path = _save(fig, out / f"collectives_{op}.png", title)
        paths.append(path)
    return paths


def _bench(benchmarks: list[dict], prefix: str) -> list[dict]:
    return [b for b in benchmarks if b["name"].startswith(prefix) and b.get("stats")]


def _ddp_medians(benchmarks: list[dict], test: str) -> dict[str, float]:
    """Step medians per provider: the group's interleaved run where there is one (its steps
    are seconds apart, the per-provider rounds minutes apart), else each provider's own."""
    medians = {}
    for b in _bench(benchmarks, test):
        info = b.get("extra_info", {})
        ms = info.get("rank_median_step_ms") or b["stats"]["median"] * 1e3
        medians[info.get("provider") or b["param"]] = ms
    for b in _bench(benchmarks, test):
        medians.update(b.get("extra_info", {}).get("interleaved_median_step_ms") or {})
    return medians


def _ddp_panel(ax, medians: dict[str, float], names: list[str], base: str, title: str) -> None:
    """Bars of `names`, each labelled with its time as a multiple of `base`'s."""
    names = [n for n in names if n in medians]
    colors = ["#888" if n.startswith("torch") or n.endswith("torch") else
              "#69c" if n.endswith("no-comm") else "#2a7" for n in names]
    bars = ax.bar(range(len(names)), [medians[n] for n in names], color=colors)
    for bar, name in zip(bars, names, strict=True):
        label = f"{medians[name]:.1f}"
        if base in medians and name != base:
            label += f"\n{medians[name] / medians[base]:.2f}x"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), [n.replace("fastcomm-", "fc-") for n in names],
                  rotation=30, ha="right", fontsize=7)
    ax.set_ylim(0, max(medians[n] for n in names) * 1.35)
    ax.set_title(title, fontsize=8)


def plot_ddp(benchmarks: list[dict], out: Path, title: str) -> Path | None:
    """Median step per provider; labels give each time as a multiple of torch DDP's."""
    main = _ddp_medians(benchmarks, "test_ddp_train_step")
    if not main:
        return None
    dropin = _ddp_medians(benchmarks, "test_ddp_dropin_step")
    tiny = _ddp_medians(benchmarks, "test_ddp_tiny_params_step")
    panels = [(main, ["torch", "fastcomm-gloo", "fastcomm-shm-staged", "fastcomm-shm",
                      "fastcomm-nccl", "no-comm"],
               "torch", "MLP: x torch DDP's time")]
    if dropin:
        caps = sorted({n.rsplit("-", 1)[1] for n in dropin}, key=float)
        names = [f"{who}-{cap}" for cap in caps for who in ("torch", "fastcomm-dropin")]
        panels.append((dropin, names, None, "drop-in on torch's Gloo group, by bucket_cap_mb"))
    if tiny:
        panels.append((tiny, ["tiny-torch", "tiny-fastcomm-shm-staged", "tiny-fastcomm-shm",
                              "tiny-no-comm"], "tiny-torch",
                       "200 x Linear(16, 16)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    for ax, (medians, names, base, sub) in zip(axes[0], panels, strict=True):
        if base is None:  # drop-in: each fastcomm bar against torch at the same cap
            _ddp_pairs(ax, medians, names, sub)
        else:
            _ddp_panel(ax, medians, names, base, sub)
    axes[0][0].set_ylabel("median training step (ms)")
    return _save(fig, out / "ddp_step.png", title)


def _ddp_pairs(ax, medians: dict[str, float], names: list[str], title: str) -> None:
    _ddp_panel(ax, medians, names, "", title)
    for patch, name in zip(ax.patches, [n for n in names if n in medians], strict=True):
        if name.startswith("fastcomm-dropin-"):
            ref = medians.get("torch-" + name.rsplit("-", 1)[1])
            if ref:
                ax.annotate(f"{medians[name] / ref:.2f}x",
                            (patch.get_x() + patch.get_width() / 2, patch.get_height() * 0.5),
                            ha="center", fontsize=7, color="white")


def plot_ddp_gpu(benchmarks: list[dict], out: Path, title: str) -> Path | None:
    """Per model of ``bench/test_ddp_gpu.py``: the median step of each provider over the
    interleaved rounds, the lowest and highest round median as the error bar, and each time
    as a multiple of torch DDP's."""
    groups = [b["extra_info"] for b in _bench(benchmarks, "test_ddp_gpu_step")
              if "median_step_ms" in b.get("extra_info", {})]
    if not groups:
        return None
    names = ["torch", "fastcomm", "fastcomm-eager", "no-comm"]
    fig, axes = plt.subplots(1, len(groups), figsize=(3.2 * len(groups), 3.6), squeeze=False)
    for ax, info in zip(axes[0], groups, strict=True):
        medians, spread = info["median_step_ms"], info["round_median_spread_ms"]
        shown = [n for n in names if n in medians]
        _ddp_panel(ax, medians, shown, "torch", f"{info['group']} ({info['ranks']} rank(s), "
                   f"{info['buckets']} buckets)")
        low = [medians[n] - spread[n][0] for n in shown]
        high = [spread[n][1] - medians[n] for n in shown]
        ax.errorbar(range(len(shown)), [medians[n] for n in shown], yerr=[low, high],
                    fmt="none", ecolor="black", capsize=3, linewidth=0.8)
    axes[0][0].set_ylabel("median training step (ms)")
    return _save(fig, out / "ddp_gpu.png", title)


def load_torch_backend(paths: list[Path]) -> list[dict]:
    """The interleaved rows ``bench/test_torch_backend.py`` adds to its JSON."""
    rows: list[dict] = []
    for path in paths:
        rows += json.loads(path.read_text()).get("torch_backend", [])
    return rows


def plot_torch_backend(rows: list[dict], out: Path, title: str) -> Path | None:
    """Step time of each workload on backend fastcomm beside Gloo, labelled with the ratio."""
    steps = [r for r in rows if "ratio" in r]
    if not steps:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.0))
    width = 0.38
    for i, r in enumerate(steps):
        for dx, key, color, name in ((-width / 2, "gloo_ms", "#888", "Gloo"),
                                     (width / 2, "fastcomm_ms", "#2a7", "fastcomm")):
            ax.bar(i + dx, r[key], width, color=color, label=name if i == 0 else None)
        ax.annotate(f"{r['ratio']:.2f}x", (i + width / 2, r["fastcomm_ms"]), ha="center",
                    va="bottom", fontsize=8)
    labels = [f"{r['what'].replace(', ', chr(10))}\n{r['params'] / 1e6:.1f}M params"
              for r in steps]
    ax.set_xticks(range(len(steps)), labels, fontsize=7)
    ax.set_ylabel("median training step (ms)")
    ax.legend(fontsize=8)
    calls = [r for r in rows if "adapter_us" in r]
    sub = ""
    if calls:
        c = calls[-1]
        sub = (f"\n4 KiB all_reduce: comm {c['comm_us']:.1f} us, group {c['pg_us']:.1f} us, "
               f"dist on fastcomm {c['fastcomm_us']:.1f} us, dist on Gloo {c['gloo_us']:.0f} us")
    ax.set_title("torch DDP and FSDP2, backend fastcomm vs Gloo, 2 ranks" + sub, fontsize=8)
    return _save(fig, out / "torch_backend.png", title, 8)


def plot_kernels(benchmarks: list[dict], out: Path, title: str) -> Path | None:
    rows = [b for b in benchmarks if b["name"].startswith(("test_pack", "test_unpack",
                                                          "test_quantize", "test_dequantize"))]
    rows = [b for b in rows if b.get("extra_info", {}).get("gbps")]
    if not rows:
        return None
    copy = [b["extra_info"]["gbps"] for b in benchmarks
            if b["name"].startswith("test_copy_bandwidth") and b.get("extra_info", {}).get("gbps")]
    groups = defaultdict(dict)
    for b in rows:
        op = b["name"].split("[")[0].removeprefix("test_")
        params = b.get("params") or {}
        groups[f"{op}\n{params.get('case', '')}"][params.get("provider", "?")] = \
            b["extra_info"]["gbps"]
    labels = list(groups)
    providers = sorted({p for g in groups.values() for p in g}, key=lambda p: (p != "fastcomm", p))
    width = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(labels)), 3.8))
    for i, provider in enumerate(providers):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, [groups[lab].get(provider, 0) for lab in labels], width, label=provider)
    if copy:
        ax.axhline(copy[0], color="k", linestyle="--", linewidth=1, label="one-buffer copy_")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    return _save(fig, out / "kernels.png")


def plot_compression(benchmarks: list[dict], out: Path, title: str) -> Path | None:
    rows = [b for b in benchmarks if b["name"].startswith("test_codec_time")
            and "break_even_gbps_vs_fp32_n2" in b.get("extra_info", {})]
    if not rows:
        return None
    hooks, values = [], []
    for b in rows:
        value = b["extra_info"]["break_even_gbps_vs_fp32_n2"]
        if isinstance(value, (int, float)):
            hooks.append(b["extra_info"].get("hook", b["name"]))
            values.append(value)
    if not hooks:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.bar(hooks, values, color="#57a")
    ax.tick_params(axis="x", labelrotation=25)
    ax.set_yscale("log")
    ax.set_ylabel("pays off below this link bandwidth (GB/s)")
    ax.set_title(title, fontsize=9)
    return _save(fig, out / "compression.png")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", type=Path, help="pytest-benchmark JSON files")
    parser.add_argument("--out", type=Path, default=None, help="folder (default: the JSON's)")
    args = parser.parse_args(argv)
    if matplotlib is None:
        parser.error('the charts need matplotlib: pip install -e ".[plot]"')
    benchmarks, collectives, machine = load(args.json)
    out = args.out or args.json[0].parent
    out.mkdir(parents=True, exist_ok=True)
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("processor", "?"))
    title = f"{machine.get('node', '?')}: {cpu}"
    written = [
        plot_collectives(collectives, out, title),
        *plot_collective_ops(collectives, out, title),
        plot_ddp(benchmarks, out, title),
        plot_ddp_gpu(benchmarks, out, title),
        plot_torch_backend(load_torch_backend(args.json), out, title),
        plot_kernels(benchmarks, out, title),
        plot_compression(benchmarks, out, title),
    ]
    for path in written:
        if path is not None:
            print(path)
    if not any(written):
        print("no benchmarks in the given files that bench/plot.py knows how to chart")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
