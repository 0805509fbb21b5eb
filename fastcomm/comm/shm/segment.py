"""The ``shm`` segment: a POSIX shared-memory file per communicator, its layout and lifetime.

A header, one control block per rank (its progress words, written by that rank alone), two
halves of per-rank data slots plus a result slot each, and two mailbox slots per ordered pair
of ranks. Nothing of the segment outlives setup in ``/dev/shm``. Layout, setup and the
liveness checks: ``docs/shm.md``.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from itertools import count

from ..errors import CommTimeoutError, FastcommError, PeerLostError, StoreTimeoutError
from ..store import Store

__all__ = [
    "NAME_PATTERN",
    "Layout",
    "Segment",
    "attach_segment",
    "creator_gone",
    "pid_namespace",
    "pid_start_time",
    "process_alive",
    "round_up",
    "segment_name",
    "sweep_stale",
    "unlink_segment",
]

SHM_DIR = "/dev/shm"
PREFIX = "fastcomm-"
NAME_PATTERN = re.compile(r"fastcomm-[0-9a-f-]+")  # what segment_name makes: digits, hex, dashes
# the protocol's version: 002 added descriptor B, the two-step tag and every rank's check;
# 003 the send/recv waiters' announcement words (a counter's sleepers are woken only then)
MAGIC = int.from_bytes(b"FCSHM003", "little")
LINE = 128  # two 64-byte lines: the adjacent-line prefetcher moves lines in pairs
PAGE = 4096
MESSAGE_BYTES = 256

# rank states (control block word STATE)
ALIVE, CLOSED, ABORTED = 0, 1, 2

_names = count()


def shm_supported() -> bool:
    """Whether this platform has POSIX shared memory under ``/dev/shm`` (Linux)."""
    return os.name == "posix" and os.path.isdir(SHM_DIR) and os.path.isdir("/proc/self")


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets of every region for ``size`` ranks (see the module docstring)."""

    size: int
    slot_bytes: int
    mbox_bytes: int

    @property
    def ctrl_stride(self) -> int:
        """Bytes of one rank's control block (its lines, page aligned)."""
        return round_up(4 * LINE + 2 * self.size * LINE, PAGE)

    def ctrl(self, rank: int) -> int:
        """Offset of ``rank``'s control block."""
        return PAGE + rank * self.ctrl_stride

    def seq(self, rank: int) -> int:
        """Offset of ``rank``'s step counter (the first line of its control block)."""
        return self.ctrl(rank)

    def misc(self, rank: int, word: int) -> int:
        """Word ``word`` of the misc line: 0 waiting_on, 1 state, 2 pid, 3 start, 4/5
        descriptor A (one per half), 6/7 PremulSum factor (one per half), 8/9 descriptor B (one
        per half), 10 one_shot_max."""
        return self.ctrl(rank) + LINE + 8 * word

    def message(self, rank: int) -> int:
        """Offset of ``rank``'s error message (why it aborted)."""
        return self.ctrl(rank) + 2 * LINE

    def sent(self, rank: int, dst: int) -> int:
        """Offset of the count of messages ``rank`` has put in its mailboxes to ``dst`` (the
        word after it: ``rank``'s announcement that it sleeps on ``dst``'s ``acked``)."""
        return self.ctrl(rank) + 4 * LINE + dst * LINE

    def acked(self, rank: int, src: int) -> int:
        """Offset of the count of messages from ``src`` that ``rank`` has taken (the word after
        it: ``rank``'s announcement that it sleeps on ``src``'s ``sent``)."""
        return self.ctrl(rank) + 4 * LINE + (self.size + src) * LINE

    @property
    def data(self) -> int:
        """Offset of the first data slot (after every control block)."""
        return PAGE + self.size * self.ctrl_stride

    def slot(self, half: int, rank: int) -> int:
        """Slot ``rank`` of ``half``; ``rank == size`` is the half's shared result slot."""
        return self.data + (half * (self.size + 1) + rank) * self.slot_bytes

    @property
    def mailboxes(self) -> int:
        """Offset of the first send/recv mailbox (after both halves' slots)."""
        return self.data + 2 * (self.size + 1) * self.slot_bytes

    def mailbox(self, src: int, dst: int, k: int) -> int:
        """Offset of mailbox ``k`` (0 or 1) from ``src`` to ``dst``."""
        pair = src * (self.size - 1) + (dst if dst < src else dst - 1)
        return self.mailboxes + (2 * pair + k) * self.mbox_bytes

    @property
    def total(self) -> int:
        """Bytes of the whole segment."""
        return self.mailboxes + 2 * self.size * (self.size - 1) * self.mbox_bytes


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after ``pid (comm)`` (the state first: field 3 of
    stat(5) is ``[0]``), or ``None`` if there is no such process, or it is a zombie (exited, not
    reaped yet: ``os.kill(pid, 0)`` would still succeed on it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return fields


def pid_start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``, or ``None`` if it is gone or a
    zombie."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])  # field 22 of stat(5)


#: The kernel's flag of a task in its exit path (``PF_EXITING``, include/linux/sched.h): field 9
#: of stat(5).
_PF_EXITING = 0x4


def process_exiting(pid: int, start_time: int | None = None) -> bool:
    """Whether ``pid`` (the process that started at ``start_time``) is gone or on its way out:
    no such process, a zombie, or its main thread in the kernel's exit path. A SIGKILLed
    process shows the flag within a few ms; its pidfd becomes readable only once the kernel has
    torn its memory down, tens of ms later for a process holding hundreds of MB. (A Python
    process's main thread leaves only with the whole process.)"""
    fields = _stat_fields(pid)
    if fields is None or (start_time and int(fields[19]) != start_time):
        return True  # gone, a zombie, or the pid is another process's now
    return bool(int(fields[6]) & _PF_EXITING)  # field 9 of stat(5)


def process_alive(pid: int, start_time: int | None = None) -> bool:
    """Whether ``pid`` runs (and, given ``start_time``, is the same process, not a reused pid)."""
    now = pid_start_time(pid)
    return now is not None and (start_time is None or now == start_time)


def pid_namespace() -> int:
    """Inode of this process's PID namespace (0 when ``/proc`` does not say: then nothing this
    process finds can be proven to be of its namespace, and it sweeps nothing)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(token: str) -> str:
    """The file name of a segment this process creates (fields in the module docstring)."""
    pid = os.getpid()
    return f"{PREFIX}{pid}-{pid_start_time(pid) or 0}-{pid_namespace()}-{token}"


def creator_gone(name: str, namespace: int | None = None) -> bool:
    """Whether the creator of the segment file ``name`` is provably gone (module docstring).

    Args:
        name: a file name under ``/dev/shm``.
        namespace: the sweeper's PID namespace inode (default: this process's).
    """
    if not name.startswith(PREFIX):
        return False
    fields = name[len(PREFIX) :].split("-")
    if len(fields) < 4 or not all(f.isdigit() for f in fields[:3]):
        return False  # no namespace or start time in the name: nothing can be proven
    pid, start, ns = (int(f) for f in fields[:3])
    namespace = pid_namespace() if namespace is None else namespace
    if start == 0 or ns == 0 or ns != namespace:
        return False  # another PID namespace: its pids mean other processes than ours
    return not process_alive(pid, start)


def sweep_stale() -> list[str]:
    """Unlinks fastcomm segments whose creating process is provably gone; returns their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    namespace = pid_namespace()
    for name in names:
        if not creator_gone(name, namespace):
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass  # another process swept it first
    return removed


