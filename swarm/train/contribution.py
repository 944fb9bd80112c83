"""What one stretch of inner training yields (``TrainStats``) and what a peer sends for one sync
(``Contribution``): the values the round runner passes between the trainer and the exchange."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from swarm.core.codecs.lowrank import LowRankState
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.train.round_plan import RoundPlan


@dataclass(frozen=True)
class TrainStats:
    steps: int
    samples: int  # sequences processed: the weight of this peer's pseudo-gradient
    tokens: int
    mean_loss: float  # nats per byte, averaged over the steps; nan for zero steps
    inner_time_s: float


@dataclass
class Contribution:
    """What a peer sends for one sync: the flat vector and its weight."""

    fragment: int
    delta: torch.Tensor  # Δ_f = θg_f − θl_f, plus the error-feedback residual when that is on
    samples: int  # sequences this peer processed since the fragment's previous sync: the weight
    # The round's plan (swarm.train.round_plan): its codec, shares and digest, which the exchange sends it by and
    # error feedback records it with. Set by the round runner as it takes the contribution, before the exchange
    # sees it; None: taken outside a round (by hand).
    plan: Optional[RoundPlan] = None
    # This peer's residual as a butterfly slice owner for the fragment (never sent): the exchange adds it
    # to its averaged slice and stages the new one when the codec asks for owner feedback; ``record_sent``
    # commits it.
    owner: Optional[OwnerFeedback] = field(default=None, repr=False, compare=False)
    # This peer's low-rank state for the fragment (its warm-start Q; never sent), with a lowrank codec: the
    # exchange stages what the contribution delivered and the next Q; ``record_sent`` commits them.
    lowrank: Optional[LowRankState] = field(default=None, repr=False, compare=False)
