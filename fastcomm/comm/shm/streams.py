"""Streamed point-to-point: each ordered pair of ranks streams chunks through its two mailbox
slots, counted by the pair's ``sent``/``acked`` words.

Chunk ``k`` of a pair's stream goes into slot ``k % 2`` (a 64-byte header: the message's total
bytes, its tag, its dtype code; then at most ``mbox_bytes - 64`` of it) once the receiver took
chunk ``k - 2``. A chunk is one C call where the compiled core is built, else the same steps in
Python, with the same :class:`~.core.Status`. The communicator's ``send``/``recv`` and the
tagged engine of ``p2p.py`` share these streams and counters. Protocol: ``docs/shm.md``.
"""

from __future__ import annotations

import ctypes
import time

import torch

from ..errors import FastcommError
from .core import CompiledRounds, Status
from .flags import fence
from .rounds import Rounds, pair_words

__all__ = ["HEADER_BYTES", "Streams"]

HEADER_BYTES = 64  # first bytes of a mailbox slot: total bytes, tag, dtype code
_U64 = (1 << 64) - 1
_memmove = ctypes.memmove
_increment_version = torch._C._increment_version


class Streams:
    """This rank's ends of every pair's stream.

    Args:
        rounds: the rank's rounds (flags, layout, the segment).
        compiled: the compiled core, or ``None`` (the pure-Python chunks).
    """

    def __init__(self, rounds: Rounds, compiled: CompiledRounds | None) -> None:
        self.flags = rounds.flags
        self.layout = layout = rounds.layout
        self.rank = rounds.rank
        self.size = rounds.size
        self.compiled = compiled
        self.chunk_bytes = layout.mbox_bytes - HEADER_BYTES  # the most bytes one chunk holds
        self.sent = [0] * self.size  # chunks sent to / taken from each peer
        self.received = [0] * self.size
        #: per peer, the pair's four counter words (:func:`~.rounds.pair_words`)
        self.pair_words = [pair_words(layout, self.rank, r) for r in range(self.size)]
        self._base = self.flags.base_address
        if compiled is not None:
            self._send, self._recv = compiled.send_chunk, compiled.recv_chunk
        else:
            self._send, self._recv = self._send_python, self._recv_python

    # ------------------------------------------------------------------ one chunk
    def send_chunk(self, dst: int, addr: int, count: int, total: int, spin_ns: int = 0,
                   tag: int = 0, dtype: int = 0) -> int:
        """Puts the next chunk to ``dst`` (``count`` bytes at ``addr`` of a ``total``-byte
        message) when its slot is free (waiting at most ``spin_ns``); a :class:`Status`:
        ``DONE`` (counted) or ``SLOT_WAIT`` (nothing done)."""
        k = self.sent[dst]
        status = self._send(addr, count, total, dst, k, spin_ns, tag & _U64, dtype)
        if not status:
            self.sent[dst] = k + 1
        return status

    def recv_chunk(self, src: int, addr: int, count: int, total: int, spin_ns: int = 0,
                   tag: int = 0, dtype: int = 0) -> int:
        """Takes the next chunk from ``src`` into ``count`` bytes at ``addr`` when it is there
        (waiting at most ``spin_ns``) and its header says ``total`` bytes, ``tag`` and
        ``dtype`` (0 on either side: not compared); a :class:`Status`: ``DONE`` (counted),
        ``MESSAGE_WAIT``, ``SIZE_MISMATCH`` or ``TAG_OTHER`` (nothing done)."""
        k = self.received[src]
        status = self._recv(addr, count, total, src, k, spin_ns, tag & _U64, dtype)
        if not status:
            self.received[src] = k + 1
        return status

    def header(self, src: int) -> tuple[int, int, int] | None:
        """``(total bytes, tag, dtype code)`` of the next chunk from ``src``, or ``None`` when
        it has not arrived."""
        words = self.flags.words
        k = self.received[src]
        if words[self.pair_words[src][2]] < k + 1:
            return None
        if self.flags.fenced:
            fence()
        w = self.layout.mailbox(src, self.rank, k & 1) // 8
        return words[w], words[w + 1], words[w + 2]

    def _send_python(self, addr, count, total, dst, k, spin_ns, tag, dtype) -> int:
        """The core's ``send`` in Python (``spin_ns`` unused: one look)."""
        sent_idx, acked_idx = self.pair_words[dst][:2]
        words = self.flags.words
        if k >= 2 and words[acked_idx] < k - 1:  # slot k % 2 is free once chunk k - 2 is taken
            return Status.SLOT_WAIT
        box = self.layout.mailbox(self.rank, dst, k & 1)
        w = box // 8
        words[w], words[w + 1], words[w + 2] = total, tag, dtype
        if count:
            _memmove(self._base + box + HEADER_BYTES, addr, count)
        self.flags.set_word(sent_idx, k + 1, acked_idx + 1)
        return Status.DONE

    def _recv_python(self, addr, count, total, src, k, spin_ns, tag, dtype) -> int:
        """The core's ``recv`` in Python (``spin_ns`` unused: one look)."""
        sent_idx, acked_idx = self.pair_words[src][2:]
        words = self.flags.words
        if words[sent_idx] < k + 1:
            return Status.MESSAGE_WAIT
        if self.flags.fenced:  # the chunk's bytes after the counter (flags.py)
            fence()
        box = self.layout.mailbox(src, self.rank, k & 1)
        w = box // 8
        if words[w + 1] != tag:
            return Status.TAG_OTHER
        if words[w] != total or (dtype and words[w + 2] and words[w + 2] != dtype):
            return Status.SIZE_MISMATCH
        if count:
            _memmove(addr, self._base + box + HEADER_BYTES, count)
        self.flags.set_word(acked_idx, k + 1, sent_idx + 1)
        return Status.DONE

    # ------------------------------------------------------------------ whole messages
    def send(self, data: torch.Tensor, dst: int, start: float | None = None) -> None:
        """Streams the bytes of ``data`` (contiguous, on the CPU) to ``dst``, chunk by chunk;
        ``start``: when the call began (default: now)."""
        self._stream(data, dst, time.monotonic() if start is None else start, True)

    def recv(self, data: torch.Tensor, src: int, start: float | None = None) -> None:
        """Receives the bytes of ``data`` (contiguous, on the CPU) from ``src``.

        Raises:
            FastcommError: ``src`` sent another number of bytes (nothing is copied).
        """
        self._stream(data, src, time.monotonic() if start is None else start, False)
        _increment_version((data,))  # written behind torch's back

    def _stream(self, data: torch.Tensor, peer: int, start: float, sending: bool) -> None:
        """One message, a chunk per call: a send waits for the slot (the peer's ``acked``
        reaching ``k - 1``), a recv for the chunk (the peer's ``sent`` reaching ``k + 1``),
        each announced in the word after its own counter of the pair while it sleeps."""
        flags = self.flags
        idx = self.pair_words[peer]
        if sending:
            move, counters, waiting, name = self.send_chunk, self.sent, Status.SLOT_WAIT, "send"
            word, announce, ahead = idx[1], idx[0] + 1, -1
        else:
            move, counters, waiting = self.recv_chunk, self.received, Status.MESSAGE_WAIT
            word, announce, ahead, name = idx[2], idx[3] + 1, 1, "recv"
        total = data.numel() * data.element_size()
        addr, room, offset = data.data_ptr(), self.chunk_bytes, 0
        while True:
            count = min(room, total - offset)
            status = move(peer, addr + offset, count, total, flags.spin_budget_ns())
            if status == waiting:
                k = counters[peer]
                flags.wait_word(word, k + ahead, peer, name, start, announce_idx=announce)
                status = move(peer, addr + offset, count, total, 0)
            if status:
                if status == Status.SIZE_MISMATCH:
                    self._size_mismatch(total, peer)
                raise AssertionError(f"the {name} of a chunk returned status {status}")
            offset += count
            if offset >= total:
                return

    def _size_mismatch(self, expected: int, src: int) -> None:
        """Raises for a message whose header (the next chunk from ``src``) holds another size."""
        k = self.received[src]
        sent = self.flags.words[self.layout.mailbox(src, self.rank, k & 1) // 8]
        raise FastcommError(
            f"rank {self.rank}: recv from rank {src} expected {expected} bytes but rank {src} "
            f"sent {sent}"
        )
