"""``DDP``: a drop-in ``torch.nn.parallel.DistributedDataParallel`` on fastcomm.

The constructor takes torch's arguments in torch's order (plus ``comm=``, keyword only);
``.module``, ``state_dict()`` (keys prefixed ``module.``), ``no_sync()``, ``join()`` and
``register_comm_hook`` behave as torch's. The reduction is fastcomm's: the ``Reducer``
(``reducer.py``) launches each bucket's strategy (``strategy.py``, chosen in ``plan.py``) from
the autograd hooks, so the collectives overlap backward.

Invariants: the communicator is resolved once, at construction (``_setup.resolve_comm``:
``comm``, else ``process_group``, else ``fastcomm.get_world()``, else shm for a one-host CPU
job, else torch's default group); ``.grad`` aliases a bucket only where
``grads_are_bucket_views`` says so; under ``torch.compile`` the reducer's work runs eagerly
around the compiled forward.

The resolution order, torch's behaviours kept and ``torch.compile``: docs/ddp.md.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastcomm.comm.base import Communicator
from fastcomm.comm.world import replace_world

from ._setup import (
    check_mixed_precision,
    default_group,
    reduce_dtype_of,
    reduced_parameters,
    resolve_comm,
    torch_members,
)
from .broadcast import broadcast_tensors, verify_same_parameters
from .bucket import GradBucket
from .compiled import check_compiled_autograd, compiled_autograd_on
from .config import DDPConfig, check_param_dtype
from .health import GradHealth
from .join import Join, notify_join
from .pickling import ddp_getstate, ddp_setstate
from .recover import MembershipChange, Recovery, recovery_enabled
from .reducer import Reducer
from .regrow import Grower, RegisteredStates, joining
from .regrow import join as join_running
from .sparse import sparse_param_indices
from .taps import Taps, run_tapped
from .taps import available as taps_available

__all__ = ["DDP", "DistributedDataParallel"]


class DDP(nn.Module):
    """Data parallelism over a fastcomm communicator, with torch DDP's interface.

    Args:
        module: the model; every rank wraps the same architecture.
        device_ids: ``None`` or one CUDA device for a single-device CUDA module (inputs are
            moved there, as torch does).
        output_device: accepted as torch's (outputs stay where the module puts them).
        dim: accepted for compatibility (DDP never scatters inputs).
        broadcast_buffers: broadcast rank 0's buffers at each forward (and include buffers in
            the construction-time broadcast). ``forward_sync_buffers`` overrides it.
        init_sync: check the parameters match across ranks and broadcast rank 0's state.
        process_group: a torch ``ProcessGroup`` to reduce over (adapted).
        bucket_cap_mb: bucket cap in MiB (default 25, with a 1 MiB first bucket).
        find_unused_parameters: mark the parameters unreachable from the outputs ready.
        check_reduction: deprecated in torch; ignored.
        gradient_as_bucket_view: ``.grad`` are views into the bucket buffers. ``None``
            (default): where the buckets go into shared memory (``shared_buckets``), else
            ``False`` as torch's.
        static_graph: learn the unused set once; no graph traversal after that.
        delay_all_reduce_named_params, param_to_hook_all_reduce: torch's delayed-allreduce
            feature; not supported (``ValueError`` when given).
        mixed_precision: torch's ``_MixedPrecision``: ``reduce_dtype`` (or ``param_dtype``)
            sets the communication dtype, cast fused into pack/unpack; ``buffer_dtype``
            casts the buffers once. Parameters stay in their dtype: run forward under
            ``torch.autocast`` for low-precision compute.
        device_mesh: a 1-D ``DeviceMesh``; its group is used as ``process_group``.
        skip_all_reduce_unused_params: skip buckets whose parameters all went unused (every
            rank must have the same unused set).
        bucket_cap_mb_list: per-bucket caps in MiB, in launch order (the last repeats).
        batched_grad_copy: accepted; fastcomm always packs a bucket in one fused kernel.
        forward_sync_buffers: torch's replacement for ``broadcast_buffers``.
        comm: a fastcomm communicator to reduce over.
        check_finite: raise ``FloatingPointError`` on every rank at the end of a
            synchronized backward whose averaged gradients hold NaN or Inf, naming the
            parameters and the step (see `fastcomm.ddp.health`).
        shared_buckets: put the buckets in memory the ranks share and all-reduce them in place
            out of the peers' buckets, where the communicator offers it (``shm``) and
            ``gradient_as_bucket_view`` is not ``False`` (see `fastcomm.ddp.shared`). Default
            on (``FASTCOMM_DDP_SHARED_BUCKETS=0``: off).
        cuda_graphs: replay each packed CUDA bucket's pack, all-reduce and unpack from a CUDA
            graph captured after its first launch, where the communicator offers it (NCCL):
            one host call per bucket, the same results (see `fastcomm.ddp.graphs`). Default
            on (``FASTCOMM_DDP_CUDA_GRAPHS=0``: off).
        compiled_backward: under ``torch.compile(DDP(model))``, ``"traced"`` compiles one
            backward that hands each gradient to its bucket as it is made (see
            `fastcomm.ddp.taps`); ``"split"`` has Dynamo's DDPOptimizer compile a graph per
            bucket, as for torch DDP; ``"auto"`` (default; ``FASTCOMM_DDP_COMPILED_BACKWARD``):
            traced for CPU parameters, split for CUDA ones.
        shared_bucket_cap_mb: the most MiB of ``/dev/shm`` those buckets may take (default:
            ``FASTCOMM_DDP_SHARED_CAP_MB``, else no cap); over it, or when ``/dev/shm`` is too
            small, a warning and the communicator's own buffers.

    Raises:
        RuntimeError: no communicator can be found, or no parameter requires a gradient.
        ValueError: bad options.
        RuntimeError: parameters differ across ranks (raised on every rank; also a
            ``ValueError``: ``broadcast.ParameterMismatchError``).
        TypeError: a parameter dtype that cannot be reduced.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = True,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool | None = None,
        static_graph: bool = False,
        delay_all_reduce_named_params: list | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: list[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        comm: Communicator | None = None,
        check_finite: bool = False,
        shared_buckets: bool | None = None,
        shared_bucket_cap_mb: float | None = None,
        cuda_graphs: bool | None = None,
        compiled_backward: str | None = None,
    ) -> None:
        super().__init__()
        _check_arguments(module, dim, broadcast_buffers, forward_sync_buffers, process_group)
        process_group = _group_of(
            process_group, device_mesh, delay_all_reduce_named_params, param_to_hook_all_reduce
        )
        self.config = _config_of(
            broadcast_buffers,
            forward_sync_buffers,
            bucket_cap_mb=bucket_cap_mb,
            bucket_cap_mb_list=bucket_cap_mb_list,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
            shared_buckets=shared_buckets,
            shared_bucket_cap_mb=shared_bucket_cap_mb,
            cuda_graphs=cuda_graphs,
            compiled_backward=compiled_backward,
            static_graph=static_graph,
            init_sync=init_sync,
            skip_all_reduce_unused_params=skip_all_reduce_unused_params,
            batched_grad_copy=batched_grad_copy,
        )
        self.module = module
        self.dim = dim
        self.comm = resolve_comm(comm, process_group, module)
        # torch's attribute is the group reduced over: the default one when none was passed
        self.process_group = process_group if process_group is not None else default_group()
        # the torch group of the communicator's members: a comm hook's state holding one of
        # them follows the communicator through in-place recovery (hooks.hook_comm)
        self._torch_members = torch_members(comm, process_group, self.comm)
        # how a pickled copy finds its communicator again (see pickling.py)
        self._comm_given = comm is not None or (
            process_group is not None and process_group is not default_group()
        )
        self.mixed_precision = mixed_precision
        self.parameters_to_ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        names, params = _checked_parameters(module, self.parameters_to_ignore)
        devices = {p.device for p in params}
        self.device = next(iter(devices))
        self.device_type = self.device.type
        self.device_ids, self.output_device = _device_placement(
            device_ids, output_device, devices
        )
        if mixed_precision is not None:
            _apply_mixed_precision(module, mixed_precision)
        self._start(names, params, check_finite)

    def _start(self, names: list[str], params: list, check_finite: bool) -> None:
        """The initial broadcast and the reducer; with recovery on, its state first, and for a
        replacement joining instead of broadcasting (``recover.py``, ``regrow.py``)."""
        self.registered_states = RegisteredStates()
        """The objects of :meth:`register_state`."""
        self.join_step = 0
        """The steps the running ranks had done when this rank joined them (0: from the start)."""
        self._recovery: Recovery | None = None
        header = None
        if recovery_enabled() and joining(self.comm):
            self._recovery, header = join_running(self)
        elif recovery_enabled() and self.comm.size > 1:
            recovery = Recovery(self)
            # unsupported, it warned: ranks across hosts on a communicator that cannot shrink
            self._recovery = recovery if recovery.supported else None
        if self.config.init_sync and header is None:
            self._collective(lambda: self._init_sync(names, params), "init")
        self._build_reducer(names, params, check_finite)
        if self._recovery is not None:
            self._recovery.attach(self.reducer)
            if self._recovery.grower is None:
                self._recovery.grower = Grower(self._recovery)
        if header is not None:  # a joiner takes the running ranks' buckets, step and state
            self.join_step = header["step"]
            self.reducer.take_layout(header["order"], header["step"], header["rebuilt"],
                                     header["rebuild_due"])
            broadcast_tensors(self.comm, list(self.reducer.params) + self.synced_buffers(), src=0)
            self.registered_states.loading = True

    def replace_comm(self, comm: Communicator) -> Communicator:
        """Reduces over `comm` from now on, in place of the communicator in use: the one
        place that swaps it (in-place recovery's shrink, a regrow's admission, a joiner's
        stand-in; a collective of `comm`'s ranks). What depends on it follows: recovery's
        liveness watch looks at `comm`, the reducer re-plans over it (buckets, shared memory,
        strategies, CUDA-graph lane, health), and ``fastcomm.get_world()`` and the comm hooks'
        states that named the old one follow (``fastcomm.comm.world.replace_world``).

        Returns:
            The communicator replaced (not closed: the caller closes it).
        """
        old, self.comm = self.comm, comm
        if self._recovery is not None:  # first: a peer lost from here on is named
            self._recovery.follow(comm)
        reducer = getattr(self, "reducer", None)  # a joiner's is built on `comm`
        if reducer is not None:
            reducer.replace_comm(comm)
        replace_world(old, comm, self._torch_members)
        return old

    def register_state(self, name: str, obj: Any) -> None:
        """Registers `obj` (anything with ``state_dict``/``load_state_dict``: the optimizer,
        an LR scheduler, the loop's counters) to be streamed to a rank that joins (regrow).
        Every rank registers the same names, before its first forward.

        Raises:
            TypeError: `obj` has no ``state_dict``/``load_state_dict``.
        """
        self.registered_states.register(name, obj)

    def _init_sync(self, names: list[str], params: list) -> None:
        verify_same_parameters(self.comm, names, params)
        state = list(params)
        if self.config.init_sync_buffers:
            state += self.synced_buffers()
        broadcast_tensors(self.comm, state, src=0)

    def _collective(self, fn: Callable[[], Any], where: str) -> Any:
        """``fn()``; with recovery on, recovered from a lost peer and retried (recover.py)."""
        if self._recovery is None:
            return fn()
        return self._recovery.run(fn, where)

    # ------------------------------------------------------------------ membership
    @property
    def world_size(self) -> int:
        """The number of ranks reducing now (smaller after a rank was lost, with recovery)."""
        return self.comm.size

    @property
    def rank(self) -> int:
        """This process's rank now (renumbered after a rank was lost, with recovery)."""
        return self.comm.rank

    def on_membership_change(self, fn: Callable[[MembershipChange], None]) -> None:
        """Calls ``fn(change)`` after each shrink (``fastcomm.ddp.recover.MembershipChange``:
        the new rank and world size, the ranks lost), e.g. to re-shard the data; only with
        in-place recovery on (``FASTCOMM_RECOVER=in-process``), else never.

        Raises:
            TypeError: `fn` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"on_membership_change takes a callable, got {type(fn).__name__}")
        if self._recovery is not None:
            self._recovery.callbacks.append(fn)

    def _build_reducer(self, names: list[str], params: list, check_finite: bool) -> None:
        self.reducer = Reducer(
            params, names, self.comm, self.config, sparse_param_indices(self.module, params)
        )
        self.reducer.health = GradHealth(self.reducer, check_finite=check_finite)
        # the compiled backward's taps (taps.py), made by the first compiled forward
        self._taps: Taps | None = None
        mode = self.config.compiled_backward
        self._traced_backward = mode == "traced" or (
            mode == "auto" and not any(p.is_cuda for p in params)
        )
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.active_join: Join | None = None
        self._comm_hook_registered = False
        reduce_dtype = reduce_dtype_of(self.mixed_precision)
        if reduce_dtype is not None:
            from .hooks.default import make_cast_hook

            self.reducer.comm_hook = make_cast_hook(reduce_dtype)

    # ------------------------------------------------------------------ torch's surface
    @property
    def broadcast_buffers(self) -> bool:
        """Whether buffers are broadcast from rank 0 before each forward."""
        return self.config.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.config.forward_sync_buffers = bool(value)

    forward_sync_buffers = broadcast_buffers

    @property
    def find_unused_parameters(self) -> bool:
        """Whether each iteration looks for parameters without a gradient."""
        return self.config.find_unused_parameters

    @property
    def gradient_as_bucket_view(self) -> bool:
        """The argument, as torch reports it (``None``, the default, reads ``False``); whether
        ``.grad`` aliases the buckets is :attr:`grads_are_bucket_views`."""
        return bool(self.config.gradient_as_bucket_view)

    @property
    def grads_are_bucket_views(self) -> bool:
        """Whether each ``param.grad`` is a view of its bucket (``gradient_as_bucket_view``,
        or the default on shared buckets: :attr:`shared_buckets`)."""
        return self.reducer.bucket_view

    @property
    def shared_buckets(self) -> bool:
        """Whether the buckets live in memory the ranks share, reduced in place out of the
        peers' buckets (see `fastcomm.ddp.shared`)."""
        return self.reducer.shared is not None

    @property
    def static_graph(self) -> bool:
        """Whether the graph is declared the same every iteration."""
        return self.config.static_graph

    @property
    def bucket_bytes_cap(self) -> int:
        """The largest bucket cap in bytes (see :attr:`DDPConfig.bucket_bytes_cap`)."""
        return self.config.bucket_bytes_cap

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module, names) -> None:
        """Names (``"layer.weight"``) of parameters and buffers DDP leaves alone (torch's)."""
        module._ddp_params_and_buffers_to_ignore = list(names)
        ignored = set(names)
        for name, tensor in (*module.named_parameters(), *module.named_buffers()):
            if name in ignored:
                tensor._ddp_ignored = True  # read by torch's composable APIs, as torch sets it

    def synced_buffers(self) -> list[torch.Tensor]:
        """The module's buffers that DDP broadcasts (all but the ignored ones)."""
        return [
            b for n, b in self.module.named_buffers() if n not in self.parameters_to_ignore
        ]

    # ------------------------------------------------------------------ forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module between the reducer's pre- and post-forward steps."""
        # Under torch.compile (``torch.compile(DDP(model))``) the reducer's bookkeeping runs
        # eagerly, and so does the frame that calls the wrapped module (_run_module). Dynamo
        # compiles the module's call as a frame of its own: with the taps that hand each
        # gradient to its bucket from inside the compiled backward (taps.py), or split by
        # DDPOptimizer at the bucket boundaries while this DDP is torch's active DDP module
        # (docs/ddp.md). Eager calls skip the disabling wrappers, a host cost per call.
        compiling = torch.compiler.is_compiling()
        sync = _pre_forward_eagerly(self) if compiling else self._pre_forward()
        if self.device_ids:
            inputs, kwargs = _to_device((inputs, kwargs), torch.device("cuda", self.device_ids[0]))
        if compiling:
            output = _run_module_eagerly(self, inputs, kwargs, sync)
            _post_forward_eagerly(self, output, sync)
        else:
            output = _run_module(self, inputs, kwargs, sync)
            self._post_forward(output, sync)
        return output

    def _pre_forward(self) -> bool:
        reducer = self.reducer
        sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        reducer.prepare_for_forward()
        if sync and self._recovery is not None:  # a joiner admitted at this step (regrow.py)
            self._recovery.grower.boundary(reducer.synced_iterations)
        if self.active_join is not None:
            notify_join(self, sync)
        if sync and reducer.rebuild_due:
            self._collective(lambda: self.reducer.rebuild(), "rebuild")
        if self.will_sync_buffers():
            self._collective(self._sync_buffers, "buffers")
        return sync

    def _post_forward(self, output: Any, sync: bool) -> None:
        self.require_forward_param_sync = sync
        if sync and compiled_autograd_on():  # its backward traces the reductions (compiled.py)
            check_compiled_autograd(self)
        self.reducer.prepare_for_backward(output, sync)

    def _taps_for_compile(self) -> Taps | None:
        """The taps a compiled synchronized step calls the module with (made at the first
        call), or None: this torch cannot keep the op, compiled autograd traces the hooks, the
        module is compiled on its own, or a graph break sent this DDP to the split path."""
        if compiled_autograd_on():
            return None
        if self._taps is None:
            if not taps_available() or isinstance(
                self.module, torch._dynamo.eval_frame.OptimizedModule
            ):
                return None
            self._taps = Taps(self)
        return None if self._taps.broken else self._taps

    def will_sync_buffers(self) -> bool:
        """Whether the next forward broadcasts the buffers (and a joined rank must match it)."""
        return (
            self.require_forward_param_sync
            and self.config.forward_sync_buffers
            and self.comm.size > 1
        )

    def _sync_buffers(self, src: int | None = None) -> None:
        buffers = self.synced_buffers()
        if not buffers:
            return
        if src is None:
            src = self.active_join.buffer_source(self) if self.active_join is not None else 0
        broadcast_tensors(self.comm, buffers, src=src)

    # ------------------------------------------------------------------ context managers
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronized iteration after it reduces the
        accumulated sum. Include the forward in the context, as with torch."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """Training with uneven inputs: ranks that run out shadow the others' collectives.

        Args:
            divide_by_initial_world_size: average over the initial world size (default) or
                over the ranks still training.
            enable: ``False`` makes the context a no-op.
            throw_on_early_termination: raise on every rank as soon as one runs out.
        """
        return Join(self, enable, throw_on_early_termination, divide_by_initial_world_size)

    # ------------------------------------------------------------------ comm hooks
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        """Registers ``hook(state, bucket) -> Future[Tensor]`` (torch's contract).

        ``bucket`` is a :class:`fastcomm.ddp.GradBucket`; the future's value is the reduced
        flat buffer (any float dtype: it is cast while unpacking). Call it once, before the
        first backward.

        Raises:
            TypeError: `hook` is not callable (torch's message).
            ValueError: `hook`'s annotations are not torch's ``dist.GradBucket`` /
                ``torch.futures.Future[torch.Tensor]`` (torch's messages).
            RuntimeError: a hook is already registered, or reduction already started.
        """
        _check_comm_hook(hook)
        if self._comm_hook_registered:
            raise RuntimeError(
                "register_comm_hook or register_builtin_comm_hook can only be called once."
            )
        # a rank that joined running ones (regrow) starts counting at its join step
        if self.reducer.synced_iterations > self.join_step or self.reducer.expect_hooks:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        self._comm_hook_registered = True
        self.reducer.comm_hook = hook
        self.reducer.hook_state = state

    # ------------------------------------------------------------------ training health
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(self.parameters(), ...)``, mostly for free.

        After a synchronized backward the unpack already summed the squares of every
        averaged gradient, so the norm is one tiny reduction on the device (no pass over
        the gradients, no host sync unless the caller reads it). It falls back to torch's
        computation when those sums do not describe the current gradients (``no_sync``
        steps, gradients changed in place since, parameters outside DDP with gradients,
        ``norm_type != 2``); with ``gradient_as_bucket_view`` it reads the bucket buffers.

        Args:
            max_norm: the largest total norm left unscaled.
            norm_type: the p of the p-norm (``inf`` allowed, as torch).
            error_if_nonfinite: raise ``RuntimeError`` when the norm is NaN or Inf.
            foreach: torch's flag for the scaling kernels.

        Returns:
            The total norm of the gradients (before clipping), a tensor on their device.
        """
        return self.reducer.health.clip_grad_norm_(
            list(self.module.parameters()), max_norm, norm_type, error_if_nonfinite, foreach
        )

    def nonfinite_grads(self) -> list[str]:
        """Qualified names of the parameters whose averaged gradient held NaN or Inf in the
        last synchronized backward (empty when none did), from the unpack's counters."""
        return self.reducer.health.nonfinite_names()

    def _set_static_graph(self) -> None:
        """torch's private switch, kept for scripts that call it before training."""
        if self.static_graph:
            warnings.warn(
                "You've set static_graph to be True, no need to set it again.", stacklevel=2
            )
            return
        if self.reducer.synced_iterations:
            raise RuntimeError(
                "set_static_graph() should be called before training loop starts and after "
                "DistributedDataParallel is constructed."
            )
        self.config.static_graph = True
        self.reducer.adopt_static_graph()
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do "
                "not need to set find_unused_parameters=true, just be sure these unused "
                "parameters will not change during training loop while calling "
                "`_set_static_graph`.",
                stacklevel=2,
            )

    __getstate__ = ddp_getstate
    __setstate__ = ddp_setstate

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False):
        """torch's generator of the parameters a DDP of `module` manages (not ignored)."""
        for name, param in module.named_parameters():
            if not hasattr(param, "_ddp_ignored"):
                yield (name, param) if named_params else param

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        return {
            "world_size": self.comm.size,
            "rank": self.comm.rank,
            "backend_name": self.comm.backend,
            "bucket_sizes": [
                b.numel * b.params[0].element_size() for b in self.reducer.buckets
            ],
            "has_rebuilt_buckets": int(self.reducer.rebuilt),
            "find_unused_parameters": int(self.find_unused_parameters),
            "static_graph": int(self.static_graph),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
        }


DistributedDataParallel = DDP
# torch._disable_dynamo imports torch._dynamo (a second, at import) on the first compiled call,
# not here: a rank that never compiles, a replacement joining a job above all, starts faster
_pre_forward_eagerly = torch._disable_dynamo(DDP._pre_forward)
_post_forward_eagerly = torch._disable_dynamo(DDP._post_forward)


def _run_module(ddp: DDP, inputs: tuple, kwargs: dict, sync: bool) -> Any:
    """``ddp.module(*inputs, **kwargs)``. Under ``torch.compile(DDP(model))`` (Dynamo
    intercepts the frames this calls), a synchronized step calls it with the taps that put
    the gradient hooks inside the compiled backward (taps.py). Otherwise `ddp` is torch's
    active DDP module while it runs, which is what Dynamo's DDPOptimizer looks for
    (``DistributedDataParallel._get_active_ddp_module()``) when it compiles the module
    (``DDP(torch.compile(model))``, or the frame below under ``torch.compile(DDP(model))``
    with ``compiled_backward="split"``): it splits the graph where `ddp`'s buckets close
    (``ddp.bucket_bytes_cap``)."""
    taps = None
    if _get_eval_frame_callback() is not None and ddp._traced_backward:
        if not sync:  # nothing to reduce: one graph, no split
            ddp.reducer.traced_step = False
            return _call_module(ddp.module, inputs, kwargs)
        taps = ddp._taps_for_compile()
    ddp.reducer.traced_step = taps is not None
    if taps is not None:
        return run_tapped(ddp.module, taps, inputs, kwargs)
    torch_ddp = _TORCH_DDP
    outer = torch_ddp._active_ddp_module
    # DDPOptimizer refuses a cap below its 1 MiB first bucket (an AssertionError, torch DDP's
    # too): such a DDP's module compiles as one graph, the reductions after its backward
    split = ddp.bucket_bytes_cap >= _FIRST_BUCKET_BYTES
    torch_ddp._active_ddp_module = ddp if split else None
    try:
        return _call_module(ddp.module, inputs, kwargs)
    finally:
        torch_ddp._active_ddp_module = outer


_FIRST_BUCKET_BYTES = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
# Dynamo's frame callback: set while a torch.compile'd call runs (the frames it calls compiled)
_get_eval_frame_callback = getattr(
    torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: None
)
# torch's own class, bound at import: a program (torch's DDP suite among them) may set
# nn.parallel.DistributedDataParallel to fastcomm's DDP, and Dynamo asks torch's class
_TORCH_DDP = nn.parallel.distributed.DistributedDataParallel


def _call_module(module: nn.Module, inputs: tuple, kwargs: dict) -> Any:
    # A frame of fastcomm's, which Dynamo compiles (tracing into the module), where it would
    # leave a torch.nn container's own call frame (nn.Sequential's, say) uncompiled.
    return module(*inputs, **kwargs)


# not traced, but what it calls is: the module's call is compiled as a frame of its own
_run_module_eagerly = torch._disable_dynamo(_run_module, recursive=False)


def _check_arguments(module, dim, broadcast_buffers, forward_sync_buffers, process_group) -> None:
    """Type checks of the arguments that `DDPConfig` does not see, before anything is built
    (a wrong type found later would surface as an unrelated error from deep inside setup)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__} {dim!r}")
    for name, value in (
        ("broadcast_buffers", broadcast_buffers),
        ("forward_sync_buffers", forward_sync_buffers),
    ):
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(value).__name__} {value!r}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup or None, got "
            f"{type(process_group).__name__} {process_group!r}"
        )


def _group_of(process_group, device_mesh, delay_all_reduce_named_params, param_to_hook_all_reduce):
    """The process group to reduce over (`device_mesh`'s group when given); refuses torch's
    delayed-allreduce arguments."""
    if delay_all_reduce_named_params is not None or param_to_hook_all_reduce is not None:
        raise ValueError(
            "delay_all_reduce_named_params / param_to_hook_all_reduce are not supported by "
            "fastcomm DDP; leave them None"
        )
    if device_mesh is None:
        return process_group
    if process_group is not None:
        raise ValueError("pass either process_group or device_mesh, not both")
    if device_mesh.ndim != 1:
        raise ValueError(f"device_mesh must be 1-D, got {device_mesh.ndim} dimensions")
    return device_mesh.get_group()


def _config_of(
    broadcast_buffers: bool | None,
    forward_sync_buffers: bool | None,
    *,
    shared_buckets: bool | None,
    shared_bucket_cap_mb: float | None,
    cuda_graphs: bool | None,
    compiled_backward: str | None,
    **options: Any,
) -> DDPConfig:
    """The `DDPConfig` of torch's arguments: ``forward_sync_buffers`` overrides
    ``broadcast_buffers`` for the forwards (and then the construction-time broadcast includes
    the buffers); ``None`` for ``shared_buckets`` / ``shared_bucket_cap_mb`` / ``cuda_graphs``
    / ``compiled_backward`` leaves the config's defaults (``FASTCOMM_DDP_SHARED_BUCKETS``,
    ``FASTCOMM_DDP_SHARED_CAP_MB``, ``FASTCOMM_DDP_CUDA_GRAPHS``,
    ``FASTCOMM_DDP_COMPILED_BACKWARD``)."""
    if broadcast_buffers is None:
        broadcast_buffers = True
    forward_sync = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
    init_sync_buffers = True if forward_sync_buffers is not None else broadcast_buffers
    defaults_unless_given = {
        k: v
        for k, v in (("shared_buckets", shared_buckets),
                     ("shared_bucket_cap_mb", shared_bucket_cap_mb),
                     ("cuda_graphs", cuda_graphs),
                     ("compiled_backward", compiled_backward))
        if v is not None
    }
    return DDPConfig(
        forward_sync_buffers=forward_sync,
        init_sync_buffers=init_sync_buffers,
        **defaults_unless_given,
        **options,
    )


def _checked_parameters(module: nn.Module, ignore: set[str]):
    """(names, params) DDP reduces; raises when there is none or a dtype cannot be reduced."""
    names, params = reduced_parameters(module, ignore)
    if not params:
        raise RuntimeError(
            "DistributedDataParallel is not needed when a module doesn't have any "
            "parameter that requires a gradient."
        )
    for name, p in zip(names, params, strict=True):
        check_param_dtype(name, p)
    return names, params


def _device_placement(device_ids, output_device, devices: set[torch.device]):
    """torch's ``(device_ids, output_device)`` attributes: ``None`` for a CPU or multi-device
    module, else the single CUDA device's index."""
    if not device_ids:
        return None, None
    if len(device_ids) != 1 or "cpu" in {d.type for d in devices} or len(devices) > 1:
        raise ValueError(
            f"device_ids must be None or a single device for a single-device CUDA "
            f"module, got {device_ids} for parameters on {sorted(map(str, devices))}"
        )
    index = _device_index(device_ids[0])
    return [index], (index if output_device is None else _device_index(output_device))


def _apply_mixed_precision(module: nn.Module, mixed_precision: Any) -> None:
    """Checks torch's ``_MixedPrecision`` and casts the floating buffers to its
    ``buffer_dtype`` once (the reduce dtype becomes a comm hook, ``DDP._build_reducer``)."""
    check_mixed_precision(mixed_precision)
    if getattr(mixed_precision, "buffer_dtype", None) is not None:
        for buf in module.buffers():
            if buf.is_floating_point():
                buf.data = buf.data.to(mixed_precision.buffer_dtype)


def _check_comm_hook(hook: Callable) -> None:
    """torch's checks of a comm hook, with torch's exception types and messages.

    fastcomm's own ``GradBucket`` and a bare ``torch.futures.Future`` are accepted too, and
    postponed (string) annotations that name them.
    """
    if not callable(hook):
        raise TypeError("Communication hook must be callable.")
    try:
        sig = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    bucket = sig.parameters.get("bucket")
    if bucket is not None and not _annotation_ok(
        bucket.annotation, (dist.GradBucket, GradBucket), "GradBucket"
    ):
        raise ValueError("Communication hook: bucket annotation should be dist.GradBucket.")
    futures = (torch.futures.Future[torch.Tensor], torch.futures.Future)
    if not _annotation_ok(sig.return_annotation, futures, "Future"):
        raise ValueError(
            "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]."
        )


def _annotation_ok(annotation: Any, allowed: tuple, name: str) -> bool:
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):
        return name in annotation
    return any(annotation == a for a in allowed)


