"""PowerSGD (Vogels et al., 2019) low-rank gradient compression on fastcomm communicators.

Per bucket, each gradient of two or more dimensions whose rank-``r`` factors are at least
``min_compression_rate`` times smaller is viewed as a matrix ``M`` (``n x m``); the others are
sent uncompressed. With error feedback ``M`` first gets last step's residual added.

1. ``P = M Q`` (``Q``: ``m x r``, kept from the last step when ``warm_start``); one allreduce
   (first communicator) carries every ``P`` of the bucket and the uncompressed gradients;
2. orthogonalize each summed ``P``; ``Q = M^T P``; one allreduce of every ``Q`` (private second
   communicator, see ``_two_phase``), averaged;
3. ``M ~ P Q^T``; the residual ``M - P Q^T`` is kept per parameter name.

Before ``start_powerSGD_iter`` iterations the hook is a plain averaging allreduce (torch's
advice: let the gradients settle first). The state's ``state_dict()`` holds the residuals and
the ``Q`` factors by parameter name, so they survive bucket rebuilds and checkpoints.
"""

from __future__ import annotations

import zlib

import torch

from fastcomm import kernels

from ..bucket import GradBucket
from ._two_phase import ErrorFeedback, PhaseComms, new_future
from .default import allreduce_hook, average_scale, hook_comm

__all__ = ["PowerSGDState", "powersgd_hook"]


