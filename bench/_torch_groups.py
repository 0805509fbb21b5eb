"""The rank side of the torch.distributed benchmarks: the fastcomm default group and a Gloo
group beside it, over the rank pool's store."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from tests.harness import rank_store


def init_groups(prefix: str, timeout: float) -> dict:
    """``init_process_group("fastcomm")`` in the store namespace ``prefix``, one torch thread;
    returns ``{"fastcomm": the default group, "gloo": a Gloo group of the same ranks}``."""
    import torch.distributed as dist

    import fastcomm  # noqa: F401 - registers the backend

    torch.set_num_threads(1)
    store = dist.PrefixStore(prefix, rank_store().torch_store)
    dist.init_process_group("fastcomm", store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timedelta(seconds=timeout))
    return {"fastcomm": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
