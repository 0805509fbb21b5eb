"""A barrier between ranks through flags in each other's memory: the sync kernel of the kernel
collectives, and the check that the ranks are in the same call.

Each rank owns a flag area of ``3 * n_ranks`` int64 words (`flag_area_words`): an epoch word
and two descriptor words (even and odd epochs) per peer, each written by that peer alone.
`peer_signal` writes its descriptor, announces epoch ``e`` to every rank (release, system
scope), spins until every peer announced ``>= e`` (acquire) and compares the peers'
descriptors with its own, on the launching stream.

Invariants: epochs only grow; the spin is bounded (``max_spins``, or a host stop request in
``control[0]``) and the outcome is reported in `CONTROL_WORDS` host-readable words (missing
ranks' mask, or `DISAGREE` and the differing peers); a failed barrier is sticky, so later
barriers return at once and the transport refuses further collectives.

The protocol, why it is right, and the control words: docs/kernels.md.
"""

from __future__ import annotations

import torch

from ._launch import check_tensor, kernel_backend, runnable, tl, triton

__all__ = [
    "CONTROL_WORDS",
    "DISAGREE",
    "MAX_RANKS",
    "check_peer_signal",
    "disagreeing_ranks",
    "flag_area_words",
    "launch_peer_signal",
    "peer_signal",
    "peer_signal_reference",
    "missing_ranks",
]

#: int64 words of the control block (stop request, report, failed epoch, this rank's and the
#: first disagreeing peer's descriptor).
CONTROL_WORDS = 5
#: Bit 63 of the report (``control[1]``): the ranks disagree (the other bits name the peers).
DISAGREE = -(1 << 63)
#: Most ranks one barrier spans (the missing-rank mask is one int64).
MAX_RANKS = 63
#: Spins between two reads of the host's stop word (a read of host memory costs a PCIe trip).
STOP_EVERY = 64
#: int64 words of a flag area per rank: its epoch word and its two descriptor words.
WORDS_PER_RANK = 3


def flag_area_words(n_ranks: int) -> int:
    """int64 words of a flag area for `n_ranks` ranks (see the module docstring)."""
    return WORDS_PER_RANK * n_ranks


@triton.jit
def _peer_signal_kernel(
    base_table,  # *int64 [N_RANKS]: address (bytes) of each rank's workspace
    flags_offset,  # byte offset of the flag area in every workspace
    control_addr,  # address of the CONTROL_WORDS int64 control block
    rank,  # this rank
    epoch,  # the barrier's epoch (> every earlier one)
    descriptor,  # int64 every rank must pass equal (the call it is part of)
    max_spins,  # spins before giving up
    N_RANKS: tl.constexpr,  # ranks in the barrier
    BLOCK_R: tl.constexpr,  # N_RANKS rounded up to a power of two
    STOP_EVERY: tl.constexpr,  # spins between reads of the stop word
):
    peers = tl.arange(0, BLOCK_R)
    mask = peers < N_RANKS
    # widened first: an interpreter may hold an argument that fits 32 bits as int32, and
    # refuses to reinterpret 4 bytes as an 8-byte pointer (a no-op when compiled)
    control = control_addr.to(tl.int64).to(tl.pointer_type(tl.int64))
    stop = tl.load(control, volatile=True)
    failed = tl.load(control + 1, volatile=True)
    if (stop == 0) & (failed == 0):
        parity = epoch % 2
        bases = tl.load(base_table + peers, mask=mask, other=0)
        mine_there = (bases + flags_offset + rank * 8).to(tl.pointer_type(tl.int64))
        # descriptor word of this parity: N_RANKS + 2 * rank + parity of every area
        desc_there = mine_there + (N_RANKS + rank + parity)
        descs = tl.zeros([BLOCK_R], tl.int64) + descriptor
        tl.store(desc_there, descs, mask=mask)
        # the release below then publishes the descriptor with the epoch, whichever thread
        # of the block stored it
        tl.debug_barrier()
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
        bits = tl.full([BLOCK_R], 1, tl.int64) << peers.to(tl.int64)
        if n_missing > 0:
            tl.store(control + 2, epoch)
            tl.store(control + 1, tl.sum(tl.where(missing, bits, 0)))
        else:
            # every peer announced >= epoch after storing its descriptor of this parity
            theirs = tl.load(own + N_RANKS + 2 * peers + parity, mask=mask, other=0,
                             volatile=True)
            differ = mask & (theirs != descriptor)
            if tl.sum(differ.to(tl.int32)) > 0:
                first = tl.min(tl.where(differ, peers, BLOCK_R))
                tl.store(control + 2, epoch)
                tl.store(control + 3, descriptor)
                tl.store(control + 4, tl.sum(tl.where(peers == first, theirs, 0)))
                sign = tl.full([], 1, tl.int64) << 63
                tl.store(control + 1, tl.sum(tl.where(differ, bits, 0)) | sign)


