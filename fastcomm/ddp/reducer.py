"""The reducer: per-parameter hooks, ready counting, bucket launches, finalize, rebuild.

Each iteration: ``prepare_for_backward`` arms the step's state (``step.StepState``); each
parameter's post-accumulate-grad hook marks it ready and launches bucket ``next`` once all its
parameters are; ``_finalize`` (queued on the autograd engine) waits for each bucket and writes
``.grad``. How a bucket is reduced is its strategy, planned in ``plan.py``; the reducer only
executes it. The communicator is swapped by ``replace_comm`` only (``DDP.replace_comm``).
Under compiled autograd the hooks are traced into the compiled backward instead, each
bucket's reduction a custom op (``compiled.py``).

Invariants: buckets launch strictly in index order, the same on every rank, so the
collectives match; they are rebuilt once, after the first synchronized iteration, in rank 0's
arrival order (broadcast); a bucket left unlaunched makes the next forward raise, naming the
parameter. Hooks and ``_finalize`` run on the thread that runs backward; collectives complete
on the communicator's thread (Gloo) or stream (NCCL).

The iteration step by step, unused and sparse parameters, ``create_graph``: docs/ddp.md.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.autograd.profiler as _profiler

from fastcomm.comm.base import Communicator
from fastcomm.comm.errors import CommAbortedError, CommClosedError
from fastcomm.kernels._launch import fp32_scale

from .bucket import Bucket, build_buckets
from .compiled import TracedBuckets
from .config import DDPConfig
from .hand_over import take_back
from .health import GradHealth
from .in_place import InPlaceReduction
from .plan import grads_are_views, hands_over, plan_buckets, shared_request
from .shared import SharedBuckets
from .step import GOT_GRAD as _GOT_GRAD
from .step import SKIPPED as _SKIPPED
from .step import UNUSED as _UNUSED
from .step import WAITING as _WAITING
from .step import StepState
from .strategy import BucketStrategy, pack_into

__all__ = ["Reducer", "find_unused"]
# torch's reducer warns with this text on backward(create_graph=True)
_CREATE_GRAPH_WARNING = (
    "Using DistributedDataParallel with create_graph=True  is not well-supported. The "
    "higher-order gradient will  not be synchronized across ranks, and backpropagation  through "
    "all_reduce operations will not occur. If you require  DDP to work with higher-order "
    "gradients for your use case,  please ping https://github.com/pytorch/pytorch/issues/63929"
)


class Reducer:
    """Buckets ``params`` and reduces their gradients over ``comm`` during backward.

    Args:
        params: parameters to reduce (deduplicated, requiring grad), in registration order.
        names: their qualified names (for error messages and hook state keys).
        comm: the communicator; every rank holds a reducer over the same parameters.
        config: the DDP options.
        sparse: indices of the parameters with sparse gradients (a bucket each, see
            ``sparse.py``).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        comm: Communicator,
        config: DDPConfig,
        sparse: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        # first, so that a constructor that raises leaves remove_hooks (and __del__) a list
        self._handles: list = []
        self.params = list(params)
        self.sparse = frozenset(sparse)
        self.names = list(names)
        self.step = StepState(len(self.params))  # this backward's (step.py); _build sets a part
        self.config = config
        self._use_comm(comm)
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self._comm_hook: Callable | None = None
        self.hook_state: Any = None
        self.buckets: list[Bucket] = []
        self.strategies: list[BucketStrategy] = []  # per bucket, decided in plan.py
        # per bucket index: the uses of its flat buffer's storage when the last write-back
        # made parts of it ``.grad`` (hand_over), the reducer's own uses only
        self.handed: dict[int, int] = {}
        self.traced = TracedBuckets(self)  # the buckets as compiled autograd traces them
        self._build(list(reversed(range(len(self.params)))))

        # rebuild: arrival order recorded during the first synchronized backward
        self._recording = config.rebuild_buckets
        self._arrivals: list[int] = []
        self.rebuild_due = False
        self.rebuilt = False

        # static graph: what the first iteration learned
        self.static_learned = False
        self._static_unused: list[int] = []
        self._static_global_unused: frozenset[int] = frozenset()

        # per-iteration flags besides self.step, read from outside on every gradient: by the
        # gradient hook, and by the strategies (this backward runs with create_graph=True)
        self.expect_hooks = False
        self.create_graph = False
        # the forward ran with the compiled backward's taps: they hand the gradients over
        # (on_traced_grad), the hooks stand aside (taps.py)
        self.traced_step = False
        self.synced_iterations = 0
        # parameters that got a gradient in no_sync backwards since the last reduction: they
        # count as used (torch's local_used_map), so every rank reduces their accumulated grads
        self._used_no_sync = bytearray(len(self.params))
        self.health = None  # a fastcomm.ddp.health.GradHealth, set by DDP
        # in-place recovery (recover.py), set by DDP only when it is on: the gradients' copies
        self.keeper = None
        self.recovery = None

        ref = weakref.ref(self)
        for i, p in enumerate(self.params):
            hook = _make_grad_hook(ref, i, tapped=i not in self.sparse)
            self._handles.append(p.register_post_accumulate_grad_hook(hook))

    # ------------------------------------------------------------------ communicator
    def _use_comm(self, comm: Communicator) -> None:
        """Takes `comm`: its averaging factor, and the shared bucket memory (shared.py) where
        plan.py asks for it and `comm` can make it (a collective)."""
        self.comm = comm
        self.scale = 1.0 / comm.size
        request = shared_request(
            self.params, self.sparse, comm.capabilities, comm.size, self.config
        )
        self.shared: SharedBuckets | None = None if request is None else SharedBuckets.create(
            comm, request, self.config.shared_bucket_cap_mb
        )
        self.bucket_view = grads_are_views(self.config, self.shared is not None)

    def replace_comm(self, comm: Communicator) -> None:
        """Reduces over `comm` from the next backward on (``DDP.replace_comm``, a collective
        of `comm`'s ranks): its scale and shared memory, the same buckets in the same order,
        their strategies planned again for `comm` (a CUDA graph's lane included) and a health
        of `comm`; a ``.grad`` that is a bucket view moves into its new view."""
        order = [i for b in self.buckets for i in b.param_indices]
        self._use_comm(comm)
        self.buckets = []
        self._build(order)
        if self.bucket_view:
            for i, p in enumerate(self.params):
                view = self.grad_views[i]
                if view is not None and p.grad is not None and not p.grad.is_sparse:
                    view.copy_(p.grad)
                    p.grad = view
        if self.health is not None:
            self.health = GradHealth(self, check_finite=self.health.check_finite)

    def leave_shared_memory(self, rewritten: Callable[[int], bool] | None = None) -> None:
        """Copies every ``.grad`` that lives in the shared bucket region out of it: the region
        goes with its communicator (before ``replace_comm``, or closing it). A parameter for
        which `rewritten` says yes (its gradient is written again before anyone reads it: the
        redo of a failed step) is left without one instead."""
        if self.shared is None:
            return
        for i, p in enumerate(self.params):
            g = p.grad
            if g is not None and not g.is_sparse:
                p.grad = None if rewritten is not None and rewritten(i) else g.detach().clone()

    # ------------------------------------------------------------------ buckets
    def _build(self, order: list[int]) -> None:
        old = self.buckets
        kept: dict[int, torch.Tensor] = {}
        if self.shared is not None:
            if old:  # the new buckets overlap the old ones in the region: keep the values
                kept = {
                    i: p.grad.clone() for i, p in enumerate(self.params)
                    if p.grad is not None and not p.grad.is_sparse and i not in self.sparse
                }
            self.shared.begin_layout()
        self.buckets = build_buckets(
            self.params, self.names, order, self.config.bucket_caps_bytes, self.sparse,
            self.shared,
        )
        self.handed = {}  # new buffers: the handed-over ones stay their gradients' alone
        self._bucket_of = [0] * len(self.params)
        self._position = [0] * len(self.params)  # each parameter's place in its bucket
        # each parameter's view into its bucket (None for a sparse parameter)
        self.grad_views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            for k, (i, view) in enumerate(zip(bucket.param_indices, bucket.views, strict=True)):
                self._bucket_of[i] = bucket.index
                self._position[i] = k
                self.grad_views[i] = view
        self._choose_strategies()
        if self.bucket_view and old:
            _move_grad_views(self.params, self.sparse, old, self.grad_views, kept)
        self.traced.layout(self.buckets, len(self.params))

    @property
    def comm_hook(self) -> Callable | None:
        """The registered comm hook (``None``: the reducer's own collectives); setting it
        chooses every bucket's strategy again."""
        return self._comm_hook

    @comm_hook.setter
    def comm_hook(self, hook: Callable | None) -> None:
        self._comm_hook = hook
        self._choose_strategies()

    def _choose_strategies(self) -> None:
        caps = self.comm.capabilities
        lane = (self.comm.graph_lane() if caps.graph_all_reduce and self.config.cuda_graphs
                else None)
        plan = plan_buckets(
            self.buckets, len(self.params), caps, self.config, self._comm_hook,
            self.bucket_view, self.shared is not None and self.shared.staged, lane,
        )
        self.strategies = plan.strategies
        self._on_arrival = plan.on_arrival
        self.hands_over = hands_over(  # buckets whose write-back may hand over the buffer
            self.buckets, self.config, self._comm_hook, self.bucket_view, self.shared is not None
        )
        # per parameter: the shm bucket whose staging takes its fresh gradient (only its
        # peers' parts copied in, fastcomm.ddp.shared), or None: a copy
        self._stage_in = plan.stage_in
        self.step.arrived = [0] * len(self.buckets)
        self._arrival_views = plan.arrival_views

    def bucket_indices(self) -> list[list[int]]:
        """Each bucket's parameter indices, in launch order (for tests and logging)."""
        return [list(b.param_indices) for b in self.buckets]

    def rebuild(self) -> None:
        """Rebuilds the buckets in rank 0's arrival order (a collective: every rank calls it)."""
        n = len(self.params)
        order = _arrival_order(self._arrivals, n)
        t = torch.tensor(order, dtype=torch.int64, device=self.comm.device)
        self.comm.broadcast(t, src=0)
        order = t.tolist()
        if sorted(order) != list(range(n)):
            raise RuntimeError(
                f"rank {self.comm.rank}: the bucket order broadcast by rank 0 is not a "
                f"permutation of this rank's {n} parameters; do all ranks wrap the same model?"
            )
        self._build(order)
        self._arrivals = []
        self._recording = False
        self.rebuild_due = False
        self.rebuilt = True

    def adopt_static_graph(self) -> None:
        """Takes ``config.static_graph`` turned on after construction (torch's
        ``_set_static_graph``, before the first backward): the first synchronized backward
        records its arrival order for the rebuild, as it does when the flag is given upfront."""
        if not self.config.static_graph or self.synced_iterations:
            raise RuntimeError(
                f"rank {self.comm.rank}: adopt_static_graph needs config.static_graph set and "
                f"no synchronized iteration yet (got static_graph={self.config.static_graph}, "
                f"{self.synced_iterations} iteration(s))"
            )
        self._recording = True

    def take_layout(self, order: list[int], step: int, rebuilt: bool, rebuild_due: bool) -> None:
        """A joining rank's reducer takes the running ranks' bucket `order`, their
        synchronized steps and rebuild state (``regrow``)."""
        self._build(order)
        self.rebuilt, self.rebuild_due, self._recording = rebuilt, rebuild_due, False
        self.synced_iterations = step

    # ------------------------------------------------------------------ iteration
    def prepare_for_forward(self) -> None:
        """Raises if the previous iteration left buckets unreduced (unused parameters)."""
        step = self.step
        if step.incomplete is not None:
            missing, step.incomplete = step.incomplete, None
            self.expect_hooks = False
            raise RuntimeError(self._unused_error(missing))

    def prepare_for_backward(self, outputs: Any, sync: bool) -> None:
        """Arms the hooks for the backward of the forward that just ran.

        Args:
            outputs: the forward's output (searched for tensors with ``find_unused``).
            sync: whether this iteration reduces (grad mode on and not in ``no_sync``).
        """
        self.expect_hooks = sync
        if not sync:
            return
        n, config = len(self.params), self.config
        if config.static_graph:
            unused = self._static_unused if self.static_learned else []
        elif config.find_unused_parameters:
            unused = find_unused(outputs, self.index_of, n)
        else:
            unused = []
        delay = config.static_graph and not self.static_learned
        self.step.arm(n, [len(b.params) for b in self.buckets], delay, unused)

    def _needs_used_map(self) -> bool:
        cfg = self.config
        if cfg.skip_all_reduce_unused_params:
            return False
        if cfg.static_graph:
            return not self.static_learned
        return cfg.find_unused_parameters

    def _on_grad(self, i: int, param: torch.Tensor) -> None:
        step = self.step  # once per call: the fields below are its slots (step.py's note)
        if not step.started:
            self._start_backward()
        state = step.ready[i]
        if state or not step.plain:
            self._on_grad_checked(i, param, state)
            return
        # the plain case, a first gradient (most hooks of most steps): the checked path's
        # steps that apply, with the arrival pack's multiply made here
        b = self._bucket_of[i]
        view = self._arrival_views[i]
        if view is not None:
            packed = pack_into(view, param.grad, step.arrival_scale)
        else:
            packed = self._on_arrival[b] and self.strategies[b].pack_one(
                self, self.buckets[b], self._position[i], param.grad
            )
        self._arrived(step, i, b, packed)

    def _arrived(self, step: StepState, i: int, b: int, packed: bool) -> None:
        """Parameter `i` of bucket `b` has its gradient (`packed`: already in the bucket); the
        bucket is launched (with what follows it) when it waits for no other and is next."""
        step.ready[i] = _GOT_GRAD
        if packed:
            step.arrived[b] += 1
        pending = step.pending
        left = pending[b] - 1
        pending[b] = left
        if not left and b == step.next_bucket and not step.delay:
            self._launch_ready()

    def on_traced_grad(self, i: int, grad: torch.Tensor) -> None:
        """Parameter `i`'s gradient `grad`, handed over inside a compiled backward
        (``taps.py``): what its ``AccumulateGrad`` and gradient hook do in eager mode.

        `grad` is the compiled graph's buffer, which it may reuse once this returns: it is
        copied (into its bucket where the arrival pack takes it, else into ``.grad``)."""
        param = self.params[i]
        if self.expect_hooks:
            step = self.step
            if not step.started:
                self._start_backward()
            if step.plain and not step.ready[i] and param.grad is None:
                # the arrival pack is the copy; the write-back makes ``.grad``
                view = self._arrival_views[i]
                if view is not None and pack_into(view, grad, step.arrival_scale):
                    self._arrived(step, i, self._bucket_of[i], True)
                    return
        g = param.grad
        if g is not None:
            g.add_(grad)
        elif self.bucket_view and self.keeper is None and self.grad_views[i] is not None:
            view = self.grad_views[i]
            view.copy_(grad)
            param.grad = view
        else:
            param.grad = torch.empty_like(param).copy_(grad)
        if self.expect_hooks:
            self._on_grad(i, param)
        else:  # a backward of a no_sync forward
            self._used_no_sync[i] = 1

    def _on_grad_checked(self, i: int, param: torch.Tensor, state: int) -> None:
        if self.keeper is not None:
            self.keeper.keep(i, param.grad)
        if state == _GOT_GRAD:
            raise RuntimeError(
                f"rank {self.comm.rank}: parameter {self.names[i]!r} received its gradient "
                "twice in one iteration (a second backward through the same forward, or "
                "reentrant checkpointing); fastcomm DDP reduces each parameter once per "
                "iteration"
            )
        if self.bucket_view:
            _into_view(self, i, param)
        if self._recording:
            self._arrivals.append(i)
        step = self.step
        step.ready[i] = _GOT_GRAD
        if state == _UNUSED and self._bucket_of[i] < step.next_bucket:
            raise RuntimeError(
                f"rank {self.comm.rank}: parameter {self.names[i]!r} received a gradient after "
                "its bucket was reduced without it (it was marked unused: unreachable from the "
                "forward's outputs, or unused in the first iteration of a static_graph DDP)"
            )
        b = self._bucket_of[i]
        if self._on_arrival[b] and self.strategies[b].pack_one(
            self, self.buckets[b], self._position[i], param.grad
        ):
            step.arrived[b] += 1
        if state == _WAITING:
            step.pending[b] -= 1
            if b == step.next_bucket and step.pending[b] == 0 and not step.delay:
                self._launch_ready()

    def _start_backward(self) -> None:
        step = self.step
        step.started = True
        if self.handed:
            take_back(self, self.handed)
            self.handed = {}
        if self.shared is not None:
            self.shared.begin_backward()
        # The engine runs the hooks in grad mode exactly when backward has create_graph=True.
        self.create_graph = torch.is_grad_enabled()
        if self.create_graph:
            warnings.warn(_CREATE_GRAPH_WARNING, UserWarning, stacklevel=2)
        step.plain = not (
            self.create_graph or self.bucket_view or self._recording or self.keeper is not None
        )
        step.arrival_scale = fp32_scale(self.scale)
        torch.autograd.Variable._execution_engine.queue_callback(_make_finalize(weakref.ref(self)))
        for i in step.unused_now:
            self._mark_unused(i)
        if not step.delay:
            self._launch_ready()

    def _mark_unused(self, i: int) -> None:
        step = self.step
        if step.ready[i] != _WAITING:
            return
        if self.bucket_view and i not in self.sparse:
            p, view = self.params[i], self.grad_views[i]
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view
        step.ready[i] = _UNUSED
        step.pending[self._bucket_of[i]] -= 1

    def _launch_ready(self) -> None:
        buckets, step = self.buckets, self.step
        while step.next_bucket < len(buckets) and step.pending[step.next_bucket] == 0:
            self._launch(buckets[step.next_bucket])
            step.next_bucket += 1
        if step.next_bucket == len(buckets) and step.used_work is None and self._needs_used_map():
            step.share_used(self.comm, self._used_no_sync)

    def _launch(self, bucket: Bucket) -> None:
        index, step = bucket.index, self.step
        if self.config.skip_all_reduce_unused_params and all(
            step.ready[i] == _UNUSED for i in bucket.param_indices
        ):
            step.results[index] = _SKIPPED
            return
        grads = [p.grad for p in bucket.params]
        if self.create_graph:  # reduce the values; no autograd through the allreduce
            grads = [None if g is None else g.detach() for g in grads]
        if self.recovery is None:
            step.results[index] = self._launch_one(index, bucket, grads)
            return
        if step.failure is not None:  # the step is redone at its end (recover.py)
            step.results[index] = _SKIPPED
            return
        try:
            step.results[index] = self._launch_one(index, bucket, grads)
        except (CommAbortedError, CommClosedError) as exc:
            step.failure = exc
            step.results[index] = _SKIPPED

    def _launch_one(self, index: int, bucket: Bucket, grads: list) -> Any:
        if _profiler._is_profiler_enabled:  # a range per bucket, only while profiling
            with _profiler.record_function(f"fastcomm.ddp.bucket{index}"):
                return self.strategies[index].launch(self, bucket, grads)
        return self.strategies[index].launch(self, bucket, grads)

    # ------------------------------------------------------------------ finalize
    def _finalize(self) -> None:
        if self.recovery is not None:  # a lost peer's step is redone by the survivors
            self.recovery.finalize(self)
        else:
            self.finish_backward()

    def finish_backward(self) -> None:
        """The end of a synchronized backward: waits for every bucket and writes ``.grad``.

        Raises:
            CommAbortedError, CommClosedError: a launch failed on a lost peer (with in-place
                recovery on, which then redoes the step: ``abandon_step``).
        """
        step = self.step
        if step.failure is not None:
            raise step.failure
        self.expect_hooks = False
        step.started = False
        if step.delay or self.config.find_unused_parameters:
            # Everything not ready got no gradient this iteration: reduce it as unused.
            for i in range(len(self.params)):
                self._mark_unused(i)
            self._launch_ready()
            if step.failure is not None:  # one of those launches
                raise step.failure
        if step.next_bucket < len(self.buckets):
            step.incomplete = step.missing()
            if self.health is not None:
                self.health.readiness.publish()  # the ranks waiting for a bucket read it
            return
        global_unused: frozenset[int] = self._static_global_unused
        if step.used_work is not None:
            global_unused = step.unused_everywhere()
        if step.delay:
            self._static_unused = [i for i, s in enumerate(step.ready) if s == _UNUSED]
            self._static_global_unused = global_unused
            self.static_learned = True
        health = self.health
        if health is not None:
            health.begin_step()
        wait = self.wait_bucket if health is None else health.wait
        if self.keeper is not None:  # every reduction done before any write (recover.py)
            values = [wait(b) for b in self.buckets]
        for bucket, strategy in zip(self.buckets, self.strategies, strict=True):
            value = values[bucket.index] if self.keeper is not None else wait(bucket)
            if value is not None:
                strategy.write_back(self, bucket, value, global_unused)
        step.results = []
        if self.shared is not None:  # no write to a bucket a peer still reads (shared.py)
            self.shared.settle()
        self._after_synced_iteration()
        if health is not None:
            health.end_step()

    def abandon_step(self) -> None:
        """Ends a backward whose reductions in-place recovery redid over the survivors'
        communicator (``recover.redo_step`` wrote every ``.grad``), or compiled autograd traced
        (``compiled.py``): the eager launches and failure are dropped, and it counts as a
        synchronized iteration."""
        self.expect_hooks = False
        self.step.clear()
        self._after_synced_iteration()

    def _after_synced_iteration(self) -> None:
        self.synced_iterations += 1
        self.create_graph = False
        if any(self._used_no_sync):
            self._used_no_sync = bytearray(len(self.params))
        if self.config.static_graph:
            self.static_learned = True
        if not self.rebuilt and self.config.rebuild_buckets:
            self.rebuild_due = True
            self._recording = False

    def wait_bucket(self, bucket: Bucket) -> torch.Tensor | InPlaceReduction | None:
        """Waits for `bucket`'s reduction of this iteration; its reduced value (``None``:
        skipped as unused)."""
        result = self.step.results[bucket.index]
        if result is _SKIPPED:
            return None
        return self.strategies[bucket.index].wait(self, bucket, result)

    def packed_on_arrival(self, bucket: Bucket) -> bool:
        """Whether every gradient of `bucket` was packed as it arrived this iteration."""
        return self.step.arrived[bucket.index] == len(bucket.params)

    # ------------------------------------------------------------------ join
    def shadow_backward(self) -> None:
        """A joined rank's side of one synchronized backward: every bucket's collective with
        zero gradients (through the comm hook when one is set), in bucket order."""
        if self.handed:
            take_back(self, self.handed)
            self.handed = {}
        results = [s.shadow(self, b) for b, s in zip(self.buckets, self.strategies, strict=True)]
        if self._needs_used_map():
            used = torch.zeros(len(self.params), dtype=torch.int32, device=self.comm.device)
            results.append(self.comm.all_reduce(used, async_op=True))
        for r in results:
            r.wait()
        if self.shared is not None:
            self.shared.settle()
        self._after_synced_iteration()

    # ------------------------------------------------------------------ errors / lifetime
    def _unused_error(self, missing: list[int]) -> str:
        message = _unused_message(self.comm, [self.names[i] for i in missing])
        if self.health is not None:  # the other ranks' readiness, when they disagree
            message += self.health.readiness.explain_incomplete()
        return message

    def remove_hooks(self) -> None:
        """Detach the reducer's autograd hooks from the parameters (safe to call again, and
        on a reducer whose constructor raised)."""
        handles = getattr(self, "_handles", None)
        if handles:
            self._handles = []
            for h in handles:
                h.remove()

    def __del__(self) -> None:
        self.remove_hooks()


