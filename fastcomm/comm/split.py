"""``Communicator.split``: sub-communicators of the ranks that pass the same color.

Every rank publishes ``(color, key, rank)`` under a key numbered by the parent's
:meth:`~.base.Communicator.next_key` (the same on every rank, as collectives are issued in the
same order); each child gets the store namespace ``<that key>/color<c>``, so two splits, or two
colors of one split, never read each other's values.
"""

from __future__ import annotations

from datetime import timedelta

from . import checks
from .store import as_timedelta

__all__ = ["default_child", "split"]


def split(comm, color: int | None, key: int | None, timeout):
    """:meth:`~.base.Communicator.split` of ``comm`` (arguments and errors as there)."""
    comm._check_open("split")
    checks.check_split_args(color, key)
    if color is not None and color < 0:
        color = None
    key = comm.rank if key is None else key
    new_timeout = as_timedelta(timeout, comm.timeout)
    name = comm.next_key("split")
    entries = comm.store.all_gather_object(
        name, comm.rank, comm.size, (color, key, comm.rank), comm.timeout
    )
    if color is None:
        comm._split_child(None, name, -1, 0, [], new_timeout)
        return None
    members = sorted((k, r) for c, k, r in entries if c == color)
    ranks = [r for _, r in members]
    new_rank = ranks.index(comm.rank)
    return comm._split_child(color, name, new_rank, len(ranks), ranks, new_timeout)


def default_child(comm, color: int | None, name: str, new_rank: int, new_size: int,
                  timeout: timedelta):
    """The child of ``comm`` for ``color`` over the store namespace ``<name>/color<c>``: built
    by ``comm.make_child`` where set, else by the backend alone (``None`` for no color)."""
    if color is None:
        return None
    store = comm.store.prefixed(f"{name}/color{color}", rank=new_rank)
    if comm.make_child is not None:
        return comm.make_child(store, new_rank, new_size, timeout)
    return comm._new_child(store, new_rank, new_size, timeout)
