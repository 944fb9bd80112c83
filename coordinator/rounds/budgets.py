"""A round is a time budget: each participant's inner steps from its measured seconds per step.

The fastest measured participant does the round's full steps (H, or fewer in a fragment's first sync) in
``budget_s`` seconds; a participant that would finish its full steps within ``slack_s`` seconds of that
does them too (a measurement's noise, or a small speed difference, costs less than a smaller
contribution); a slower one does ``max(1, floor(budget_s / own_step_s))``, so that all are ready
together. A participant with no measurement yet does the full steps.  The round's deadline is
``budget_s + slack_s`` after it opened.

Step times are what the peers say in their heartbeats; one peer claiming to be very fast would shrink
everyone else's budget, so a claim under ``1 / MAX_SPEEDUP`` of the measured participants' lower median
counts as that much (``coordinator.rounds.step_times``).

With the controller on (``[rounds] controller = "auto"``) the round's full steps are the H it chose for the
round (its ``inner_steps``, at most ``swarm.core.round_length.longest_inner_steps``), so its compute budget
is that H × the reference step time: a round the controller lengthens lengthens for every participant.

Pure functions; the engine passes the records and the measurements in.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional, Sequence

from coordinator.rounds import controller
from coordinator.rounds.step_times import measured, reference_step_s
from coordinator.store.records import EXCHANGING, PeerRecord, RoundRecord
from swarm.config import RoundConfig
from swarm.core.fragments import round_steps
from swarm.core.round_length import longest_inner_steps

PROBED_SLOWDOWN = 5.0  # a start-up probe's step time counts only from this many times the reference (trusted_probe)


@dataclass(frozen=True)
class Budget:
    inner_steps: int
    step_time_s: float  # as used for the budget (0: not measured)


@dataclass(frozen=True)
class Plan:
    budget_s: float  # the round's compute seconds (0: no measurement, every participant does the full steps)
    deadline_s: float  # after the round opened; 0: none (no measurement to set one by)
    budgets: dict[str, Budget]


def plan_budgets(
    participants: Sequence[str],
    step_times: Mapping[str, float],
    *,
    full_steps: int,
    slack_s: float,
    budget_s: Optional[float] = None,
    probed: AbstractSet[str] = frozenset(),
) -> Plan:
    """Each participant's inner steps for a round of at most ``full_steps`` steps.

    ``budget_s`` is the round's compute seconds (default: ``full_steps`` × the reference step time); a
    controller choosing a round's time rather than its steps passes it. ``probed``: the participants whose
    step time is their start-up probe's estimate (``trusted_probe``).
    """
    reference = reference_step_s([step_times.get(p, 0.0) for p in participants])
    if reference is None:
        full = Budget(full_steps, 0.0)  # frozen: one for every participant
        return Plan(0.0, 0.0, dict.fromkeys(participants, full))
    if budget_s is None:
        budget_s = full_steps * reference
    times = {
        p: step_times.get(p, 0.0) if p not in probed or trusted_probe(step_times.get(p, 0.0), reference) else 0.0
        for p in participants
    }
    budgets = {
        p: Budget(
            steps_for(times[p], reference, full_steps=full_steps, budget_s=budget_s, slack_s=slack_s),
            _believed(times[p], reference),
        )
        for p in participants
    }
    return Plan(budget_s, budget_s + slack_s, budgets)


def trusted_probe(step_time_s: float, reference_s: float) -> bool:
    """Whether a start-up probe's step time may cut a peer's steps: only when it says the peer is at least
    ``PROBED_SLOWDOWN`` times slower than the reference. Probes run while the machine may be busy starting
    peers (the demo's three equal peers probed up to 3.9× apart at their start), and a smaller cut is not worth
    a wrong one: the first round's measurement takes over. What it is for: a device several times slower (a CPU
    among GPUs), which would otherwise train the full H in its first round and miss its group."""
    return measured(step_time_s) and step_time_s >= PROBED_SLOWDOWN * reference_s


def steps_for(step_time_s: float, reference_s: float, *, full_steps: int, budget_s: float, slack_s: float) -> int:
    """The inner steps a participant at ``step_time_s`` does in ``budget_s`` (``slack_s`` of tolerance)."""
    if not measured(step_time_s):
        return full_steps
    own = _believed(step_time_s, reference_s)
    if full_steps * own <= budget_s + slack_s:
        return full_steps
    # a tiny relative epsilon: H × t / t must give H back, not H − 1 by a rounding
    return max(1, min(full_steps, math.floor(budget_s / own * (1 + 1e-9))))


def _believed(step_time_s: float, reference_s: float) -> float:
    return max(step_time_s, reference_s) if measured(step_time_s) else 0.0


def planned_round(round_row: RoundRecord, plan: Plan) -> RoundRecord:
    """``round_row`` carrying ``plan`` for its participants."""
    return dataclasses.replace(
        round_row,
        budget_s=plan.budget_s,
        deadline_s=plan.deadline_s,
        budgets=tuple(plan.budgets[p].inner_steps for p in round_row.participants),
        step_times_s=tuple(plan.budgets[p].step_time_s for p in round_row.participants),
    )


def late_budget(round_row: RoundRecord, step_time_s: float, *, now: float, full_steps: int) -> Budget:
    """A peer admitted into an open round gets what fits in the budget's time left (by its own step time,
    or by the reference participant's when it has none yet: the full steps when the round has no budget)."""
    if round_row.budget_s <= 0:
        return Budget(full_steps, step_time_s if measured(step_time_s) else 0.0)
    reference = reference_step_s(round_row.step_times_s) or round_row.budget_s / full_steps
    own = _believed(step_time_s, reference) if measured(step_time_s) else reference
    left = round_row.opened_at + round_row.budget_s - now
    steps = max(1, min(full_steps, math.floor(left / own * (1 + 1e-9)))) if left > 0 else 1
    return Budget(steps, own)


