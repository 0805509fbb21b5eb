"""One synchronized backward of the reducer: its state, armed and cleared by its owner.

``Reducer.prepare_for_backward`` arms a :class:`StepState` (:meth:`StepState.arm`); the
gradient hooks and the bucket launches advance it; the end of backward clears it
(:meth:`StepState.clear`), and so does in-place recovery, through the reducer's
``abandon_step``. Nothing outside the reducer writes it.

Note: ``Reducer._on_grad`` runs once per gradient per step. It binds this object to a local
once per call and reads the fields from it: one attribute load more per call than fields on
the reducer itself, and each field a slot (``__slots__``), no dictionary lookup. Two
per-backward flags stay on the reducer, where other objects read them on every gradient:
``expect_hooks`` (the gradient hook itself, also in ``no_sync`` backwards) and
``create_graph`` (the strategies, ``strategy.ReducerLike``).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GOT_GRAD", "SKIPPED", "UNUSED", "WAITING", "StepState"]

# a parameter's readiness in this backward (StepState.ready)
WAITING, GOT_GRAD, UNUSED = 0, 1, 2
#: The result of a bucket not reduced (``skip_all_reduce_unused_params``, or a launch after a
#: lost peer: recovery redoes the step).
SKIPPED = object()


class StepState:
    """The reducer's state of one synchronized backward (see the module docstring).

    Args:
        n_params: the reducer's parameters.
    """

    __slots__ = (
        "ready", "pending", "arrived", "next_bucket", "results", "delay", "unused_now",
        "started", "plain", "arrival_scale", "used_work", "used_map", "incomplete", "failure",
    )

    def __init__(self, n_params: int) -> None:
        # ---- armed by prepare_for_backward
        self.ready = bytearray(n_params)
        """Each parameter's readiness: ``WAITING``, ``GOT_GRAD`` or ``UNUSED``."""
        self.pending: list[int] = []
        """Per bucket: its parameters not ready yet (launched at 0, in bucket order)."""
        self.arrived: list[int] = []
        """Per bucket: its gradients packed as they arrived."""
        self.next_bucket = 0
        """The next bucket to launch, in launch order."""
        self.results: list[Any] = []
        """Per bucket: what its launch returned (``SKIPPED``: not reduced)."""
        self.delay = False
        """Launch nothing before the end of backward (a static graph's first iteration)."""
        self.unused_now: list[int] = []
        """The parameters marked unused as backward starts."""
        # ---- set as backward starts (Reducer._start_backward)
        self.started = False
        """Whether the first gradient of this backward arrived."""
        self.plain = False
        """This backward takes the plain path of ``Reducer._on_grad``."""
        self.arrival_scale = 1.0
        """The averaging factor of the arrival packs, rounded to fp32."""
        # ---- the end of backward
        self.used_work = None
        """The all-reduce of which parameters got a gradient on any rank (unused detection)."""
        self.used_map = None
        """Its tensor."""
        self.incomplete: list[int] | None = None
        """The parameters a backward ended without (its buckets unlaunched): the next forward
        raises, naming them."""
        self.failure: BaseException | None = None
        """The first lost-peer error of this backward's launches (in-place recovery: the
        launches stop, and the step is redone among the survivors at its end)."""

    def arm(self, n_params: int, bucket_sizes: list[int], delay: bool,
            unused_now: list[int]) -> None:
        """A new synchronized backward: nothing ready, nothing launched.

        Args:
            n_params: the reducer's parameters.
            bucket_sizes: each bucket's number of parameters, in launch order (the list
                becomes :attr:`pending`).
            delay: launch nothing before the end of backward.
            unused_now: the parameters to mark unused as backward starts.
        """
        self.ready = bytearray(n_params)
        self.pending = bucket_sizes
        self.arrived = [0] * len(bucket_sizes)
        self.next_bucket = 0
        self.results = [None] * len(bucket_sizes)
        self.started = False
        self.used_work = None
        self.delay = delay
        self.unused_now = unused_now

    def clear(self) -> None:
        """Drops this backward's launches, results and failure (abandoned: in-place recovery
        redid its reductions)."""
        self.results = []
        self.started = False
        self.used_work = self.used_map = None
        self.incomplete = None
        self.failure = None

    def share_used(self, comm, used_no_sync: bytearray) -> None:
        """Starts the all-reduce of which parameters got a gradient, here in this backward or
        in the ``no_sync`` ones before it (``used_no_sync``), on any rank."""
        self.used_map = torch.tensor(
            [1 if s == GOT_GRAD or u else 0 for s, u in zip(self.ready, used_no_sync, strict=True)],
            dtype=torch.int32,
            device=comm.device,
        )
        self.used_work = comm.all_reduce(self.used_map, async_op=True)

    def unused_everywhere(self) -> frozenset[int]:
        """The parameters no rank got a gradient for (waits for :meth:`share_used`'s
        all-reduce)."""
        self.used_work.wait()
        used = self.used_map.tolist()
        self.used_work = self.used_map = None
        return frozenset(i for i, u in enumerate(used) if u == 0)

    def missing(self) -> list[int]:
        """The parameters still waiting for their gradient in this backward."""
        return [i for i, s in enumerate(self.ready) if s == WAITING]