def _into_view(reducer: Reducer, i: int, param: torch.Tensor) -> None:
    """With bucket views: parameter `i`'s fresh gradient moves into its view (staged into a
    shared bucket where the plan says so), and ``.grad`` becomes the view."""
    g = param.grad
    view = reducer.grad_views[i]  # None for a sparse parameter: its gradient stays its own
    if view is not None and g is not None and g.data_ptr() != view.data_ptr():
        g = g.detach() if reducer.create_graph else g
        bucket = reducer._stage_in[i]
        if (
            bucket is not None
            and type(g) is torch.Tensor
            and g.dtype == view.dtype
            and g.shape == view.shape
            and g.is_contiguous()
        ):  # its own slice is read where autograd left it (fastcomm.ddp.shared)
            bucket.shared.stage(bucket.offsets[reducer._position[i]], g)
        else:
            view.copy_(g)
        param.grad = view


def _arrival_order(arrivals: list[int], n: int) -> list[int]:
    """The bucket order a rebuild proposes: first arrivals first, then the parameters that
    never arrived in reverse registration order."""
    seen: set[int] = set()
    order = [i for i in arrivals if not (i in seen or seen.add(i))]
    return order + [i for i in reversed(range(n)) if i not in seen]


def _move_grad_views(params, sparse, old_buckets, grad_views, kept) -> None:
    """After a rebuild with bucket views: each ``.grad`` that was a view of an old bucket
    becomes its view of the new one, its value kept (`kept`: values saved before the new
    buckets overwrote the old ones in a shared region)."""
    old_ptrs = {
        v.data_ptr() for b in old_buckets if not b.sparse for v in b.views if v.numel()
    }
    for i, p in enumerate(params):
        g = p.grad
        if g is None or g.is_sparse or i in sparse:
            continue
        if g.numel() and g.data_ptr() in old_ptrs:
            grad_views[i].copy_(kept.get(i, g))
            p.grad = grad_views[i]


