"""The agents' heartbeats in a running round: this agent's own, and its watch on its peers'.

Each agent adds 1 to ``hb/<group rank>`` in the round's store every ``keep_alive_interval``
seconds; a peer whose count has not changed for ``keep_alive_interval * keep_alive_max_attempt``
seconds is lost, and named as a failure dated at its last beat seen.
"""

from __future__ import annotations

import time

from .errors import Failure
from .rendezvous import RoundInfo

__all__ = ["Heartbeats", "lost_node_failure"]


class Heartbeats:
    """This agent's heartbeat in round ``info`` and what it saw of the other agents'.

    Args:
        info: the running round.
        interval: seconds between beats (``keep_alive_interval``).
        max_attempt: beats a peer may miss before it is lost (``keep_alive_max_attempt``).
    """

    def __init__(self, info: RoundInfo, interval: float, max_attempt: int) -> None:
        self.info = info
        self.interval = interval
        self.limit = interval * max_attempt
        self.next_beat = 0.0
        """Monotonic time of this agent's next beat."""
        self.seen: dict[int, tuple[int, float]] = {}
        """Per peer: the last heartbeat count read and the monotonic time it changed."""

    def beat(self, now: float) -> bool:
        """Beats if one is due at monotonic time ``now``; returns whether it did."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.interval
        self.info.store.add(f"hb/{self.info.group_rank}", 1)
        return True

    def lost_peer(self, peers: list[int], now: float) -> Failure | None:
        """The first of ``peers`` whose heartbeat count has not changed for the limit, as a
        lost-node failure dated at its last beat seen (so it precedes, as the root cause, the
        peer-loss errors it caused), or ``None``."""
        info = self.info
        for g in peers:
            count = info.store.add(f"hb/{g}", 0)
            last = self.seen.get(g)
            if last is None or last[0] != count:
                self.seen[g] = (count, now)
            elif now - last[1] > self.limit:
                return lost_node_failure(info, g, now - last[1],
                                         f"no heartbeat from the agent of node {g} for "
                                         f"{now - last[1]:.0f} s")
        return None


def lost_node_failure(info: RoundInfo, group_rank: int, silent_s: float, message: str) -> Failure:
    """The failure of node `group_rank` of round `info` whose agent was last heard `silent_s`
    seconds ago (its timestamp: so it precedes, as the root cause, the peer-loss errors the
    loss caused); `message` says how the loss was seen."""
    node = info.nodes[group_rank]
    return Failure(rank=-1, local_rank=-1, group_rank=group_rank, host=node.host, pid=node.pid,
                   exitcode=1, timestamp=time.time() - silent_s, round=info.round,
                   role=node.role, message=message)
