"""A barrier between ranks through flags in each other's memory: the sync kernel of the kernel
collectives.

Every rank owns a *flag area* of ``n_ranks`` int64 words in its workspace; word ``p`` of rank
``q``'s area is written by rank ``p`` alone and holds the last barrier epoch ``p`` announced to
``q``. ``peer_signal(bases, ...)`` runs one barrier of epoch ``e`` on the launching stream:

1. unless the control words below already say "stop" or "failed", it writes ``e`` into its own
   word of every rank's flag area (``atomic_xchg``, release, system scope: the writes of the
   kernels before it on the stream are visible to a peer that sees the flag);
2. it spins reading its own flag area (``atomic_add`` of 0, acquire, system scope: the kernels
   after it read the peers' data only once every peer has announced ``e``) until every word
   is ``>= e``.

Epochs only grow, so ``>=`` is right even when a fast peer has already announced the next
barrier (it cannot get two ahead: that barrier waits for this rank).

A spinning kernel cannot time out by itself, so the spin is bounded twice, both reported
through three int64 *control words* the host can read without synchronizing (on a GPU they
sit in pinned host memory, mapped into the device's address space):

- ``control[0]`` (written by the host): nonzero asks every barrier to stop: a spinning one
  leaves its loop (checked every ``STOP_EVERY`` spins) and later ones return at once;
- ``control[1]`` (written by the kernel): the bit mask of the ranks that had not arrived when a
  barrier gave up (after ``max_spins`` spins or a stop), ``0`` while all is well;
- ``control[2]``: the epoch of that barrier.

A failed barrier is sticky: once ``control[1]`` is set every later barrier returns at once, so
a stream of collectives behind a missing rank drains in one spin bound instead of one per
barrier. The data written after a failed barrier is garbage; the transport reports the
failure and refuses further collectives.

The torch reference (`peer_signal_reference`) runs the same protocol over a list of flag-area
tensors (every rank's, in rank order) instead of an address table.
"""

from __future__ import annotations

import torch

from ._launch import check_tensor, kernel_backend, runnable, tl, triton

__all__ = [
    "CONTROL_WORDS",
    "MAX_RANKS",
    "check_peer_signal",
    "launch_peer_signal",
    "peer_signal",
    "peer_signal_reference",
    "missing_ranks",
]

#: int64 words of the control block (stop request, missing-rank mask, failed epoch).
CONTROL_WORDS = 3
#: Most ranks one barrier spans (the missing-rank mask is one int64).
MAX_RANKS = 63
#: Spins between two reads of the host's stop word (a read of host memory costs a PCIe trip).
STOP_EVERY = 64


@triton.jit
def _peer_signal_kernel(
    base_table,  # *int64 [N_RANKS]: address (bytes) of each rank's workspace
    flags_offset,  # byte offset of the flag area in every workspace
    control_addr,  # address of the CONTROL_WORDS int64 control block
    rank,  # this rank
    epoch,  # the barrier's epoch (> every earlier one)
    max_spins,  # spins before giving up
    N_RANKS: tl.constexpr,  # ranks in the barrier
    BLOCK_R: tl.constexpr,  # N_RANKS rounded up to a power of two
    STOP_EVERY: tl.constexpr,  # spins between reads of the stop word
):
    peers = tl.arange(0, BLOCK_R)
    mask = peers < N_RANKS
    control = control_addr.to(tl.pointer_type(tl.int64))
    stop = tl.load(control, volatile=True)
    failed = tl.load(control + 1, volatile=True)
    if (stop == 0) & (failed == 0):
        bases = tl.load(base_table + peers, mask=mask, other=0)
        mine_there = (bases + flags_offset + rank * 8).to(tl.pointer_type(tl.int64))
        epochs = tl.zeros([BLOCK_R], tl.int64) + epoch
        tl.atomic_xchg(mine_there, epochs, mask=mask, sem="release", scope="sys")
        own = (tl.load(base_table + rank) + flags_offset).to(tl.pointer_type(tl.int64))
        zero = tl.zeros([BLOCK_R], tl.int64)
        seen = tl.atomic_add(own + peers, zero, mask=mask, sem="acquire", scope="sys")
        missing = mask & (seen < epoch)
        n_missing = tl.sum(missing.to(tl.int32))
        spins = tl.full([], 0, tl.int64)  # int64: a long timeout passes 2**31 spins
        while (n_missing > 0) & (spins < max_spins) & (stop == 0):
            seen = tl.atomic_add(own + peers, zero, mask=mask, sem="acquire", scope="sys")
            missing = mask & (seen < epoch)
            n_missing = tl.sum(missing.to(tl.int32))
            spins += 1
            if spins % STOP_EVERY == 0:
                stop = tl.load(control, volatile=True)
        if n_missing > 0:
            bits = tl.full([BLOCK_R], 1, tl.int64) << peers.to(tl.int64)
            tl.store(control + 2, epoch)
            tl.store(control + 1, tl.sum(tl.where(missing, bits, 0)))


