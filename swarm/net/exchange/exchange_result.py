"""What one exchange gave this peer: the average every member holds, and what it cost and saw on the way."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.net.link.link_stats import LinkTimings


@dataclass
class ExchangeResult:
    average: torch.Tensor
    bytes_sent: int
    bytes_received: int
    seconds: float
    # What this peer, as the owner of its slice, did to groupmates' slices (peer id -> why); per slice, so
    # other owners may have judged the same groupmate differently.
    rejected: dict[str, str] = field(default_factory=dict)  # left out of the slice's average
    clipped: dict[str, str] = field(default_factory=dict)  # scaled down to the clipping norm
    links: LinkTimings = field(default_factory=LinkTimings)  # this peer's sends, receives and pings, timed
    # Seconds from the start at which this peer passed each point of a butterfly exchange: its contributions
    # sent, every contribution to its slice here, its slice reduced, its averaged slice sent, every slice here.
    phases_s: dict[str, float] = field(default_factory=dict)
