"""Uneven inputs: ``with ddp.join(): ...`` lets ranks run out of data at different times.

Protocol (torch's, on a fastcomm communicator). Inside the context every forward of a rank
that still trains starts with an allreduce of ``[1, sync]`` (this rank trains; it will reduce
gradients this iteration). A rank that has left the loop runs, in ``__exit__``, the same
allreduce with ``[0, 0]``; while the sum says some rank still trains, it *shadows* one
iteration -- the bucket rebuild, the buffer broadcast and, when the others reduce, every
bucket's collective with zero gradients -- so each collective of the training ranks has a
partner. When the sum is ``[0, 0]`` everyone has joined; the model of the last rank to join
(the highest such rank) is broadcast to all.

Buffers are broadcast from the highest rank still training (rank 0 may have joined), and
gradients are divided by the initial world size unless ``divide_by_initial_world_size=False``,
in which case by the number of ranks still training (read from the same allreduce).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .broadcast import broadcast_tensors

__all__ = ["Join", "notify_join"]


class JoinsDDP(Protocol):
    """What join needs of a ``fastcomm.ddp.DDP`` (join.py does not import ddp.py)."""

    comm: Any
    reducer: Any
    config: Any
    active_join: Join | None
    require_forward_param_sync: bool

    def synced_buffers(self) -> list[torch.Tensor]: ...

    def will_sync_buffers(self) -> bool: ...


class Join:
    """The context manager returned by :meth:`DDP.join` (see the module docstring)."""

    def __init__(
        self,
        ddp: JoinsDDP,
        enable: bool = True,
        throw_on_early_termination: bool = False,
        divide_by_initial_world_size: bool = True,
    ) -> None:
        self.ddp = ddp
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def __enter__(self) -> Join:
        if self.enable:
            if self.ddp.active_join is not None:
                raise RuntimeError("DDP.join() contexts cannot be nested")
            self.ddp.active_join = self
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enable:
            return False
        ddp = self.ddp
        try:
            if exc_type is None:
                self._shadow_until_all_joined()
        finally:
            ddp.active_join = None
            ddp.reducer.scale = 1.0 / ddp.comm.size
        return False

    # ------------------------------------------------------------------ collectives
    def _count(self, mine: list[int]) -> tuple[int, int]:
        comm = self.ddp.comm
        t = torch.tensor(mine, dtype=torch.int64, device=comm.device)
        comm.all_reduce(t)
        active, syncing = t.tolist()
        return active, syncing

    def buffer_source(self, ddp: JoinsDDP, *, candidate: bool = True) -> int:
        """The highest rank still training: where buffers come from (a collective)."""
        comm = ddp.comm
        t = torch.tensor([comm.rank if candidate else -1], dtype=torch.int64, device=comm.device)
        comm.all_reduce(t, op="max")
        return int(t.item())

    def _early_termination_error(self) -> RuntimeError:
        return RuntimeError(
            f"rank {self.ddp.comm.rank}: at least one rank has exhausted its inputs "
            "(DDP.join(throw_on_early_termination=True))"
        )

    def _shadow_until_all_joined(self) -> None:
        ddp = self.ddp
        reducer = ddp.reducer
        is_last_joiner = True
        while True:
            active, syncing = self._count([0, 0])
            if active == 0:
                break
            if self.throw_on_early_termination:
                raise self._early_termination_error()
            is_last_joiner = False
            sync = syncing > 0
            if sync and reducer.rebuild_due:
                reducer.rebuild()
            if ddp.will_sync_buffers():
                buffers = ddp.synced_buffers()
                if buffers:
                    src = self.buffer_source(ddp, candidate=False)
                    broadcast_tensors(ddp.comm, buffers, src=src)
            ddp.require_forward_param_sync = sync
            if sync:
                if not self.divide_by_initial_world_size:
                    # the training ranks' factor (notify_join): an ipc shared bucket applies it
                    # to the sum, each rank to the chunk it reduces, this one's too
                    reducer.scale = 1.0 / active
                reducer.shadow_backward()
        # The last rank(s) to join hold the final model; the highest of them sends it.
        src = self.buffer_source(ddp, candidate=is_last_joiner)
        state = list(reducer.params)
        if ddp.config.forward_sync_buffers:
            state += ddp.synced_buffers()
        broadcast_tensors(ddp.comm, state, src=src)


def notify_join(ddp: JoinsDDP, sync: bool) -> None:
    """A training rank's side of the per-iteration join allreduce (see the module docstring)."""
    join = ddp.active_join
    comm = ddp.comm
    t = torch.tensor([1, int(sync)], dtype=torch.int64, device=comm.device)
    work = comm.all_reduce(t, async_op=True)
    if join.throw_on_early_termination or not join.divide_by_initial_world_size:
        work.wait()
        active = int(t[0].item())
        if join.throw_on_early_termination and active < comm.size:
            raise join._early_termination_error()
        if not join.divide_by_initial_world_size:
            ddp.reducer.scale = 1.0 / active