#: the prefix of a rank's ``shm/mapped/R`` value when its setup ended on a lost member
_LOST = "lost: "


def _raise_lost_elsewhere(store: Store, keys: list[str], rank: int, exc: Exception) -> None:
    """Raises ``PeerLostError`` where another rank's setup ended on a lost member (and its
    creator removed the file this rank could not open)."""
    for r, key in enumerate(keys):
        if r != rank and store.check([key]):
            value = store.get(key).decode("utf-8", "replace")
            if value.startswith(_LOST):
                raise PeerLostError(
                    f"rank {rank}: shm setup failed on rank {r}: {value[len(_LOST):]}", "flag",
                    time.time()) from exc


class Segment:
    """A mapped segment; build with :meth:`setup` on every rank of a communicator.

    Attributes:
        name: the file name it had under ``/dev/shm`` (unlinked once every rank mapped it).
        layout: region offsets.
        mm: the shared mapping.
    """

    def __init__(self, name: str, layout: Layout, mm: mmap.mmap) -> None:
        self.name = name
        self.layout = layout
        self.mm = mm

    @classmethod
    def setup(
        cls,
        store: Store,
        rank: int,
        size: int,
        slot_bytes: int,
        mbox_bytes: int,
        timeout: timedelta,
    ) -> Segment:
        """Rank 0 creates the segment and publishes its name; every rank maps it and unlinks it
        once all have mapped it (rank 0 also on any failure). A name read back from the store
        must look like one :func:`segment_name` makes, since it is joined into a path.

        A rank whose layout differs from the segment's (another slot size, mailbox size or rank
        count) says so in the store before it raises, so every rank raises with its message
        instead of waiting for it until the timeout.

        Raises:
            FastcommError: the segment could not be created, opened or verified (on this rank or,
                named, on another).
            StoreTimeoutError: a rank did not map it within ``timeout``.
        """
        layout = Layout(size, slot_bytes, mbox_bytes)
        path = None
        keys = [f"shm/mapped/{r}" for r in range(size)]
        try:
            if rank == 0:
                sweep_stale()
                name = segment_name(f"{secrets.token_hex(6)}-{next(_names)}")
                path = os.path.join(SHM_DIR, name)
                mm = _create(path, layout)
                store.set("shm/name", name)
            else:
                raw = store.get("shm/name", timeout)
                name = raw.decode("ascii", "replace")
                try:
                    if not NAME_PATTERN.fullmatch(name):  # joined into a path: ours or nothing
                        raise FastcommError(
                            f"rank {rank}: the store's shm/name {raw[:80]!r} is not a segment "
                            f"name (expected {NAME_PATTERN.pattern})"
                        )
                    mm = attach_segment(os.path.join(SHM_DIR, name), layout, rank)
                except FastcommError as exc:
                    store.set(keys[rank], f"error: {exc}")
                    _raise_lost_elsewhere(store, keys, rank, exc)  # the file went with it
                    raise
            seg = cls(name, layout, mm)
            seg._put(layout.misc(rank, 2), os.getpid())
            seg._put(layout.misc(rank, 3), pid_start_time(os.getpid()) or 0)
            store.set(keys[rank], b"1")
            try:
                seg._wait_mapped(store, keys, rank, timeout)
            except PeerLostError as exc:  # a rank still to map it reads why the file is gone
                store.set(keys[rank], f"{_LOST}{exc}")
                raise
            # every rank has mapped it: any of them may unlink it now, so none returns from
            # setup with the name still in /dev/shm (unlinking twice is harmless)
            path = os.path.join(SHM_DIR, name)
            failed = [(r, store.get(keys[r], timeout)) for r in range(size) if r != rank]
            failed = [(r, value.decode("utf-8", "replace")) for r, value in failed if value != b"1"]
            if failed:
                mm.close()
                raise FastcommError(
                    f"rank {rank}: shm setup failed on rank {failed[0][0]}: "
                    f"{failed[0][1].removeprefix('error: ').removeprefix(_LOST)}"
                )
        finally:
            if path is not None:
                unlink_segment(path)
        return seg

    @classmethod
    def setup_successor(
        cls,
        old_name: str,
        identities: list[tuple[int, int | None]],
        tag: str,
        rank: int,
        slot_bytes: int,
        mbox_bytes: int,
        timeout: timedelta,
    ) -> Segment:
        """The segment of the survivors of the segment `old_name`, made without a store round
        (in-place recovery's shrink: every new member held that one). `identities`: each
        survivor's ``(pid, start time)`` as recorded there, in new-rank order; `tag`: what makes
        this successor's name unique, the same on every survivor (its store namespace). The
        name follows from what they share: the new rank 0's pid and start time and a digest of
        the old name and `tag`. Rank 0 creates the file under a name of its own and renames it
        into place, so it appears whole; each survivor maps it and records its pid in it, waits
        until all have, and unlinks it.

        Raises:
            PeerLostError: a survivor died before every one had mapped it.
            CommTimeoutError: a survivor did not map it within ``timeout``.
            FastcommError: the segment could not be created or mapped.
        """
        size = len(identities)
        layout = Layout(size, slot_bytes, mbox_bytes)
        pid, start = identities[0]
        digest = hashlib.blake2b(f"{old_name}|{tag}".encode(), digest_size=6).hexdigest()
        name = f"{PREFIX}{pid}-{start or 0}-{pid_namespace()}-{digest}"
        path = os.path.join(SHM_DIR, name)
        begin = time.monotonic()

        def wait(missing: Callable[[], list[int]], what: str) -> None:
            """Until `missing()` (the ranks still to do `what`) is empty; a missing rank that
            died, or the timeout, raises."""
            pause = 0.0002
            while waiting_on := missing():
                for r in waiting_on:
                    if process_exiting(identities[r][0], identities[r][1] or None):
                        raise PeerLostError(
                            f"rank {rank}: shm setup of the survivors' segment: rank {r} (pid "
                            f"{identities[r][0]}) died before {what} (after "
                            f"{time.monotonic() - begin:.3f} s)", "exiting", time.time())
                if time.monotonic() - begin > timeout.total_seconds():
                    raise CommTimeoutError(
                        f"rank {rank}: shm setup of the survivors' segment: rank(s) "
                        f"{waiting_on} did not {what} within {timeout.total_seconds():.1f} s")
                time.sleep(pause)
                pause = min(pause * 1.5, 0.01)

        if rank == 0:
            staging = f"{path}-0"
            mm = _create(staging, layout)
            os.rename(staging, path)
        else:
            wait(lambda: [] if os.path.exists(path) else [0], "it made the segment")
            mm = attach_segment(path, layout, rank)
        seg = cls(name, layout, mm)
        try:
            seg._put(layout.misc(rank, 3), identities[rank][1] or 0)
            seg._put(layout.misc(rank, 2), os.getpid())  # last: says it is mapped
            wait(lambda: [r for r in range(size) if not seg.peer_identity(r)[0]],
                 "it mapped the segment")
        except BaseException:
            mm.close()
            raise
        finally:
            unlink_segment(path)  # any survivor may, once all mapped it (and on failure)
        return seg

    def _wait_mapped(self, store: Store, keys: list[str], rank: int, timeout: timedelta) -> None:
        """Waits until every rank has mapped the segment; a rank that died meanwhile (the
        creator, named by the segment's name, or a rank that recorded its pid) ends the wait at
        once instead of at the timeout. Polls the store: 0.5 ms apart at first (a peer maps
        the segment within a few ms, and a wait is over within half a millisecond of it; a
        store's timed wait cannot be cancelled cleanly), then further apart up to 50 ms."""
        start = time.monotonic()
        pause = 0.0005
        while not store.check(keys):
            dead = self._dead_member()
            if dead is not None:
                raise PeerLostError(
                    f"rank {rank}: shm setup: {dead} died before every rank had mapped the "
                    f"segment (after {time.monotonic() - start:.2f} s)", "poll", time.time()
                )
            if time.monotonic() - start >= timeout.total_seconds():
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                raise StoreTimeoutError(
                    f"rank {rank}: shm setup: rank(s) {missing} did not map the segment within "
                    f"{timeout.total_seconds():.1f} s (store keys "
                    f"{', '.join(repr(keys[r]) for r in missing)} at {store.address})"
                )
            time.sleep(pause)
            pause = min(pause * 1.5, 0.05)

    def _dead_member(self) -> str | None:
        """A member provably gone during setup (``"rank R (pid P)"``), else ``None``."""
        if creator_gone(self.name):
            return f"rank 0 (pid {self.name[len(PREFIX):].split('-')[0]})"
        for r in range(self.layout.size):
            pid, start = self.peer_identity(r)
            if pid and not process_alive(pid, start or None):
                return f"rank {r} (pid {pid})"
        return None

    def _put(self, offset: int, value: int) -> None:
        struct.pack_into("<Q", self.mm, offset, value)

    def _get(self, offset: int) -> int:
        return struct.unpack_from("<Q", self.mm, offset)[0]

    def peer_identity(self, rank: int) -> tuple[int, int]:
        """``(pid, start_time)`` that ``rank`` recorded at setup."""
        return self._get(self.layout.misc(rank, 2)), self._get(self.layout.misc(rank, 3))

    def close(self) -> None:
        """Unmaps the segment (the caller has dropped every view of it first)."""
        try:
            self.mm.close()
        except BufferError:
            pass  # a view is still exported; the mapping goes when the last one does


