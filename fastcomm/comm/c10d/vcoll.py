"""The c10d calls of unequal sizes, on the group's communicator (its v-calls, ``comm.vcoll``):
``gather``, ``scatter``, ``all_to_all_single`` with split sizes, ``all_to_all`` of lists,
``all_gather`` / ``reduce_scatter`` lists of unequal sizes (as NCCL takes them),
``allgather_coalesced``; and so the object collectives torch builds on them (``gather_object``:
``allgather`` + ``gather``; ``scatter_object_list``: ``broadcast`` + ``scatter`` x2;
``all_gather_object``: ``allgather`` x2; ``broadcast_object_list``: ``broadcast`` x2).

Any dtype moves (the pieces go as bytes; the ranks still agree on the dtype); a non-contiguous
input is sent from a contiguous copy, a non-contiguous output receives into one that is copied
back. The ranks' sizes are compared inside the call: a disagreement is a ``ValueError`` on every
rank, the group still usable. Sparse tensors, and a device map's CUDA backend, are handed on
unchanged (:meth:`FastcommProcessGroup._forward`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from ..types import ReduceOp
from .multi import copier

_STRIDED = torch.strided


_GatherOptions, _ScatterOptions = dist.GatherOptions, dist.ScatterOptions


def _options_of(opts: Any, cls: type) -> Any:
    """torch's options object, or a default one for a call made without (``pg.gather(o, i)``)."""
    return opts if opts.__class__ is cls or isinstance(opts, cls) else cls()


def _dense(tensors) -> bool:
    return all(t.layout is _STRIDED for t in tensors)


def _sendable(tensors: list) -> list:
    """``tensors``, each non-contiguous one as a contiguous copy (the same copy where a tensor
    appears twice)."""
    if all(t.is_contiguous() for t in tensors):
        return tensors
    copies: dict[int, torch.Tensor] = {}
    return [t if t.is_contiguous() else copies.setdefault(id(t), t.contiguous())
            for t in tensors]


def _receivable(tensors: list) -> tuple[list, Any]:
    """``(buffers, post)``: ``tensors``, each non-contiguous one replaced by a contiguous buffer
    that ``post`` copies back (``None``: all contiguous)."""
    if all(t.is_contiguous() for t in tensors):
        return tensors, None
    # fresh buffers: the call overwrites them, so the old values need not be copied in
    pairs = [(t, torch.empty_like(t, memory_format=torch.contiguous_format))
             for t in tensors if not t.is_contiguous()]
    staged = {id(t): s for t, s in pairs}
    copies = [copier(t, s) for t, s in pairs]  # outside autograd, as Gloo writes them

    def post() -> None:
        for copy in copies:
            copy()

    return [staged.get(id(t), t) for t in tensors], post


