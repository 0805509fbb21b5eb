"""``--numa-binding``: the CPUs each worker is bound to, computed as torchrun 2.13 does.

torchrun binds the worker of local rank ``r`` to CPUs near GPU ``cuda:r`` (``node``: the CPUs of
its NUMA node; ``socket``: of every NUMA node of its socket; ``exclusive``: an even share of
its NUMA node's CPUs per GPU there; ``core-complex``: one L3 cache group), by starting the
worker under ``numactl --physcpubind``. fastcomm-run computes the same CPU sets with torch's
own code (``torch.numa.binding``) once, before anything starts, and the worker's bootstrap
binds itself with ``sched_setaffinity`` before the script runs (so ``numactl`` is not needed;
threads and children inherit the binding, as under ``numactl``).

Without CUDA there is no GPU to be near: the flag is refused (torchrun fails the same way,
when its first worker starts).
"""

from __future__ import annotations

__all__ = ["NUMA_MODES", "worker_cpus"]

#: torch 2.13's ``AffinityMode`` values (the flag's choices).
NUMA_MODES = ("node", "socket", "exclusive", "core-complex")


def worker_cpus(mode: str, nproc_per_node: int) -> tuple[str, ...]:
    """The CPU list (sysfs syntax) of each local rank under ``--numa-binding mode``.

    Raises:
        ValueError: naming the flag and its value: CUDA is not available, there are fewer GPUs
            than workers, this torch has no NUMA binding, or the topology cannot be read.
    """
    flag = f"--numa-binding {mode}"
    if mode not in NUMA_MODES:
        raise ValueError(f"{flag}: the mode must be one of {', '.join(NUMA_MODES)}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            f"{flag} binds worker LOCAL_RANK to the CPUs near GPU cuda:LOCAL_RANK, but CUDA is "
            "not available on this machine; run without --numa-binding (workers keep every CPU)"
        )
    count = torch.cuda.device_count()
    if nproc_per_node > count:
        raise ValueError(
            f"{flag} binds each worker near its own GPU, but there are {nproc_per_node} "
            f"workers per node and {count} GPUs"
        )
    try:
        from torch.numa.binding import (
            AffinityMode,
            NumaOptions,
            _get_logical_cpus_to_bind_to,
            _get_ranges_str_from_ints,
        )
    except ImportError as exc:
        raise ValueError(f"{flag}: this torch has no NUMA binding ({exc})") from None
    options = NumaOptions(affinity_mode=AffinityMode(mode))
    lists = []
    for local_rank in range(nproc_per_node):
        try:
            cpus = _get_logical_cpus_to_bind_to(gpu_index=local_rank, numa_options=options)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ValueError(
                f"{flag}: cannot find the CPUs near cuda:{local_rank} ({exc})"
            ) from None
        if not cpus:
            raise ValueError(f"{flag}: no CPU this process may use is near cuda:{local_rank}")
        lists.append(_get_ranges_str_from_ints(cpus))
    return tuple(lists)