def _create(path: str, layout: Layout) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise FastcommError(f"cannot create shared-memory segment {path}: {exc}") from exc
    try:
        os.ftruncate(fd, layout.total)
        mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise FastcommError(
            f"cannot size shared-memory segment {path} to {layout.total} bytes "
            f"(is /dev/shm large enough?): {exc}"
        ) from exc
    finally:
        os.close(fd)
    struct.pack_into(
        "<5Q", mm, 0, MAGIC, layout.size, layout.slot_bytes, layout.mbox_bytes, layout.total
    )
    return mm


def attach_segment(path: str, layout: Layout, rank: int) -> mmap.mmap:
    deadline = time.monotonic() + 5.0
    while True:
        try:
            fd = os.open(path, os.O_RDWR)
            break
        except FileNotFoundError as exc:
            if time.monotonic() > deadline:
                raise FastcommError(
                    f"rank {rank}: shared-memory segment {path} does not exist: is every rank "
                    f"of this shm communicator on the same host (same /dev/shm)? ({exc})"
                ) from exc
            time.sleep(0.01)
    try:
        actual = os.fstat(fd).st_size
        if actual != layout.total:
            raw = os.pread(fd, 40, 0)
            theirs = struct.unpack("<5Q", raw) if len(raw) == 40 else (0,) * 5
            differ = [
                f"{what} {mine} here, {other} in rank 0's segment"
                for what, mine, other in zip(
                    ("size", "slot_bytes", "mbox_bytes"),
                    (layout.size, layout.slot_bytes, layout.mbox_bytes),
                    theirs[1:4],
                    strict=True,
                )
                if mine != other
            ]
            raise FastcommError(
                f"rank {rank}: segment {path} has {actual} bytes, expected {layout.total}: "
                f"ranks disagree on the shm layout ({'; '.join(differ) or 'unknown header'}); "
                f"every rank must pass the same ShmOptions"
            )
        mm = mmap.mmap(fd, layout.total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    header = struct.unpack_from("<5Q", mm, 0)
    expected = (MAGIC, layout.size, layout.slot_bytes, layout.mbox_bytes, layout.total)
    if header != expected:
        mm.close()
        raise FastcommError(f"rank {rank}: segment {path} header {header} != {expected}")
    return mm


def unlink_segment(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
