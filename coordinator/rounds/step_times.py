"""Which seconds per inner step the coordinator believes: the peers say them in their heartbeats, and one
peer claiming to be very fast would shrink everyone's round, so a claim under ``1 / MAX_SPEEDUP`` of the
measured participants' lower median counts as that much. The time budgets and the controller's round
length both start from the fastest believable participant."""

from __future__ import annotations

import math
from typing import Optional, Sequence

MAX_SPEEDUP = 4.0  # a claimed step time is believed down to the median's quarter, not below


def measured(step_time_s: float) -> bool:
    return math.isfinite(step_time_s) and step_time_s > 0


def reference_step_s(step_times: Sequence[float]) -> Optional[float]:
    """The fastest believable step time among ``step_times`` (None when none is measured)."""
    times = sorted(t for t in step_times if measured(t))
    if not times:
        return None
    floor = times[(len(times) - 1) // 2] / MAX_SPEEDUP
    return max(times[0], floor)
