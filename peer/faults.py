"""Deterministic fault injection for tests and chaos runs: crash, delay or drop at (round, phase).

A peer takes a plan with ``--faults 'crash@3:sending, delay@2:reported=5, drop@4:report'`` (or the
SWARM_FAULTS environment variable). Each entry fires once, when this peer reaches that phase of
that round, so a test says exactly where a peer dies instead of sleeping and hoping.

Phases, in the order a round passes them:
    trained        inner steps done, before looking for the group
    matchmaking    posted in the DHT, before the group is known
    sending        group formed, slices being sent (fires inside the exchange)
    reducing       own slice's contributions received, before its average is sent
    averaged       average complete, before the vote is reported
    reported       vote reported, before the decision is known
    syncing        behind: about to download the committed state of that round (a slow joiner)
Actions: ``crash`` (exit at once, like SIGKILL: no leave, no cleanup), ``delay`` (=seconds),
``drop`` (the named coordinator call is not sent this round: ``report`` or ``heartbeat``).

A Byzantine peer, for attack soaks: ``scale@3:delta=-100`` multiplies this peer's pseudo-gradient by
-100 before it is sent, in that round and every later one; ``scale@3:weight=1e6`` multiplies the sample
count it declares. Its groupmates' validation and robust aggregation are what this exercises.

A slow peer, for straggler runs: ``slow@1:compute=4`` makes each inner step take 4x its compute time from
round 1 on (the trainer sleeps 3x the step's measured compute after each step, so the seconds per step
this peer measures and reports are the throttled ones, and the coordinator budgets it as a slow device).
"""

from __future__ import annotations

import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

logger = logging.getLogger(__name__)

PHASES = ("trained", "matchmaking", "sending", "reducing", "averaged", "reported", "syncing")
DROPPABLE = ("report", "heartbeat")
SCALABLE = ("delta", "weight")
THROTTLED = ("compute",)
MAX_SLOWDOWN = 1000.0
_ENTRY = re.compile(r"^(crash|delay|drop|scale|slow)@(\d+):([a-z]+)(?:=([-+0-9.e]+))?$")


class FaultSpecError(ValueError):
    """A malformed --faults plan."""


@dataclass(frozen=True)
class Fault:
    action: str
    round: int
    phase: str  # a phase; for drop the coordinator call; for scale "delta" or "weight"
    value: float = 0.0  # a delay's seconds, a scale's factor


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)
    _fired: set[int] = field(default_factory=set)

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        faults = []
        for raw in filter(None, (part.strip() for part in spec.split(","))):
            match = _ENTRY.match(raw)
            if not match:
                raise FaultSpecError(f"fault {raw!r} is malformed; write ACTION@ROUND:PHASE, e.g. crash@3:sending")
            action, round_no, phase, value = match.groups()
            valid = {"drop": DROPPABLE, "scale": SCALABLE, "slow": THROTTLED}.get(action, PHASES)
            if phase not in valid:
                raise FaultSpecError(f"fault {raw!r}: {phase!r} is not one of {', '.join(valid)}")
            if action in ("delay", "scale", "slow") and value is None:
                raise FaultSpecError(
                    f"fault {raw!r}: a {action} needs a number: a delay needs seconds (delay@2:reported=5), "
                    "a scale a factor (scale@2:delta=-100), a slow a factor (slow@1:compute=4)"
                )
            try:
                number = float(value or 0.0)
            except ValueError:
                raise FaultSpecError(f"fault {raw!r}: {value!r} is not a number") from None
            if not math.isfinite(number) or (action == "delay" and number < 0):
                raise FaultSpecError(f"fault {raw!r}: {value!r} must be a finite number (a delay: not negative)")
            if action == "slow" and not 1 <= number <= MAX_SLOWDOWN:
                raise FaultSpecError(
                    f"fault {raw!r}: a slowdown must be between 1 and {MAX_SLOWDOWN:g}x its compute"
                    " time, e.g. slow@1:compute=4"
                )
            faults.append(Fault(action, int(round_no), phase, number))
        return cls(faults)

    def at(self, round_no: int, phase: str) -> None:
        """Called by the peer at each phase: crash or delay here if the plan says so."""
        time.sleep(self.fire(round_no, phase))  # the injected fault is the wait itself

    def fire(self, round_no: int, phase: str) -> float:
        """Crash here if the plan says so; else the seconds to delay at this phase (0.0: none). The
        exchange awaits the delay, so a slow peer's transport keeps serving others meanwhile."""
        for i, fault in enumerate(self.faults):
            at_phase = fault.action in ("crash", "delay") and (fault.round, fault.phase) == (round_no, phase)
            if i in self._fired or not at_phase:
                continue
            self._fired.add(i)
            if fault.action == "crash":
                logger.warning("fault injection: crashing at round %d, phase %s", round_no, phase)
                logging.shutdown()
                os._exit(137)
            logger.warning("fault injection: delaying %.1fs at round %d, phase %s", fault.value, round_no, phase)
            return fault.value
        return 0.0

    def drops(self, round_no: int, call: str) -> bool:
        """True when the plan drops this coordinator call in this round (fires once)."""
        for i, fault in enumerate(self.faults):
            if i not in self._fired and fault.action == "drop" and (fault.round, fault.phase) == (round_no, call):
                self._fired.add(i)
                logger.warning("fault injection: dropping %s of round %d", call, round_no)
                return True
        return False

    def scale(self, round_no: int, what: str) -> float:
        """The factor a Byzantine plan puts on ``what`` ("delta" or "weight") in this round (1.0: honest).
        A ``scale`` entry holds from its round on, so the attacker keeps attacking."""
        factor = 1.0
        for fault in self.faults:
            if fault.action == "scale" and fault.phase == what and round_no >= fault.round:
                factor *= fault.value
        return factor

    def slowdown(self, round_no: int) -> float:
        """How many times its compute time an inner step of round ``round_no`` takes (1.0: full speed).
        A ``slow`` entry holds from its round on."""
        factor = 1.0
        for fault in self.faults:
            if fault.action == "slow" and round_no >= fault.round:
                factor *= fault.value
        return factor

    def throttle(self, round_now: Callable[[], int]) -> Optional[Callable[[float], None]]:
        """The trainer's per-step throttle for this plan (None when it slows nothing): after a step of
        ``compute_s`` seconds in the round ``round_now()`` says, sleep (factor − 1) × ``compute_s``."""
        if not any(fault.action == "slow" for fault in self.faults):
            return None

        def throttle(compute_s: float) -> None:
            time.sleep((self.slowdown(round_now()) - 1.0) * max(0.0, compute_s))  # the injected fault is the wait

        return throttle
