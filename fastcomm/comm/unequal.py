"""The front end's calls of unequal sizes: ``all_to_all_v``, ``all_to_all_split``, ``gather``,
``scatter``, ``all_gather_v``, ``reduce_scatter_v`` (the parent of :class:`~.base.Communicator`).

Each is one v-call (:mod:`.vcoll`): every rank sends a piece of any size to every rank; the
ranks' sizes are compared inside the call, a disagreement a ``SizesDisagreement`` (a
``ValueError``) on every rank. Each checks its pieces before anything is sent, counts and
records the call as every public call is, and hands it to the backend's typed op
(``_impl_v_call``; ``_impl_gather``, ``_impl_scatter`` and ``_impl_all_to_all_split`` take the
caller's tensors with no list of pieces made), ``blocking`` where the caller waits.

The torch backend's waited-for ``gather``, ``scatter`` and ``all_to_all_single`` with split
sizes ask for the call at once (:meth:`UnequalCalls.try_gather`, ``try_scatter``,
``try_all_to_all_split``): done where every tensor is a contiguous CPU tensor of one dtype,
else nothing done, for the caller to stage the tensors or hand the call on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .adapt import followed_by, rooted_pieces
from .backend import CommBackend, VKind
from .checks import check_pieces, check_splits, check_tensor, reject_premul
from .flight import recorded, run_recorded
from .reduction import torch_reduce
from .types import ReduceOp
from .vcoll import input_bytes, plain_pieces, split_bytes
from .work import Task, Work

if TYPE_CHECKING:
    from .base import Communicator
    from .flight import FlightRecorder
    from .stats import CommStats

__all__ = ["UnequalCalls"]

_Tensor = torch.Tensor
_STRIDED = torch.strided


class UnequalCalls(CommBackend):
    """The calls of unequal sizes of every communicator (module docstring)."""

    stats: CommStats
    flight: FlightRecorder | None

    @recorded("all_to_all_v", 1)
    def all_to_all_v(self, outputs: list, inputs: list, async_op: bool = False) -> Work | None:
        """Sends ``inputs[r]`` to rank ``r``; ``outputs[q]`` receives what rank ``q`` sends
        this rank. Pieces of any size (empty too), one dtype.

        Raises:
            TypeError, ValueError: bad pieces (:func:`~.checks.check_pieces`).
            SizesDisagreement: (a ``ValueError``) on every rank, when a piece's size differs
                from what its receiver expects.
        """
        return self._v_call("all_to_all", -1, outputs, inputs, async_op)

    @recorded("all_to_all_v", 1)
    def all_to_all_split(self, output: torch.Tensor, input: torch.Tensor,
                         output_splits: list[int], input_splits: list[int],
                         async_op: bool = False) -> Work | None:
        """:meth:`all_to_all_v` of consecutive row blocks of one tensor each side, as torch's
        ``all_to_all_single`` with split sizes: rows ``input_splits[r]`` of ``input`` (along
        dim 0, in rank order) go to rank ``r``; ``output_splits[q]`` rows of ``output`` come from
        rank ``q``. No tensor is made per piece where the backend takes the offsets
        (``_impl_all_to_all_split``).

        Raises:
            TypeError, ValueError: as for :meth:`all_to_all_v`; splits that are not ``size``
                non-negative ints summing to the tensor's rows.
        """
        size = self.size
        if (self._closed or input.__class__ is not torch.Tensor
                or not plain_pieces((output, input), input)):  # these checks name what is wrong
            self._check_v("all_to_all", (output,) * size, (input,) * size)
        byte_splits = split_bytes(size, output, input, output_splits, input_splits)
        if byte_splits is None:  # raises, naming what is wrong
            byte_splits = check_splits(size, output, input, output_splits, input_splits)
        self.stats.count("all_to_all", input.nbytes)
        target = self if input.is_cpu and self._cpu_native else self.route(input.device,
                                                                            "all_to_all")
        task = target._impl_all_to_all_split(output, input, output_splits, input_splits,
                                             byte_splits, not async_op)
        return None if task is None else self._run(task, async_op)

    @recorded("gather", 1, 2, "root")
    def gather(self, outputs: list | None, input: torch.Tensor, root: int = 0,
               async_op: bool = False) -> Work | None:
        """Writes every rank's ``input`` into ``outputs[q]`` of rank ``root`` (``outputs``:
        one tensor per rank on the root, ignored elsewhere; sizes may differ by rank)."""
        inputs, outputs, checked = rooted_pieces(self.rank, self.size, "gather", input,
                                                 outputs, root)
        return self._v_call("gather", root, outputs, inputs, async_op, checked)

    @recorded("scatter", 0, 2, "root")
    def scatter(self, output: torch.Tensor, inputs: list | None, root: int = 0,
                async_op: bool = False) -> Work | None:
        """Writes ``inputs[r]`` of rank ``root`` into ``output`` of rank ``r`` (``inputs``:
        one tensor per rank on the root, ignored elsewhere)."""
        outputs, inputs, checked = rooted_pieces(self.rank, self.size, "scatter", output,
                                                 inputs, root)
        return self._v_call("scatter", root, outputs, inputs, async_op, checked)

    @recorded("all_gather_v", 1)
    def all_gather_v(self, outputs: list, input: torch.Tensor,
                     async_op: bool = False) -> Work | None:
        """Writes every rank's ``input`` into ``outputs[q]`` of every rank (sizes may differ
        by rank, as NCCL's ``all_gather`` of a list allows)."""
        return self._v_call("all_gather", -1, outputs, [input] * self.size, async_op)

    @recorded("reduce_scatter_v", 0, 2, "op")
    def reduce_scatter_v(self, output: torch.Tensor, inputs: list,
                         op: ReduceOp | str = ReduceOp.SUM, async_op: bool = False,
                         ) -> Work | None:
        """Reduces ``inputs[r]`` of every rank into ``output`` of rank ``r``, in rank order
        (sizes may differ by rank: ``inputs[r]`` has ``output``'s size on rank ``r``).

        Raises:
            TypeError: a ``PremulSum``; as for :meth:`all_to_all_v`.
        """
        op = ReduceOp.coerce(op)
        reject_premul(op, "reduce_scatter")
        check_tensor(output, "reduce_scatter", "output")
        terms = [torch.empty_like(output) for _ in range(self.size)]
        target, terms, inputs = self._v_target("reduce_scatter", terms, inputs)
        task = target._impl_v_call("reduce_scatter", -1, terms, inputs)
        return self._run(followed_by(task, lambda: torch_reduce(output, terms, op)), async_op)

    # ------------------------------------------------------------------ at once, or not at all
    def try_gather(self, outputs: list | None, input: torch.Tensor, root: int) -> bool:
        """A synchronous :meth:`gather` done, ``True``, where every tensor is a contiguous CPU
        tensor of one dtype; else ``False`` having done nothing (the torch backend then stages
        the tensors or hands the call on). Counted and recorded as :meth:`gather` counts and
        records its calls.

        Raises:
            ValueError: ``root`` out of range (as :meth:`gather` raises it).
        """
        return self._try_rooted("gather", self._impl_gather, input, outputs, root)

    def try_scatter(self, output: torch.Tensor, inputs: list | None, root: int) -> bool:
        """:meth:`try_gather` of a :meth:`scatter`."""
        return self._try_rooted("scatter", self._impl_scatter, output, inputs, root)

    def try_all_to_all_split(self, output: torch.Tensor, input: torch.Tensor,
                             output_splits: Sequence[int], input_splits: Sequence[int]) -> bool:
        """A synchronous :meth:`all_to_all_split` done, ``True``, where both tensors are
        contiguous CPU tensors of one dtype and the splits are valid; else ``False`` having
        done nothing. Counted and recorded as :meth:`all_to_all_split` counts and records its
        calls."""
        if (self._closed or not self._cpu_native or input.__class__ is not _Tensor
                or not input.is_cpu or not plain_pieces((output, input), input)):
            return False
        byte_splits = split_bytes(self.size, output, input, output_splits, input_splits)
        if byte_splits is None:
            return False
        self.stats.count("all_to_all", input.nbytes)
        run_recorded(self.flight, "all_to_all_v", input, None, self._split_now, output, input,
                     output_splits, input_splits, byte_splits)
        return True

    def _split_now(self, output, input, output_splits, input_splits, byte_splits) -> None:
        task = self._impl_all_to_all_split(output, input, output_splits, input_splits,
                                           byte_splits, True)
        if task is not None:
            self._run(task, False)

    def _try_rooted(self, kind: VKind, impl: Callable[..., Task | None], mine: torch.Tensor,
                    theirs: list | None, root: int) -> bool:
        """:meth:`try_gather` (``kind``; ``impl``: the backend's op; ``mine``: the input,
        ``theirs``: the root's outputs) or :meth:`try_scatter` (``mine``: the output,
        ``theirs``: the root's inputs)."""
        size = self.size
        if (root.__class__ is not int or not 0 <= root < size or mine.__class__ is not _Tensor
                or not mine.is_cpu or mine.layout is not _STRIDED or not mine.is_contiguous()
                or self._closed or not self._cpu_native):
            return self._try_rooted_general(kind, mine, theirs, root)
        gather = kind == "gather"
        if self.rank != root:
            nbytes = mine.nbytes if gather else 0
        elif theirs.__class__ is not list or len(theirs) != size:
            return self._try_rooted_general(kind, mine, theirs, root)
        elif plain_pieces(theirs, mine):
            nbytes = mine.nbytes if gather else input_bytes(theirs)
        else:
            return self._try_rooted_general(kind, mine, theirs, root)
        self.stats.count(kind, nbytes)
        # recorded as gather / scatter record their calls
        run_recorded(self.flight, kind, mine, root, self._rooted_now, impl, mine, theirs, root)
        return True

    def _rooted_now(self, impl, mine: torch.Tensor, theirs: list | None, root: int) -> None:
        task = impl(mine, theirs, root, True)
        if task is not None:
            self._run(task, False)

    def _try_rooted_general(self, kind: VKind, mine: torch.Tensor, theirs: list | None,
                            root: int) -> bool:
        """:meth:`_try_rooted` of anything but its usual call: every check of
        :func:`~.adapt.rooted_pieces`."""
        pieces, others, checked = rooted_pieces(self.rank, self.size, kind, mine, theirs, root)
        if checked < 0 or self._closed or not self._cpu_native:
            return False
        outputs, inputs = (others, pieces) if kind == "gather" else (pieces, others)
        self.stats.count(kind, checked)
        # recorded as gather / scatter record their calls
        run_recorded(self.flight, kind, mine, root, self._v_now, kind, root, outputs, inputs)
        return True

    def _v_now(self, kind: VKind, root: int, outputs: list, inputs: list) -> None:
        task = self._impl_v_call(kind, root, outputs, inputs, True)
        if task is not None:
            self._run(task, False)

    # ------------------------------------------------------------------ the v-call
    def _v_call(self, kind: VKind, root: int, outputs, inputs, async_op: bool,
                checked: int = -1) -> Work | None:
        """A v-call, checked, counted and run; ``checked``: the bytes of the inputs where the
        caller checked the pieces already (lists of contiguous CPU tensors of one dtype), else
        -1."""
        if checked < 0 or async_op or self._closed or not self._cpu_native:
            target, outputs, inputs = self._v_target(kind, outputs, inputs)
        else:  # the usual synchronous call: the caller's checks are check_pieces'
            self.stats.count(kind, checked)
            target = self
        task = target._impl_v_call(kind, root, outputs, inputs, not async_op)
        return None if task is None else self._run(task, async_op)

    def _v_target(self, kind: VKind, outputs, inputs) -> tuple[Communicator, list, list]:
        """Checks a v-call and counts it: ``(the communicator that moves it, outputs,
        inputs)`` (that one stages inputs overlapping outputs where its schedule needs it)."""
        outputs, inputs = self._check_v(kind, outputs, inputs)
        first = inputs[0]
        self.stats.count(kind, input_bytes(inputs))
        if first.is_cpu and self._cpu_native:  # _target inlined
            return self, outputs, inputs
        return self.route(first.device, kind), outputs, inputs

    def _check_v(self, op: str, outputs: Sequence, inputs: Sequence) -> tuple[list, list]:
        """The pieces of a v-call of this communicator, checked (:func:`~.checks.
        check_pieces`), as lists.

        Raises:
            CommClosedError: after ``close()``.
        """
        if self._closed:
            self._check_open(op)
        return check_pieces(self.size, op, outputs, inputs)