def with_newcomers(
    before: RoundRecord, after: RoundRecord, step_times: Mapping[str, float], *, now: float, full_steps: int
) -> RoundRecord:
    """``after`` (``before`` with peers appended by ``opening.with_late_joiners``) with a budget for each newcomer."""
    if not before.budgets:
        return after
    newcomers = after.participants[len(before.participants) :]
    late = [late_budget(before, step_times.get(p, 0.0), now=now, full_steps=full_steps) for p in newcomers]
    return dataclasses.replace(
        after,
        budgets=before.budgets + tuple(b.inner_steps for b in late),
        step_times_s=before.step_times_s + tuple(b.step_time_s for b in late),
    )


def without(round_row: RoundRecord, left_out: Sequence[str]) -> RoundRecord:
    """``round_row`` with ``left_out`` taken out of its participants (and their budgets) into ``left_out``."""
    gone = set(left_out)
    keep = [i for i, p in enumerate(round_row.participants) if p not in gone]
    aligned = len(round_row.budgets) == len(round_row.participants)
    return dataclasses.replace(
        round_row,
        participants=tuple(round_row.participants[i] for i in keep),
        budgets=tuple(round_row.budgets[i] for i in keep) if aligned else round_row.budgets,
        step_times_s=tuple(round_row.step_times_s[i] for i in keep) if aligned else round_row.step_times_s,
        left_out=round_row.left_out + tuple(p for p in round_row.participants if p in gone),
    )


def budget_of(round_row: RoundRecord, peer_id: str) -> Optional[Budget]:
    """The budget the round gives ``peer_id`` (None: not planned, or a round without budgets)."""
    if len(round_row.budgets) != len(round_row.participants) or peer_id not in round_row.participants:
        return None
    i = round_row.participants.index(peer_id)
    return Budget(round_row.budgets[i], round_row.step_times_s[i])


def budgeted(round_row: RoundRecord, peers: Mapping[str, PeerRecord], config: RoundConfig) -> RoundRecord:
    """The newly opened ``round_row`` (carrying the controller's choice, if any) with its participants'
    budgets from their latest heartbeats: the round's full steps × the reference step time."""
    times = step_times(peers, round_row.participants)
    full = round_full_steps(round_row, config)
    reference = reference_step_s([times.get(p, 0.0) for p in round_row.participants])
    probed = {p for p in round_row.participants if p in peers and peers[p].metrics.step_time_probed}
    # the step times are what the peers say: a round's budget is at most its timeout, whatever they claim
    budget_s = min(full * reference, config.round_timeout_s) if reference is not None else None
    plan = plan_budgets(
        round_row.participants,
        times,
        full_steps=full,
        slack_s=config.straggler_slack_s,
        budget_s=budget_s,
        probed=probed,
    )
    return planned_round(round_row, plan)


def budget_newcomers(
    before: RoundRecord, after: RoundRecord, peers: Mapping[str, PeerRecord], config: RoundConfig, *, now: float
) -> RoundRecord:
    """``with_newcomers`` from the peers' latest heartbeats."""
    times = step_times(peers, after.participants[len(before.participants) :])
    return with_newcomers(before, after, times, now=now, full_steps=round_full_steps(before, config))


def exchanging(round_row: RoundRecord, peers: Mapping[str, PeerRecord]) -> set[str]:
    """The participants whose latest heartbeat says they are exchanging this round, or already training a later
    one (with overlap a peer trains the next round while this one's exchange waits for its group): ready, not
    left out. Counting only the first, a group held in matchmaking for a straggler (while the plan lists it) looked
    late as a whole, so the straggler would never be left out and the round would wait for it (seen on the WAN testbed)."""
    return {
        p
        for p in round_row.participants
        if p in peers
        and (
            peers[p].metrics.round > round_row.round
            or (peers[p].state == EXCHANGING and peers[p].metrics.round == round_row.round)
        )
    }


def step_times(peers: Mapping[str, PeerRecord], of: Sequence[str]) -> dict[str, float]:
    """The step times the live peers ``of`` say."""
    return {p: peers[p].metrics.step_time_s for p in of if p in peers and peers[p].alive}


def full_steps(round_number: int, config: RoundConfig) -> int:
    return round_steps(round_number, config.inner_steps, config.fragments)


def round_full_steps(round_row: RoundRecord, config: RoundConfig) -> int:
    """What a full-speed participant does in ``round_row``: the round's share of the controller's chosen H
    when the controller is on and chose one, else of ``[rounds] inner_steps``."""
    choice = controller.from_json(round_row.choice) if config.controller == "auto" else None
    if choice is None or choice.inner_steps <= 0:
        return full_steps(round_row.round, config)
    h = max(config.inner_steps, min(int(choice.inner_steps), longest_inner_steps(config)))
    return round_steps(round_row.round, h, config.fragments)