class PowerSGDState:
    """State of `powersgd_hook` (torch's ``PowerSGDState`` arguments, on fastcomm).

    Args:
        process_group: communicator or torch ``ProcessGroup`` (``None``: the DDP's).
        matrix_approximation_rank: rank ``r`` of the factors.
        start_powerSGD_iter: plain allreduce for this many iterations first.
        min_compression_rate: compress a matrix only if ``n*m >= rate * r*(n+m)``.
        use_error_feedback: keep residuals and add them to the next step.
        warm_start: reuse last step's ``Q`` (else a fresh random one every step).
        orthogonalization_epsilon: added to column norms (0: plain Gram-Schmidt via QR).
        random_seed: seed of the initial ``Q`` (identical on every rank).
    """

    def __init__(
        self,
        process_group: object = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        **_ignored,
    ) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError(
                f"matrix_approximation_rank must be >= 1, got {matrix_approximation_rank}"
            )
        self.comm = process_group
        self.matrix_approximation_rank = int(matrix_approximation_rank)
        self.start_powerSGD_iter = int(start_powerSGD_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self.iter = 0
        self.feedback = ErrorFeedback()
        self.q_memory: dict[str, torch.Tensor] = {}
        self.phases = PhaseComms()

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration when `bucket` is the last of it."""
        if bucket.is_last():
            self.iter += 1

    def state_dict(self) -> dict:
        """The iteration, error feedback and Q matrices, for a checkpoint."""
        return {
            "iter": self.iter,
            "errors": self.feedback.state_dict(),
            "q": {k: v.detach().clone() for k, v in self.q_memory.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.iter = state["iter"]
        self.feedback.load_state_dict(state["errors"])
        self.q_memory = {k: v.detach().clone() for k, v in state["q"].items()}

    def _initial_q(self, name: str, m: int, device) -> torch.Tensor:
        seed = self.random_seed * 1_000_003 + zlib.crc32(name.encode())
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(m, self.matrix_approximation_rank, generator=gen)
        return q.to(device)


def _orthogonalize_(p: torch.Tensor, eps: float) -> None:
    if eps == 0:
        p.copy_(torch.linalg.qr(p, mode="reduced").Q)
        return
    for i in range(p.shape[1]):
        col = p[:, i : i + 1]
        col.div_(col.norm() + eps)
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(col @ (col.t() @ rest))


def powersgd_hook(state: PowerSGDState, bucket: GradBucket) -> torch.futures.Future:
    """Averages the bucket through rank-``r`` factors (see the module docstring)."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(f"powersgd_hook needs a PowerSGDState, got {type(state).__name__}")
    comm, comm2 = state.phases.get(hook_comm(state.comm, bucket))
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_hook(comm, bucket)
    scale = average_scale(comm, bucket)
    r = state.matrix_approximation_rank
    flat = bucket.packed(torch.float32)
    device = flat.device
    names, params = bucket.parameter_names(), bucket.parameters()
    error = local = None
    if state.use_error_feedback:
        error = state.feedback.flat(
            bucket.index(), names, [p.numel() for p in params], flat.numel(), device
        )
        flat.add_(error)
        local = flat.clone()
    matrices, plain = _split(state, names, params, flat)
    n_plain = sum(v.numel() for v in plain)
    first, ps = _first_phase(state, matrices, plain, n_plain, device)
    ticket = state.phases.issuer.ticket()
    result = new_future(device)
    second = torch.empty(
        sum(mat.shape[1] * r for _, mat in matrices), dtype=torch.float32, device=device
    )

    def project(done: torch.futures.Future) -> None:
        try:
            done.value()
            _project(state, matrices, ps, second)
        except BaseException as exc:
            state.phases.issuer.run(ticket, None)
            result.set_exception(exc)
            return
        try:
            work = state.phases.issuer.run(
                ticket, lambda: comm2.all_reduce(second, async_op=True)
            )
        except BaseException as exc:
            result.set_exception(exc)
            return
        work.get_future().then(decompress)

    def decompress(done: torch.futures.Future) -> None:
        try:
            done.value()
            second.mul_(scale)
            _decompress(state, matrices, ps, second)
            if plain:
                kernels.unpack(first[:n_plain], plain, scale=scale)
            if state.use_error_feedback:
                torch.sub(local, flat, out=error)
            result.set_result(flat)
        except BaseException as exc:
            result.set_exception(exc)

    state.maybe_increase_iter(bucket)
    comm.all_reduce(first, async_op=True).get_future().then(project)
    return result


def _split(state: PowerSGDState, names, params, flat: torch.Tensor):
    """The bucket's ``(name, matrix view)`` pairs to compress and its views to send as they
    are (fewer than two dimensions, or factors not ``min_compression_rate`` times smaller)."""
    r = state.matrix_approximation_rank
    matrices, plain = [], []
    offset = 0
    for name, p in zip(names, params, strict=True):
        view = flat[offset : offset + p.numel()]
        offset += p.numel()
        if p.dim() > 1:
            n, m = p.shape[0], p.numel() // p.shape[0]
            if n * m >= state.min_compression_rate * r * (n + m):
                matrices.append((name, view.view(n, m)))
                continue
        plain.append(view)
    return matrices, plain


def _first_phase(state: PowerSGDState, matrices, plain, n_plain: int, device):
    """The first allreduce's buffer (the plain tensors, then every ``P = M Q``) and the ``P``
    views into it."""
    r = state.matrix_approximation_rank
    n_p = sum(mat.shape[0] * r for _, mat in matrices)
    first = torch.empty(n_plain + n_p, dtype=torch.float32, device=device)
    if plain:
        kernels.pack(plain, first[:n_plain])
    ps = []
    offset = n_plain
    for name, mat in matrices:
        q = state.q_memory.get(name) if state.warm_start else None
        if q is None or q.shape != (mat.shape[1], r):
            q = state._initial_q(name, mat.shape[1], device)
            _orthogonalize_(q, state.orthogonalization_epsilon)
        p = first[offset : offset + mat.shape[0] * r].view(mat.shape[0], r)
        torch.matmul(mat, q, out=p)
        offset += p.numel()
        ps.append(p)
    return first, ps


def _project(state: PowerSGDState, matrices, ps, second: torch.Tensor) -> None:
    """Orthogonalizes each summed ``P`` and writes ``Q = M^T P`` into `second`."""
    r = state.matrix_approximation_rank
    offset = 0
    for (_, mat), p in zip(matrices, ps, strict=True):
        _orthogonalize_(p, state.orthogonalization_epsilon)
        q = second[offset : offset + mat.shape[1] * r].view(mat.shape[1], r)
        torch.matmul(mat.t(), p, out=q)
        offset += q.numel()


def _decompress(state: PowerSGDState, matrices, ps, second: torch.Tensor) -> None:
    """``M = P Q^T`` from the averaged ``Q`` in `second`, each ``Q`` kept for a warm start."""
    r = state.matrix_approximation_rank
    offset = 0
    for (name, mat), p in zip(matrices, ps, strict=True):
        q = second[offset : offset + mat.shape[1] * r].view(mat.shape[1], r)
        offset += q.numel()
        torch.matmul(p, q.t(), out=mat)
        state.q_memory[name] = q.clone()