def _unused_message(comm, names: list[str]) -> str:
    """The error of a rank whose previous iteration left parameters `names` without a
    gradient (their buckets never reduced)."""
    shown = ", ".join(names[:20])
    if len(names) > 20:
        shown += f", ... ({len(names) - 20} more)"
    return (
        f"fastcomm DDP (rank {comm.rank} of {comm.size}): the previous iteration "
        f"did not finish reducing gradients: {len(names)} parameter(s) received no "
        f"gradient in its backward: {shown}. Their buckets were never reduced. Pass "
        "find_unused_parameters=True to DDP if some parameters do not take part in the "
        "loss (or static_graph=True if the same ones never do), or make every output of "
        "forward contribute to the loss."
    )


def _make_grad_hook(ref: weakref.ref, i: int, tapped: bool):
    def hook(param: torch.Tensor) -> None:
        reducer = ref()
        # after a tapped compiled backward, the engine still calls each tapped parameter's
        # AccumulateGrad, with no gradient: its tap handed it over (taps.py)
        if reducer is not None and not (tapped and reducer.traced_step):
            traced = torch.compiler.is_compiling() and _compiled_autograd_traces()
            if reducer.expect_hooks:
                if traced:  # compiled autograd traces it into the backward (compiled.py)
                    reducer.traced.ready(i, param, reducer)
                else:
                    reducer._on_grad(i, param)
            elif not traced:  # a no_sync backward
                reducer._used_no_sync[i] = 1

    return hook