def _check_common(n_ranks: int, rank: int, epoch: int, max_spins: int, control,
                  descriptor: int) -> None:
    if not 1 <= n_ranks <= MAX_RANKS:
        raise ValueError(f"a barrier spans 1..{MAX_RANKS} ranks, got {n_ranks}")
    if not 0 <= rank < n_ranks:
        raise ValueError(f"rank must be in [0, {n_ranks}), got {rank}")
    if epoch < 1:
        raise ValueError(f"epoch must be >= 1 (flag words start at 0), got {epoch}")
    if max_spins < 0:
        raise ValueError(f"max_spins must be >= 0, got {max_spins}")
    if not -(1 << 63) <= descriptor < 1 << 63:
        raise ValueError(f"descriptor must fit an int64, got {descriptor}")
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
    descriptor: int = 1,
) -> None:
    """Enqueues one barrier of `epoch` among the ranks of `base_table` (see module docstring).

    Args:
        base_table: int64 ``[n_ranks]``, the address of every rank's workspace as mapped in this
            process, in rank order, on the device the kernel runs on.
        flags_offset: byte offset of the flag area (`flag_area_words` int64 words, 8-byte
            aligned) in every workspace.
        rank: this rank.
        epoch: the barrier's epoch, greater than every earlier one of this rank.
        control: int64 control block of `CONTROL_WORDS` words the kernel can address
            (pinned host memory for a CUDA launch).
        max_spins: spins before the barrier gives up and reports the missing ranks.
        descriptor: an int64 every rank of this barrier must pass equal; a peer's differing
            one is reported in the control block. A transport keeps it odd and at least
            ``2**56`` on a GPU: Triton compiles a variant per integer class of an argument
            (equal to 1, divisible by 16, 32- or 64-bit), and a barrier should not compile
            mid-collective while its peers spin.

    Raises:
        TypeError: `base_table` or `control` is not an int64 tensor.
        ValueError: a rank, epoch, spin bound, descriptor or offset out of range.
    """
    check_peer_signal(base_table, flags_offset, rank, epoch, control, max_spins, descriptor)
    launch_peer_signal(base_table, flags_offset, control.data_ptr(), rank, epoch, max_spins,
                       descriptor)


def check_peer_signal(
    base_table: torch.Tensor,
    flags_offset: int,
    rank: int,
    epoch: int,
    control: torch.Tensor,
    max_spins: int,
    descriptor: int = 1,
) -> None:
    """`peer_signal`'s argument checks, for a transport that makes them once at setup and
    then launches every barrier through `launch_peer_signal` (raises as `peer_signal`)."""
    check_tensor("base_table", base_table, dtypes=(torch.int64,))
    _check_common(base_table.numel(), rank, epoch, max_spins, control, descriptor)
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
    descriptor: int = 1,
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
        descriptor,
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
    descriptor: int = 1,
) -> None:
    """`peer_signal` over every rank's flag area as an int64 tensor (same protocol, on CPU).

    Args:
        flag_areas: rank order; ``flag_areas[q]`` is rank ``q``'s flag area (at least
            `flag_area_words` words), ``flag_areas[q][p]`` the epoch word rank ``p`` writes
            to rank ``q``.
        rank, epoch, control, max_spins, descriptor: as for `peer_signal`.
    """
    n_ranks = len(flag_areas)
    _check_common(n_ranks, rank, epoch, max_spins, control, descriptor)
    words = flag_area_words(n_ranks)
    for i, area in enumerate(flag_areas):
        check_tensor(f"flag_areas[{i}]", area, dtypes=(torch.int64,))
        if area.numel() < words:
            raise ValueError(f"flag_areas[{i}] has {area.numel()} words; needs {words}")
    if control[0].item() or control[1].item():
        return
    parity = epoch % 2
    for area in flag_areas:
        area[n_ranks + 2 * rank + parity] = descriptor
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
        return
    theirs = flag_areas[rank][n_ranks + parity : n_ranks + 2 * n_ranks : 2].tolist()
    differ = [p for p, d in enumerate(theirs) if d != descriptor]
    if differ:
        control[2] = epoch
        control[3] = descriptor
        control[4] = theirs[differ[0]]
        control[1] = DISAGREE | sum(1 << p for p in differ)


def missing_ranks(mask: int) -> list[int]:
    """The ranks of a missing-rank mask (``control[1]``), ascending."""
    return [p for p in range(MAX_RANKS) if mask >> p & 1]


def disagreeing_ranks(report: int) -> list[int]:
    """The peers of a disagreement report (``control[1]`` with `DISAGREE` set), ascending;
    empty for any other report."""
    return missing_ranks(report) if report < 0 else []