def _device_index(device: int | str | torch.device) -> int:
    if isinstance(device, int):
        return device
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, tuple):
        return tuple(_to_device(x, device) for x in obj)
    if isinstance(obj, list):
        return [_to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _frames_dynamo_skips() -> None:
    """``torch.compile(DDP(model))``: Dynamo runs `DDP.forward` as plain Python instead of
    tracing it, which would break its graph three times (at the eager bookkeeping before and
    after the module, and at the module's call), each break a frame of guards and resume code
    per step. Only the module's call, in `_call_module`, is compiled (split by DDPOptimizer).
    The reducer's bookkeeping is never compiled, nor anything it calls. A code object's strategy
    is read only while Dynamo intercepts frames: eager calls cost nothing. Where Dynamo inlines
    the forward instead (a compiled function that calls the DDP), the ``is_compiling`` branch
    of `DDP.forward` keeps the bookkeeping out of the graph as before."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # a torch without the per-code strategy: Dynamo traces the forward
        return
    skip, default = _FrameAction.SKIP, _FrameAction.DEFAULT
    for fn, nested in (
        (DDP.forward, default),  # what it calls: below, and torch.compiler.is_compiling
        (_run_module, default),  # its call of _call_module is compiled
        (run_tapped, default),  # ... and run_tapped's of call_tapped
        (DDP._taps_for_compile, skip),
        (DDP._pre_forward, skip),
        (DDP._post_forward, skip),
        (_to_device, skip),
    ):
        set_code_exec_strategy(fn.__code__, _FrameExecStrategy(skip, nested))


_frames_dynamo_skips()