def _splits(t: torch.Tensor, splits, size: int) -> list | None:
    """The rows ``t`` gives each rank along dim 0 (``splits``; empty: evenly), or ``None``
    where torch's ``all_to_all_single`` would refuse (then Gloo's error is the user's)."""
    if t.dim() == 0:
        return None
    rows = t.shape[0]
    if not splits:
        if rows % size:
            return None
        return [rows // size] * size
    if len(splits) != size or sum(splits) != rows or min(splits) < 0:
        return None
    return list(splits)


class VCollOps:
    """The group methods of unequal sizes (mixed into ``FastcommProcessGroup``)."""

    def _v_issue(self, op: str, outputs: list, opts: Any, fn, *args, post=None):
        return self._issue(op, outputs, opts.asyncOp, fn, *args, post=post)

    def gather(self, output_tensors, input_tensors, opts=None):
        if opts.__class__ is not _GatherOptions:
            opts = _options_of(opts, _GatherOptions)
        root = opts.rootRank
        if len(input_tensors) == 1 and not opts.asyncOp and self._coalescing is None:
            # the usual call (contiguous CPU tensors, waited for): the communicator does it
            outs = None if self._rank != root else (
                output_tensors[0] if len(output_tensors) == 1 else False)
            if outs is not False and self.communicator.try_gather(outs, input_tensors[0],
                                                                  root):
                return self._done(output_tensors)
        comm = self._comm_for(input_tensors[0]) if len(input_tensors) == 1 else None
        outs = output_tensors[0] if output_tensors else None
        if (comm is None or not _dense(input_tensors)
                or (self._rank == root and (len(output_tensors) != 1 or not _dense(outs)))):
            return self._forward("gather", output_tensors, input_tensors[0], output_tensors,
                                 input_tensors, opts)
        post = None
        if self._rank == root:
            outs, post = _receivable(list(outs))
        (input,) = _sendable(input_tensors)
        return self._v_issue("gather", output_tensors, opts, comm.gather,
                             outs if self._rank == root else None, input, root, post=post)

    def scatter(self, output_tensors, input_tensors, opts=None):
        if opts.__class__ is not _ScatterOptions:
            opts = _options_of(opts, _ScatterOptions)
        root = opts.rootRank
        if len(output_tensors) == 1 and not opts.asyncOp and self._coalescing is None:
            # the usual call (contiguous CPU tensors, waited for): the communicator does it
            ins = None if self._rank != root else (
                input_tensors[0] if len(input_tensors) == 1 else False)
            if ins is not False and self.communicator.try_scatter(output_tensors[0], ins,
                                                                  root):
                return self._done(output_tensors)
        comm = self._comm_for(output_tensors[0]) if len(output_tensors) == 1 else None
        ins = input_tensors[0] if input_tensors else None
        if (comm is None or not _dense(output_tensors)
                or (self._rank == root and (len(input_tensors) != 1 or not _dense(ins)))):
            return self._forward("scatter", output_tensors, output_tensors[0], output_tensors,
                                 input_tensors, opts)
        (output,), post = _receivable(list(output_tensors))
        ins = _sendable(list(ins)) if self._rank == root else None
        return self._v_issue("scatter", output_tensors, opts, comm.scatter, output, ins, root,
                             post=post)

    def alltoall(self, output_tensors, input_tensors, opts=None):
        opts = _options_of(opts, dist.AllToAllOptions)
        comm = self._comm_for(input_tensors[0]) if input_tensors else None
        if comm is None or not _dense(output_tensors) or not _dense(input_tensors):
            return self._forward("alltoall", output_tensors, input_tensors[0], output_tensors,
                                 input_tensors, opts)
        outs, post = _receivable(list(output_tensors))
        return self._v_issue("alltoall", output_tensors, opts, comm.all_to_all_v, outs,
                             _sendable(list(input_tensors)), post=post)

    def _all_to_all_split(self, output, input, output_split_sizes, input_split_sizes, opts):
        """``all_to_all_single`` with split sizes (or dtypes the even path does not take)."""
        if (output_split_sizes and input_split_sizes and not opts.asyncOp
                and self._coalescing is None and self.communicator.try_all_to_all_split(
                    output, input, output_split_sizes, input_split_sizes)):
            # the usual call (contiguous CPU tensors, valid splits, waited for): done
            return self._done([output])
        comm = self._comm_for(input)
        if comm is not None and output.layout is _STRIDED and input.layout is _STRIDED:
            send = input if input.is_contiguous() else input.contiguous()
            recv = output if output.is_contiguous() else torch.empty_like(
                output, memory_format=torch.contiguous_format)
            ins = _splits(send, input_split_sizes, self._size)
            outs = _splits(recv, output_split_sizes, self._size)
            if ins is not None and outs is not None and send.dtype == recv.dtype:
                post = None if recv is output else copier(output, recv)
                return self._v_issue("all_to_all_single", [output], opts,
                                     comm.all_to_all_split, recv, send, outs, ins, post=post)
        return self._forward("all_to_all_single", [output], input, output, input,
                             output_split_sizes, input_split_sizes, opts)

    def _allgather_v(self, output_tensors, input_tensors, opts):
        """``allgather`` of one input into outputs of unequal sizes (NCCL's semantics)."""
        comm = self._comm_for(input_tensors[0]) if len(input_tensors) == 1 else None
        if (comm is None or len(output_tensors) != 1 or not _dense(output_tensors[0])
                or not _dense(input_tensors)):
            return self._forward("allgather", output_tensors, input_tensors[0], output_tensors,
                                 input_tensors, opts)
        outs, post = _receivable(list(output_tensors[0]))
        (input,) = _sendable(input_tensors)
        return self._v_issue("allgather", output_tensors, opts, comm.all_gather_v, outs, input,
                             post=post)

    def _reduce_scatter_v(self, output_tensors, input_tensors, op, opts):
        """``reduce_scatter`` of inputs of unequal sizes (NCCL's semantics), reduced in rank
        order on each receiver; ``op``: the contract's (``None``: handed on)."""
        output = output_tensors[0]
        comm = self._comm_for(output) if len(output_tensors) == 1 else None
        inputs = input_tensors[0] if len(input_tensors) == 1 else None
        if comm is None or op is None or inputs is None or not _dense([output, *inputs]):
            return self._forward("reduce_scatter", output_tensors, output, output_tensors,
                                 input_tensors, opts)
        (out,), post = _receivable([output])
        factor = getattr(op, "factor", None)
        if factor is not None:  # a PremulSum: the scaled copies are summed (as NCCL does)
            inputs, op = [t * factor for t in inputs], ReduceOp.SUM
        return self._v_issue("reduce_scatter", output_tensors, opts, comm.reduce_scatter_v, out,
                             _sendable(list(inputs)), op, post=post)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """Several inputs gathered as one v-call: each rank's inputs packed end to end as
        bytes, unpacked into its row of outputs."""
        opts = _options_of(opts, AllgatherOptions)
        comm = self._comm_for(input_list[0]) if input_list else None
        rows_ok = len(output_lists) == self._size and all(
            len(row) == len(input_list) for row in output_lists)
        if comm is None or not rows_ok or not _dense(input_list) or not all(
                _dense(row) for row in output_lists):
            return self._forward("allgather_coalesced", output_lists, input_list[0],
                                 output_lists, input_list, opts)
        packed = torch.cat([t.reshape(-1).view(torch.uint8) for t in input_list])
        landing = [packed.new_empty(sum(o.nbytes for o in row)) for row in output_lists]

        def unpack() -> None:
            for row, flat in zip(output_lists, landing, strict=True):
                offset = 0
                for out in row:
                    piece = flat[offset : offset + out.nbytes]
                    offset += out.nbytes
                    if out.is_contiguous():
                        out.reshape(-1).view(torch.uint8).copy_(piece)
                    else:
                        out.copy_(piece.clone().view(out.dtype).view(out.shape))

        return self._v_issue("allgather_coalesced", output_lists, opts, comm.all_gather_v,
                             landing, packed, post=unpack)