def _check_common(n_ranks: int, rank: int, epoch: int, max_spins: int, control) -> None:
    if not 1 <= n_ranks <= MAX_RANKS:
        raise ValueError(f"a barrier spans 1..{MAX_RANKS} ranks, got {n_ranks}")
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank must be in [0, {n_ranks}), got {rank}")
    if epoch < 1:
        raise ValueError(f"epoch must be >= 1 (flag words start at 0), got {epoch}")
    if max_spins < 0:
        raise ValueError(f"max_spins must be >= 0, got {max_spins}")
    check_tensor("control", control, dtypes=(torch.int64,))
    if control.numel() < CONTROL_WORDS:
        raise ValueError(f"control has {control.numel()} words; needs {CONTROL_WORDS}")


def peer_signal(
    base_table: torch.Tensor,
    *,
    flags_offset: int,
    rank: int,
    epoch: int,
    control: torch.Tensor,
    max_spins: int,
) -> None:
    """Enqueues one barrier of `epoch` among the ranks of `base_table` (see module docstring).

    Args:
        base_table: int64 ``[n_ranks]``, the address of every rank's workspace as mapped in this
            process, in rank order, on the device the kernel runs on.
        flags_offset: byte offset of the flag area (``n_ranks`` int64 words, 8-byte aligned)
            in every workspace.
        rank: this rank.
        epoch: the barrier's epoch, greater than every earlier one of this rank.
        control: int64 control block of `CONTROL_WORDS` words the kernel can address
            (pinned host memory for a CUDA launch).
        max_spins: spins before the barrier gives up and reports the missing ranks.

    Raises:
        TypeError: `base_table` or `control` is not an int64 tensor.
        ValueError: a rank, epoch, spin bound or offset out of range.
    """
    check_peer_signal(base_table, flags_offset, rank, epoch, control, max_spins)
    launch_peer_signal(base_table, flags_offset, control.data_ptr(), rank, epoch, max_spins)


def check_peer_signal(
    base_table: torch.Tensor,
    flags_offset: int,
    rank: int,
    epoch: int,
    control: torch.Tensor,
    max_spins: int,
) -> None:
    """`peer_signal`'s argument checks, for a transport that makes them once at setup and
    then launches every barrier through `launch_peer_signal` (raises as `peer_signal`)."""
    check_tensor("base_table", base_table, dtypes=(torch.int64,))
    _check_common(base_table.numel(), rank, epoch, max_spins, control)
    if flags_offset < 0 or flags_offset % 8:
        raise ValueError(f"flags_offset must be a non-negative multiple of 8, got {flags_offset}")
    if kernel_backend(base_table) != "triton":
        raise RuntimeError(
            "peer_signal follows raw addresses and has no torch path: it needs a CUDA table, or "
            "FASTCOMM_KERNELS=triton with TRITON_INTERPRET=1 for a CPU one "
            "(peer_signal_reference runs the protocol over tensors)"
        )


def launch_peer_signal(
    base_table: torch.Tensor,
    flags_offset: int,
    control_addr: int,
    rank: int,
    epoch: int,
    max_spins: int,
) -> None:
    """Launches one barrier with no argument checks (see `check_peer_signal`): the hot call
    of a collective, a few per round."""
    n_ranks = base_table.numel()
    runnable(_peer_signal_kernel)[(1,)](
        base_table,
        flags_offset,
        control_addr,
        rank,
        epoch,
        max_spins,
        N_RANKS=n_ranks,
        BLOCK_R=max(2, triton.next_power_of_2(n_ranks)),
        STOP_EVERY=STOP_EVERY,
        num_warps=1,
    )


def peer_signal_reference(
    flag_areas: list[torch.Tensor],
    *,
    rank: int,
    epoch: int,
    control: torch.Tensor,
    max_spins: int,
) -> None:
    """`peer_signal` over every rank's flag area as an int64 tensor (same protocol, on CPU).

    Args:
        flag_areas: rank order; ``flag_areas[q][p]`` is the word rank ``p`` writes to rank ``q``.
        rank, epoch, control, max_spins: as for `peer_signal`.
    """
    n_ranks = len(flag_areas)
    _check_common(n_ranks, rank, epoch, max_spins, control)
    for i, area in enumerate(flag_areas):
        check_tensor(f"flag_areas[{i}]", area, dtypes=(torch.int64,))
        if area.numel() < n_ranks:
            raise ValueError(f"flag_areas[{i}] has {area.numel()} words; needs {n_ranks}")
    if control[0].item() or control[1].item():
        return
    for area in flag_areas:
        area[rank] = epoch
    own = flag_areas[rank][:n_ranks]
    spins = 0
    missing = own < epoch
    while bool(missing.any()) and spins < max_spins:
        spins += 1
        if spins % STOP_EVERY == 0 and control[0].item():
            break
        missing = own < epoch
    if bool(missing.any()):
        control[2] = epoch
        control[1] = sum(1 << p for p in missing.nonzero().flatten().tolist())


def missing_ranks(mask: int) -> list[int]:
    """The ranks of a missing-rank mask (``control[1]``), ascending."""
    return [p for p in range(MAX_RANKS) if mask >> p & 1]