def _compiled_autograd_traces() -> bool:
    # Dynamo also compiles a hook as a frame of its own, when an eager backward runs from a
    # compiled function: that trace takes the eager path (and its graph breaks)
    return torch._dynamo.compiled_autograd.in_compiled_autograd_region


def _make_finalize(ref: weakref.ref):
    def finalize() -> None:
        reducer = ref()
        if reducer is not None:
            reducer._finalize()

    return finalize


def find_unused(outputs: Any, index_of: dict[int, int], n: int) -> list[int]:
    """Indices of parameters the autograd graph of `outputs` does not reach.

    Args:
        outputs: anything holding tensors (nested lists, tuples, dicts, dataclasses).
        index_of: ``id(param) -> index``.
        n: number of parameters.
    """
    reached = bytearray(n)
    stack = []
    for t in _tensors(outputs):
        if not t.requires_grad:
            continue
        if t.grad_fn is None:
            i = index_of.get(id(t))
            if i is not None:
                reached[i] = 1
        else:
            stack.append(t.grad_fn)
    seen = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        var = getattr(fn, "variable", None)
        if var is not None:
            i = index_of.get(id(var))
            if i is not None:
                reached[i] = 1
        for nxt, _ in fn.next_functions:
            if nxt is not None:
                stack.append(nxt)
    return [i for i in range(n) if not reached[i]]


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))
