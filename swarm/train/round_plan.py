"""The round's plan: what one round runs, decided once, in ``plan_round``, from the run's [rounds] and the
coordinator's controller choice for the round (if any).

The round runner makes a round's plan as it takes the round's contribution (the peer daemon and the simulator
alike) and the plan travels with the contribution (``Contribution.plan``): the exchange sends with its codec and
cuts the reduction by its shares, the DHT group entry carries its codec and digest (members whose plans differ
do not exchange), error feedback keeps what its codec dropped, and the round's log line names its codec.

``plan_round`` is the one place that decides a round's codec, fragment, nominal H and shares: the controller's
choice wins, the run's config otherwise (how many of those steps a slower peer trains is its time budget, the
coordinator's: ``peer.link.round_plans``). What a real swarm may run at all is the config's
(``RoundConfig.check_real_swarm``: e.g. the low-rank codecs run in the simulator only).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol, Sequence

from swarm.config import RoundConfig
from swarm.config.rounds_config import CODEC_NAMES
from swarm.core.fragments import round_fragment, round_steps


class ControllerChoice(Protocol):
    """What plan_round reads of the coordinator's choice for a round (its wire form: swarm.v1 RoundChoice)."""

    codec: str  # "": the run's
    shares: Mapping[str, float]  # peer id -> its weight for the size of its slice (empty: equal slices)
    inner_steps: int  # the round's H (0: the run's)
    fragments: int  # the run's (0: not said)


class PlanRefused(ValueError):
    """The coordinator's choice for a round is one this peer cannot run; the message says why in one sentence."""


@dataclass(frozen=True)
class RoundPlan:
    """What one round runs, the same on every member of its group."""

    round_no: int
    fragment: int  # the fragment the round syncs
    codec: str  # every member sends with this codec
    inner_steps: int  # H: the controller's for this round, else the run's
    steps: int  # inner steps a full-speed peer runs in this round (H // F or H // F + 1)
    overlap_steps: int  # τ: inner steps of the next round before this round's exchange is merged
    shares: tuple[tuple[str, float], ...] = ()  # (peer id, share), by peer id; (): equal slices
    digest: str = ""  # of the controller's choice, in the group entry ("": no choice, the run's config)

    @property
    def chosen(self) -> bool:
        """Whether the coordinator's controller chose this round's codec and shares."""
        return bool(self.digest)

    def shares_of(self, peer_ids: Sequence[str]) -> Optional[list[float]]:
        """Each group position's share of the reduction (None: equal slices). A member the choice does not list
        (admitted late) gets the mean of the listed members' shares."""
        if not self.shares:
            return None
        shares = dict(self.shares)
        listed = [shares[p] for p in peer_ids if p in shares]
        default = math.fsum(listed) / len(listed) if listed else 1.0
        return [shares.get(p, default) for p in peer_ids]


def plan_round(rounds: RoundConfig, round_no: int, choice: Optional[ControllerChoice] = None) -> RoundPlan:
    """The plan of round ``round_no`` of a run of ``rounds``: the controller's ``choice`` where it makes one (its
    codec, shares and H), the run's config otherwise. Raises PlanRefused (one sentence) for a choice this peer
    cannot run."""
    fragment = round_fragment(round_no, rounds.fragments)
    if choice is None:
        steps = round_steps(round_no, rounds.inner_steps, rounds.fragments)
        return RoundPlan(
            round_no=round_no,
            fragment=fragment,
            codec=rounds.codec,
            inner_steps=rounds.inner_steps,
            steps=steps,
            overlap_steps=min(rounds.overlap_steps, steps),
        )
    if choice.codec and choice.codec not in CODEC_NAMES:  # the controller chooses among these only
        raise PlanRefused(
            f"the coordinator chose codec {choice.codec!r} for round {round_no}, which this peer does "
            "not know; run the same swarm version as the coordinator."
        )
    shares = tuple(sorted((str(p), float(s)) for p, s in choice.shares.items()))
    if not all(math.isfinite(s) and s > 0 for _, s in shares):
        raise PlanRefused(
            f"the coordinator's shares for round {round_no} ({dict(shares)}) are not all positive;"
            " the round cannot be reduced."
        )
    h = max(rounds.inner_steps, int(choice.inner_steps)) if choice.fragments > 0 else rounds.inner_steps
    steps = max(round_steps(round_no, rounds.inner_steps, rounds.fragments), round_steps(round_no, h, rounds.fragments))
    return RoundPlan(
        round_no=round_no,
        fragment=fragment,
        codec=choice.codec or rounds.codec,
        inner_steps=h,
        steps=steps,
        overlap_steps=min(rounds.overlap_steps, steps),
        shares=shares,
        digest=choice_digest(choice),
    )


def choice_digest(choice: ControllerChoice) -> str:
    """What the group entry carries of the round's choice: members whose digests differ do not exchange."""
    text = choice.codec + "|" + ",".join(f"{p}={s!r}" for p, s in sorted(choice.shares.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
