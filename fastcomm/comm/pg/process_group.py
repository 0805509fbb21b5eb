"""Collectives on a torch ``ProcessGroup``: the one implementation behind the Gloo communicator
(a ``ProcessGroupGloo`` fastcomm builds on its own store) and ``TorchPGCommunicator`` (a group a
script made with ``torch.distributed``).

Completion: the backend's one ``Work``, :class:`PGWork`, over torch's handle, is finished by
whoever first needs it done, on that thread: ``wait()`` waits on the handle and then applies
what the backend lacks (``AVG`` as ``SUM`` then a division), once; ``get_future()`` chains the
same onto the handle's own future (run on the backend's thread; stream-aware on a CUDA group).
No thread of ours sits between the backend and the caller, so a DDP bucket costs no thread
hand-off: the tasks of this backend are issued at once (torch orders them) and return that
``Work``. A handle without a future (Gloo's ``reduce_scatter``), or of a communicator armed
for a lost rank (``loss_grace``), is waited on by the executor thread when a future is asked for.
A lost rank: :meth:`ProcessGroupCommunicator.abort` (any thread) makes the collectives' host
waits raise ``CommAbortedError`` within two ``abort_slice_s`` unless their operation ended (not
``send``/``recv``'s: a timed Gloo p2p wait fails its operation) and refuses later calls; a
failure on a peer's closed connection waits up to ``loss_grace`` for that abort to name the
loss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from ..base import Communicator
from ..errors import CommAbortedError
from ..store import as_timedelta
from ..types import ReduceOp, divide_
from ..work import SettledByWait, Task, Work, wrap_error

__all__ = ["PGWork", "ProcessGroupCommunicator"]

# ops whose handle is waited on in one piece: a Gloo send or recv whose timed wait runs out is
# failed by it (and the pairs it used closed), so no abort slice applies to them
_WHOLE_WAITS = frozenset({"send", "recv"})
# what Gloo's errors say when a peer's connection went (its process or its host is gone)
_CONNECTION_LOST = ("connection closed", "connection reset", "broken pipe", "no route to host",
                    "connection refused", "socket closed")

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class PGWork(SettledByWait, Work):
    """A ``Work`` over a torch handle, finished on the thread that first needs it done.

    ``Work.__init__`` is not called: its latch would be built on every call for nothing; the
    future is made only by ``get_future()``. On a CUDA group ``wait()`` without a timeout
    orders the caller's stream after the collective and does not block the host (torch's
    own semantics); with one, or on a CPU group, the host waits.
    """

    def __init__(self, comm: ProcessGroupCommunicator, op, output, handle, post) -> None:
        self.op = op
        self.rank = comm.rank
        self.output = output
        self.start = time.monotonic()
        self._comm = comm
        self._handle = handle
        self._post = post
        self._lock = threading.Lock()  # post runs once, from wait() or the future's callback
        self._finished = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None

    def _finish(self, exc: BaseException | None = None) -> None:
        with self._lock:
            if self._finished:
                return
            try:
                if exc is not None:
                    why = None if isinstance(exc, CommAbortedError) else self._comm.lost(exc)
                    if why is not None:
                        raise CommAbortedError(
                            f"rank {self.rank}: {self.op} failed after "
                            f"{time.monotonic() - self.start:.1f} s: {why}"
                        ) from exc
                    raise exc
                if self._post is not None:
                    self._post()
            except BaseException as error:  # kept for every later wait() and exception()
                self._error = wrap_error(self.op, self.rank, self.start, error)
            self._finished = True
        if self._flight is not None:  # its call ends in the flight recorder
            self.record_end(self._error)

    def record_in(self, recorder, seq: int) -> None:
        self._flight = (recorder, seq)
        if self._finished:
            self.record_end(self._error)

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        if not self._finished:
            if timeout is not None:
                limit = as_timedelta(timeout, None)
            elif self._comm.device.type == "cuda":
                limit = None  # stream order only: the host does not block
            else:
                limit = self._comm.timeout
            try:
                if limit is None:
                    self._handle.wait()
                elif self._comm.abort_slice_s and self.op not in _WHOLE_WAITS:
                    self._wait_in_slices(limit)
                else:
                    self._handle.wait(limit)
            except RuntimeError as exc:
                if timeout is not None and not self._handle.is_completed():
                    # the caller's own limit: the operation is left running, as Work.wait
                    raise wrap_error(self.op, self.rank, self.start, exc) from exc
                self._finish(exc)
            else:
                self._finish()
        if self._error is not None:
            raise self._error
        return True

    def _wait_in_slices(self, limit: timedelta) -> None:
        """Waits up to ``limit`` in slices, raising ``CommAbortedError`` once the communicator
        was aborted (a Gloo wait on a peer that went silent returns only at its timeout)."""
        comm, handle = self._comm, self._handle
        piece = timedelta(seconds=comm.abort_slice_s)
        deadline = time.monotonic() + limit.total_seconds()
        while True:
            if comm._aborted is not None:
                try:  # done before the abort (its data had come, its waiter came late): it
                    handle.wait(piece)  # stands, as on the ranks that waited in time
                    return
                except RuntimeError:
                    pass
                raise CommAbortedError(
                    f"rank {self.rank}: {self.op} failed after "
                    f"{time.monotonic() - self.start:.1f} s: {comm._aborted}"
                )
            left = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
            try:
                handle.wait(min(piece, left))
                return
            except RuntimeError:
                if handle.is_completed():  # its own error, or done just as the slice ran out
                    handle.wait()
                    return
                if time.monotonic() >= deadline:
                    raise

    def _inner_done(self) -> bool:
        return self._handle.is_completed()

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            try:
                native = self._handle.get_future()
            except (RuntimeError, NotImplementedError, AttributeError):
                native = None
            if native is None or self._comm.loss_grace:  # a wait abort() stops
                waiter = Task(self.op, self.output, self.wait)
                self._future = self._comm._executor.run(waiter, async_op=True).get_future()
            else:  # torch's future: stream-aware on a CUDA group
                self._future = native.then(self._resolve)
        return self._future

    def _resolve(self, native: torch.futures.Future):
        try:
            native.value()
        except BaseException as exc:  # the collective failed: the chained future fails too
            self._finish(exc)
        else:
            self._finish()
        if self._error is not None:
            raise self._error
        return self.output


class ProcessGroupCommunicator(Communicator):
    """A ``Communicator`` whose collectives run on ``self.process_group``.

    Subclasses set ``process_group`` and ``native_avg`` (whether the backend has ``AVG``) in
    their constructor.
    """

    process_group: dist.ProcessGroup
    native_avg: bool = False
    abort_slice_s: float = 0.0
    """Seconds a host wait sleeps before it looks whether :meth:`abort` was called (0: one
    wait to the timeout; Gloo's default, and ``hier`` sets it on its Gloo parts)."""
    loss_grace: float = 0.0
    """Seconds a call that failed because a peer's connection went waits for :meth:`abort` to
    name the lost rank before its own error stands (in-place recovery sets it)."""
    _aborted: BaseException | None = None
    # all_reduce's options and whether AVG is emulated, by the op's name (filled on first use)
    _allreduce_opts: dict[str, tuple[dist.AllreduceOptions, bool]]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._allreduce_opts = {}

    def abort(self, error: BaseException) -> None:
        """From any thread: the host waits of pending operations raise ``CommAbortedError``
        naming ``error`` within ``abort_slice_s`` (the operations themselves run on in the
        backend until they end or time out); later calls raise it at once."""
        if self._aborted is None:
            self._aborted = error

    def lost(self, exc: BaseException) -> BaseException | None:
        """The lost rank behind the failure ``exc``: named by :meth:`abort` already, or within
        ``loss_grace`` where ``exc`` says a peer's connection went (a timeout is a hang)."""
        text = str(exc).lower()
        went = self.loss_grace > 0 and any(word in text for word in _CONNECTION_LOST)
        deadline = time.monotonic() + (self.loss_grace if went else 0.0)
        while self._aborted is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._aborted

    def _refuse(self, op: str) -> CommAbortedError:
        return CommAbortedError(f"rank {self.rank}: {op} refused: {self._aborted}")

    def _issue(
        self,
        op: str,
        output: torch.Tensor | None,
        issue: Callable[[], object],
        post: Callable[[], None] | None = None,
    ) -> Work:
        if self._aborted is not None:
            raise self._refuse(op)
        try:
            handle = issue()
        except RuntimeError as exc:
            raise wrap_error(op, self.rank, time.monotonic(), exc) from exc
        return PGWork(self, op, output, handle, post)

    def _reduce_op(self, op: ReduceOp, tensor: torch.Tensor):
        """torch's op for ``op`` and the post-processing it needs (``AVG`` emulation)."""
        if op is ReduceOp.AVG and not self.native_avg:
            return dist.ReduceOp.SUM, (lambda: divide_(tensor, self.size))
        return _TORCH_OPS[op], None

    def _issue_task(self, op: str, output: torch.Tensor | None, issue, post=None) -> Task:
        """A task that issues the native collective (``issue`` returns torch's handle) and
        returns the ``Work`` that completes it; ``post`` runs once the handle is done (see
        :meth:`_issue`)."""
        return Task(op, output, partial(self._issue, op, output, issue, post))

    # ------------------------------------------------------------------ collectives
    def _impl_all_reduce(self, tensor: torch.Tensor, op: ReduceOp,
                         blocking: bool = False) -> Task:
        # the hot call of DDP over a torch group: the options are made once per op (torch
        # reads them at issue), and nothing is looked up by Enum (its hash runs Python code)
        cached = self._allreduce_opts.get(op._name_)
        if cached is None:
            opts = dist.AllreduceOptions()
            opts.reduceOp, divide = self._reduce_op(op, tensor)
            cached = self._allreduce_opts[op._name_] = (opts, divide is not None)
        opts, emulated_avg = cached
        post = partial(divide_, tensor, self.size) if emulated_avg else None
        return Task("all_reduce", tensor, partial(self._issue_all_reduce, tensor, opts, post))

    def _issue_all_reduce(self, tensor: torch.Tensor, opts, post) -> Work:
        """:meth:`_issue` of an all_reduce, without its closure (a call fewer per bucket)."""
        if self._aborted is not None:
            raise self._refuse("all_reduce")
        try:
            handle = self.process_group.allreduce([tensor], opts)
        except RuntimeError as exc:
            raise wrap_error("all_reduce", self.rank, time.monotonic(), exc) from exc
        return PGWork(self, "all_reduce", tensor, handle, post)

    def _impl_broadcast(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        pg = self.process_group
        return self._issue_task("broadcast", tensor, lambda: pg.broadcast([tensor], opts))

    def _impl_all_gather(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task:
        out_flat, in_flat, pg = output.view(-1), input.view(-1), self.process_group
        return self._issue_task("all_gather", output, lambda: pg._allgather_base(out_flat, in_flat))

    def _impl_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp,
                             blocking: bool = False) -> Task:
        opts = dist.ReduceScatterOptions()
        opts.reduceOp, post = self._reduce_op(op, output)
        out_flat, in_flat = output.view(-1), input.view(-1)
        pg = self.process_group
        return self._issue_task(
            "reduce_scatter", output, lambda: pg._reduce_scatter_base(out_flat, in_flat, opts), post
        )

    def _impl_all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                         blocking: bool = False) -> Task:
        out_flat, in_flat, pg = output.view(-1), input.view(-1), self.process_group
        opts = dist.AllToAllOptions()
        issue = lambda: pg.alltoall_base(out_flat, in_flat, [], [], opts)  # noqa: E731
        return self._issue_task("all_to_all", output, issue)

    def _impl_send(self, tensor: torch.Tensor, dst: int, blocking: bool = False) -> Task:
        pg = self.process_group
        return self._issue_task("send", tensor, lambda: pg.send([tensor], dst, 0))

    def _impl_recv(self, tensor: torch.Tensor, src: int, blocking: bool = False) -> Task:
        pg = self.process_group
        return self._issue_task("recv", tensor, lambda: pg.recv([tensor], src, 0))

    def _impl_barrier(self, blocking: bool = False) -> Task:
        pg = self.process_group
        return self._issue_task("barrier", None, lambda: pg.barrier(dist.BarrierOptions()))
