"""Plumbing shared by the hooks that talk twice per bucket (quantized, PowerSGD).

Ordering: a hook's second collective is issued from a completion callback of its first one --
on the communicator's completion thread (Gloo), inline at enqueue (NCCL), or on one of a torch
process group's worker threads. Were it issued on the DDP's communicator it could interleave
differently with the main thread's launches on different ranks, and the collectives would
pair up wrongly. So second phases go to a private communicator (``comm.split``, made once, on
every rank at the same point), and `OrderedIssuer` makes them issue in bucket-launch order
even when callbacks run on several threads.

Error feedback (`ErrorFeedback`): residuals are kept per parameter name, as views into one
flat fp32 buffer per bucket layout. When the buckets are rebuilt, the next call of a bucket
with a new parameter list builds a new flat buffer and copies each parameter's residual over,
so nothing is lost; ``state_dict()`` holds a plain ``{name: tensor}``. After in-place recovery
replaced the first communicator, the pair is made again from its successor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from fastcomm.comm.base import Communicator

from .default import successor

__all__ = ["ErrorFeedback", "OrderedIssuer", "new_future", "PhaseComms"]


class OrderedIssuer:
    """Runs ``fn`` for tickets 0, 1, 2, ... strictly in ticket order, whatever the thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._serving = 0

    def ticket(self) -> int:
        """Called in launch order (the backward thread)."""
        t = self._issued
        self._issued += 1
        return t

    def run(self, ticket: int, fn: Callable[[], Any]) -> Any:
        """Waits for the previous ticket, runs ``fn`` (``None``: just pass the turn)."""
        with self._cond:
            while self._serving != ticket:
                self._cond.wait()
            try:
                return fn() if fn is not None else None
            finally:
                self._serving += 1
                self._cond.notify_all()


class PhaseComms:
    """The communicator of the first phase and a private one for the second."""

    def __init__(self) -> None:
        self.first: Communicator | None = None
        self.second: Communicator | None = None
        self.issuer = OrderedIssuer()

    def get(self, comm: Communicator) -> tuple[Communicator, Communicator]:
        if self.first is not None and comm is not self.first and successor(self.first) is comm:
            self._drop()  # in-place recovery replaced the first: a second split from the new
        if self.first is None:
            self.first = comm
            self.second = comm.split(0)
        elif comm is not self.first:
            raise RuntimeError(
                "a two-phase hook state was used with two different communicators; make one "
                "state per DDP"
            )
        return self.first, self.second

    def _drop(self) -> None:
        """Forgets the replaced pair; the second, split from a failed one, is closed."""
        second, self.first, self.second = self.second, None, None
        self.issuer = OrderedIssuer()
        try:
            second.close()
        except Exception:  # its communicator failed; the new pair replaces it
            pass


def new_future(device: torch.device) -> torch.futures.Future:
    """A future that carries CUDA stream order when its value lives on a GPU."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


class ErrorFeedback:
    """Per-parameter fp32 residuals laid out as one flat buffer per bucket."""

    def __init__(self) -> None:
        self.errors: dict[str, torch.Tensor] = {}
        self._layouts: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}

    def flat(self, index: int, names: list[str], numels, total: int, device):
        """The flat residual buffer (``total`` elements, zero tail) of bucket ``index``.

        Args:
            numels: the parameters' element counts, or a callable returning them (called only
                when the layout is new, so a step of an unchanged bucket loops over nothing).
        """
        key = tuple(names)
        layout = self._layouts.get(index)
        if layout is not None and layout[0] == key and layout[1].numel() == total:
            return layout[1]
        if callable(numels):
            numels = numels()
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        offset = 0
        for name, n in zip(names, numels, strict=True):
            view = flat[offset : offset + n]
            old = self.errors.get(name)
            if old is not None and old.numel() == n:
                view.copy_(old.reshape(-1))
            self.errors[name] = view
            offset += n
        self._layouts[index] = (key, flat)
        return flat

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.errors.items()}

    def load_state_dict(self, errors: dict[str, torch.Tensor]) -> None:
        self.errors = {name: t.detach().clone() for name, t in errors.items()}
        self._layouts.clear()
