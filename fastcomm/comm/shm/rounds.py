"""Rounds over a segment's slots: half alternation, the call descriptors, agreement, slot views.

Each round uses one half of the data area, alternating, and every rank publishes the same
number of times per round, so the next call never waits for the slowest reader of the last
one. Before its first publish of a call, every rank records the call in two descriptor words
(A and B: ``calls.shm_words``) of the round's half; in the call's first round every rank
compares its peers' with its own, so ranks that disagree all raise. The protocol: ``docs/shm.md``.
"""

from __future__ import annotations

import torch

from ..calls import TWO_STEP, describe, from_shm_words, mismatch_message
from ..errors import CollectiveMismatchError
from .flags import PeerFlags
from .segment import Layout

__all__ = ["Rounds", "chunks", "pair_words"]

ONE_SHOT_WORD = 10  # misc word 10 of a rank's control block: its one_shot_max (messages)
_VIEW_CACHE = 512  # cached views of the segment (every new size adds an entry)


def pair_words(layout: Layout, rank: int, peer: int) -> tuple[int, int, int, int]:
    """Word indices of the counters of ``rank``'s stream traffic with ``peer``: ``rank``'s
    ``sent`` to ``peer``, ``peer``'s ``acked`` of those, ``peer``'s ``sent`` to ``rank``,
    ``rank``'s ``acked`` of those. The word after each is its owner's announcement."""
    return (layout.sent(rank, peer) // 8, layout.acked(peer, rank) // 8,
            layout.sent(peer, rank) // 8, layout.acked(rank, peer) // 8)


def chunks(total: int, chunk: int):
    """``(start, count)`` per round; one empty round for ``total == 0`` (the descriptors still
    meet)."""
    if not total:
        yield 0, 0
        return
    for start in range(0, total, chunk):
        yield start, min(chunk, total - start)


class Rounds:
    """One rank's rounds over the slots of a segment.

    Args:
        flags: this rank's flags.
        layout: the segment's layout.
        u8: the whole segment as a flat ``uint8`` tensor.
        one_shot_max: this rank's largest one-shot all-reduce (bytes), published for the
            message when ranks disagree on it.
    """

    def __init__(self, flags: PeerFlags, layout: Layout, u8: torch.Tensor,
                 one_shot_max: int) -> None:
        self.flags = flags
        self.layout = layout
        self.u8 = u8
        self.rank = flags.rank
        self.size = layout.size
        self.slot_bytes = layout.slot_bytes
        self.started = 0  # rounds begun: the next one's half is started & 1
        self.first_seq = 0  # this rank's seq at the first publish of the previous round
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._views: dict[tuple, object] = {}
        flags.words[layout.misc(self.rank, ONE_SHOT_WORD) // 8] = min(one_shot_max, 2**64 - 1)

    # ------------------------------------------------------------------ a round's steps
    def next_half(self) -> int:
        """Begins a round: its half (no wait; :meth:`enter` or the core waits)."""
        half = self.started & 1
        self.started += 1
        return half

    def enter(self, op: str, start: float, word_a: int, word_b: int = 0) -> int:
        """Begins a round: waits until its half is free, records the call; returns the half."""
        half = self.next_half()
        flags = self.flags
        flags.wait_all(self.first_seq, op, start)
        desc = flags.desc_idx[self.rank]
        flags.words[desc[half]] = word_a
        flags.words[desc[2 + half]] = word_b
        return half

    def enter_quick(self, half: int, word_a: int, op: str, start: float) -> None:
        """:meth:`enter` of a half already taken (:meth:`next_half`), descriptor B 0; a peer
        already there costs one word read."""
        flags, words = self.flags, self.flags.words
        target = self.first_seq
        for idx in flags.peer_seq_idx:
            if words[idx] < target:
                flags.wait_all(target, op, start)
                break
        else:
            if flags.fenced:  # the fence after the flag loads, before the slot is rewritten
                flags.wait_all(target, op, start)
        desc = flags.desc_idx[self.rank]
        words[desc[half]] = word_a
        words[desc[2 + half]] = 0

    def publish_first(self) -> None:
        """The round's first publish (the next round but one may reuse its half after it)."""
        self.first_seq = self.flags.publish()

    def exchange_quick(self, half: int, word_a: int, op: str, start: float) -> None:
        """Publishes this rank's slot, waits for every peer's and checks their descriptors
        (B 0), after :meth:`enter_quick`."""
        flags, words = self.flags, self.flags.words
        self.first_seq = target = flags.publish()
        for idx in flags.peer_seq_idx:
            if words[idx] < target:
                flags.wait_all(target, op, start)
                break
        else:
            if flags.fenced:
                flags.wait_all(target, op, start)  # the fence after the flag loads
        for desc in flags.peer_desc_idx:
            if words[desc[half]] != word_a or words[desc[2 + half]]:
                self.check(half, word_a)

    def check(self, half: int, word_a: int, word_b: int = 0) -> None:
        """Raises unless every peer recorded the same call in ``half`` (after waiting for all)."""
        words, desc_idx = self.flags.words, self.flags.desc_idx
        for p in self.flags.peers:
            theirs, theirs_b = words[desc_idx[p][half]], words[desc_idx[p][2 + half]]
            if theirs != word_a or theirs_b != word_b:
                raise CollectiveMismatchError(self._mismatch(p, word_a, word_b, theirs, theirs_b))

    def _mismatch(self, peer: int, word_a: int, word_b: int, theirs: int, theirs_b: int) -> str:
        mine = from_shm_words(word_a, word_b)
        problem = (f"rank {self.rank} called {describe(mine)} but rank {peer} called "
                   f"{describe(from_shm_words(theirs, theirs_b))}")
        message = mismatch_message(self.rank, mine.op, problem)
        if (word_a ^ theirs) == TWO_STEP << 56 and word_b == theirs_b:
            words, layout = self.flags.words, self.layout
            mine = words[layout.misc(self.rank, ONE_SHOT_WORD) // 8]
            other = words[layout.misc(peer, ONE_SHOT_WORD) // 8]
            message += (
                f" (ranks disagree on one_shot_max: {mine} bytes on rank {self.rank}, {other} "
                f"on rank {peer}; every rank must pass the same ShmOptions)"
            )
        return message

    # ------------------------------------------------------------------ views of the slots
    def slots(self, half: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Typed views of every rank's slot in ``half``, then (index ``size``) its result slot."""
        typed = self._typed.get(dtype)
        if typed is None:
            nbytes, layout = self.slot_bytes, self.layout
            typed = [
                [
                    self.u8[layout.slot(h, r) : layout.slot(h, r) + nbytes].view(dtype)
                    for r in range(self.size + 1)
                ]
                for h in range(2)
            ]
            self._typed[dtype] = typed
        return typed[half]

    def cached_view(self, key: tuple):
        """A view of the segment cached under ``key`` by :meth:`cache_view`, or ``None``."""
        return self._views.get(key)

    def cache_view(self, key: tuple, views) -> None:
        """Caches views of the segment; bounded, since every new size adds an entry."""
        if len(self._views) >= _VIEW_CACHE:
            self._views.clear()
        self._views[key] = views

    def rows_of_every_slot(self, half: int, dtype: torch.dtype, rows: int,
                           count: int) -> torch.Tensor:
        """Every rank's slot in ``half`` as one ``(size, rows, count)`` view (slot ``q`` holding
        ``rows`` rows of ``count`` elements), cached: one op then moves all ranks' rows."""
        key = (half, dtype, rows, count, "rows")
        block = self._views.get(key)
        if block is None:
            first = self.slots(half, dtype)[0]
            stride = self.slot_bytes // first.element_size()
            block = first.as_strided((self.size, rows, count), (stride, count, 1))
            self.cache_view(key, block)
        return block

    def slot_views_like(self, half: int, piece: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's slot in ``half`` viewed with ``piece``'s dtype and shape, cached."""
        key = (half, piece.dtype, piece.shape)
        views = self._views.get(key)
        if views is None:
            numel = piece.numel()
            slots = self.slots(half, piece.dtype)[: self.size]
            views = [s[:numel].view(piece.shape) for s in slots]
            self.cache_view(key, views)
        return views
