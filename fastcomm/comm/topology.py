"""Where the ranks run: this host's identity and the layout of a job's ranks over hosts.

``fastcomm.comm.world`` reads the layout to choose a backend (one host: ``shm``; several hosts
with shared ones: ``hier``) and to build ``hier``'s parts; the ``shm`` communicator checks
that its ranks share a host.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

from .. import settings
from .store import Store

__all__ = ["HostLayout", "host_id"]


def host_id() -> str:
    """This host's identity: ``FASTCOMM_HOST_ID`` if set, else hostname + kernel boot id.

    The boot id tells apart two machines (or containers on different machines) with the same
    hostname; ranks with equal identities are assumed to share ``/dev/shm``.
    """
    override = settings.HOST_ID.get()
    if override is not None:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True, slots=True)
class HostLayout:
    """The ranks of a job grouped by host.

    Hosts are numbered in order of their lowest rank; on each host the ranks are ordered by
    global rank and the first is the host's leader.

    Attributes:
        rank: this process's rank.
        hosts: every rank's host index, in rank order.
    """

    rank: int
    hosts: tuple[int, ...]

    @classmethod
    def exchange(cls, store: Store, key: str, rank: int, size: int,
                 timeout: timedelta) -> HostLayout:
        """Every rank's :func:`host_id` gathered through ``store`` under ``key`` (a
        collective call)."""
        names = store.all_gather_object(key, rank, size, host_id(), timeout)
        order = list(dict.fromkeys(names))
        return cls(rank, tuple(order.index(name) for name in names))

    @property
    def num_hosts(self) -> int:
        """Hosts the ranks run on."""
        return max(self.hosts) + 1

    @property
    def host(self) -> int:
        """This rank's host index."""
        return self.hosts[self.rank]

    def members(self, host: int) -> list[int]:
        """The ranks on ``host``, in rank order."""
        return [r for r, h in enumerate(self.hosts) if h == host]

    @property
    def local(self) -> list[int]:
        """The ranks on this rank's host, in rank order."""
        return self.members(self.host)

    @property
    def local_rank(self) -> int:
        """This rank's index on its host."""
        return self.local.index(self.rank)

    @property
    def is_leader(self) -> bool:
        """Whether this rank is its host's leader (its lowest rank)."""
        return self.local_rank == 0

    def backend(self) -> str:
        """``shm`` for one host, ``hier`` for several hosts with a shared one, else ``gloo``."""
        if self.num_hosts == 1:
            return "shm"
        if len(self.hosts) > self.num_hosts:
            return "hier"
        return "gloo"
