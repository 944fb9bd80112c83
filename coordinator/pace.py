"""How often the coordinator asks its peers to call it: the heartbeat interval, the lease and the least time
between a waiting peer's polls, grown with the number of live peers so that its load stays within a budget.

The operator's interval and lease hold for small swarms. Past ``heartbeats_per_s × heartbeat_interval_s``
live peers (300 with the defaults) both stretch by ``live / (heartbeats_per_s × interval)``, so the peers'
heartbeats add up to ``heartbeats_per_s`` whatever the swarm's size, and a lease stays the same number of
intervals long. Polls (a peer waiting for a round or a decision asks GetRound) are bounded the same way. A
saturated coordinator multiplies all three by its slow-down factor (``coordinator.api.load``) before it
refuses anyone. ``pace_for`` is pure; the engine calls it through a ``Pacer`` with its live count and the load
monitor's factor, which logs the pace when its interval changed by a quarter.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

# ~1.6 ms of CPU per signed call on one serving thread: 150 heartbeats and 150 polls a second, and the reports that
# come as fast as the polls, keep it about half busy, so a decision's stall drains in a fraction of a second (at 300
# and 300 the reports of a round of 10,000 pushed it past 0.8 of a core, and some calls waited for seconds)
HEARTBEATS_PER_S = 150.0
POLLS_PER_S = 150.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class PaceConfig:
    heartbeat_interval_s: float = 2.0  # what a small swarm's peers do (the operator's --heartbeat-interval-s)
    lease_s: float = 15.0  # a peer silent this long is evicted (in a small swarm; it stretches with the interval)
    heartbeats_per_s: float = HEARTBEATS_PER_S  # the budget: all live peers' heartbeats together
    polls_per_s: float = POLLS_PER_S  # the budget of waiting peers' GetRound polls, all together

    def __post_init__(self) -> None:
        if min(self.heartbeat_interval_s, self.lease_s, self.heartbeats_per_s, self.polls_per_s) <= 0:
            raise ValueError("a pace needs a positive heartbeat interval, lease and budgets")


@dataclass(frozen=True)
class Pace:
    heartbeat_interval_s: float
    lease_s: float
    poll_interval_s: float  # a waiting peer polls at most this often (below its own poll interval: no effect)


def pace_for(config: PaceConfig, live_peers: int, slowdown: float = 1.0) -> Pace:
    """The pace for ``live_peers`` peers, slowed ``slowdown`` times (≥ 1) while the coordinator is saturated."""
    slowdown = max(1.0, slowdown)
    stretch = max(1.0, live_peers / (config.heartbeats_per_s * config.heartbeat_interval_s)) * slowdown
    return Pace(
        heartbeat_interval_s=round(config.heartbeat_interval_s * stretch, 3),
        lease_s=round(config.lease_s * stretch, 3),
        poll_interval_s=round(max(0, live_peers) / config.polls_per_s * slowdown, 3),
    )


class Pacer:
    """``pace_for`` with ``config``, and a log line whenever the heartbeat interval changed by a quarter or more
    since it was last logged. ``last`` is the pace last asked for (read without a lock: /metrics)."""

    def __init__(self, config: PaceConfig) -> None:
        self._config = config
        self._logged_interval_s = config.heartbeat_interval_s
        self.last = pace_for(config, 0)

    def pace(self, live_peers: int, slowdown: float = 1.0) -> Pace:
        pace = pace_for(self._config, live_peers, slowdown)
        if abs(pace.heartbeat_interval_s - self._logged_interval_s) >= 0.25 * self._logged_interval_s:
            self._logged_interval_s = pace.heartbeat_interval_s
            logger.info(
                "pace for %d live peers: a heartbeat every %.1fs, a lease of %.0fs, polls at most every %.1fs",
                live_peers,
                pace.heartbeat_interval_s,
                pace.lease_s,
                pace.poll_interval_s,
            )
        self.last = pace
        return pace
