"""What the wire dropped of one peer's contributions, per fragment: its error feedback (the residual added to
the next Δ), its residual as a butterfly slice owner, and its low-rank warm start. The trainer takes a
contribution through ``compensate`` and ``contribution``; a voided round hands it back (``returned``), a
committed one records what its codec dropped (``record_sent``)."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from swarm.config import RoundConfig
from swarm.core import average
from swarm.core.codecs.codec import Codec, codec_round_trip, get_codec
from swarm.core.codecs.error_feedback import DroppedInPlace, ErrorFeedback, ResidualFiles, SpilledResidual
from swarm.core.codecs.lowrank import LowRankState
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.train.contribution import Contribution

log = logging.getLogger(__name__)


class SentFeedback:
    """One peer's feedback state of each fragment (``numels``: their sizes), as ``rounds`` asks for it."""

    def __init__(self, rounds: RoundConfig, seed: int, numels: list[int]) -> None:
        self.keep_unsent_locally = rounds.keep_unsent_locally
        self.error_feedback: list[ErrorFeedback] | None = (
            [ErrorFeedback(n, rounds.error_feedback_decay) for n in numels] if rounds.error_feedback else None
        )
        self.owner_feedback = [OwnerFeedback() for _ in numels] if rounds.error_feedback else None
        # lowrank codecs: each fragment's warm-start Q (seeded alike on every peer: swarm.core.codecs.lowrank)
        self.lowrank = (
            [LowRankState(seed * 1000 + f) for f in range(len(numels))] if get_codec(rounds.codec).lowrank else None
        )
        self._dropped: dict[int, DroppedInPlace] = {}  # per fragment in flight: its Δ, turned into its residual
        self._files: ResidualFiles | None = None  # where the residuals are kept when not in memory (``spill_to``)
        self._numels = list(numels)

    def spill_to(self, directory: Path) -> None:
        """Keep error feedback's residuals in files in ``directory`` (a peer's state directory) rather than in memory:
        a lossy codec's exchange then writes each slice's residual there as it encodes it, and its result into Δ's
        memory, as a lossless codec's does. The same bits as kept in memory. A no-op without error feedback."""
        if self.error_feedback is None or self.lowrank is not None or self.keep_unsent_locally:
            return
        self._files = ResidualFiles(directory)
        for f, feedback in enumerate(self.error_feedback):
            feedback.spill_to(functools.partial(self._files.new, f, self._numels[f]))

    def compensate(self, fragment: int, delta: torch.Tensor) -> torch.Tensor:
        """Δ plus the fragment's error-feedback residual (Δ itself when that is off, or kept locally: θl holds it),
        in Δ's own memory: the caller made Δ for this and reads it no more."""
        if self.error_feedback is not None and not self.keep_unsent_locally:
            return self.error_feedback[fragment].compensate(delta, in_place=True)
        return delta

    def contribution(self, fragment: int, delta: torch.Tensor, samples: int) -> Contribution:
        """The fragment's contribution of ``delta`` (already compensated) and ``samples``, with its feedback."""
        owner = self.owner_feedback[fragment] if self.owner_feedback is not None else None
        if self.error_feedback is not None and self.lowrank is None:
            # the exchange leaves what its codec drops of each slice in Δ's own memory (or in a file) as it encodes it
            self._drop(self._dropped.pop(fragment, None))  # a round left BEHIND: its residual was never installed
            spill = self._files.new(fragment, delta.numel()) if self._files is not None else None
            self._dropped[fragment] = DroppedInPlace.expect(delta, spill)
        return Contribution(
            fragment=fragment,
            delta=delta,
            samples=samples,
            owner=owner,
            lowrank=self.lowrank[fragment] if self.lowrank is not None else None,
        )

    def returned(self, contribution: Contribution) -> None:
        """``contribution``'s round was voided: nothing it staged is kept, and its Δ is no longer expected."""
        self._drop(self._dropped.pop(contribution.fragment, None))
        if contribution.owner is not None:
            contribution.owner.discard()
        if contribution.lowrank is not None:
            contribution.lowrank.discard()

    def record_sent(
        self, contribution: Contribution, codec: Codec | str | None = None, parts: int | None = None
    ) -> None:
        """Error feedback: remember what the codec drops from ``contribution.delta`` when it is sent as
        ``parts`` block-aligned slices (any count and sizes give the same values; default 1).  The codec is
        the round plan's (``contribution.plan``); ``codec`` names it for a contribution taken outside a round,
        which has no plan. The residual stays valid across codec changes: it is what the last sent values
        lacked, whatever encoded them. Call it once the contribution went out; a no-op when error feedback is off."""
        codec = sent_codec(contribution, codec)
        delivered = contribution.lowrank.commit() if contribution.lowrank is not None else None
        if self.error_feedback is None:
            return
        if contribution.owner is not None:
            contribution.owner.commit()
        feedback = self.error_feedback[contribution.fragment]
        dropped = self._dropped.pop(contribution.fragment, None)
        residual = dropped.residual(codec) if dropped is not None and delivered is None and not codec.lossless else None
        if residual is None or not isinstance(residual, SpilledResidual):
            self._drop(dropped)  # its file, if any, is not the residual
        elif dropped is not None:
            dropped.forget()
        if delivered is not None:  # a low-rank exchange: it delivered this peer's projection
            feedback.update(contribution.delta, delivered)
            return
        if codec.lossless:
            feedback.reset()
            return
        if residual is not None and (residual is contribution.delta or isinstance(residual, SpilledResidual)):
            feedback.install(residual)  # the exchange made it from the bytes it sent
            return
        # cannot happen to a round that committed; Δ is not Δ any more (or holds the exchange's result)
        if dropped is not None and (dropped.touched or contribution.delta.numel() != feedback.numel):
            log.warning(
                "error feedback: the sent vector of fragment %d was only partly turned into its residual;"
                " the residual restarts from zero",
                contribution.fragment,
            )
            feedback.reset()
            return
        bounds = average.part_bounds(contribution.delta.numel(), parts or 1, codec.block)
        feedback.update(contribution.delta, codec_round_trip(contribution.delta, codec, bounds))

    @staticmethod
    def _drop(dropped: DroppedInPlace | None) -> None:
        """``dropped``'s vector is no longer expected, and its residual file (never installed) is deleted."""
        if dropped is not None:
            dropped.forget()
            if dropped.spill is not None:
                dropped.spill.delete()


def sent_codec(contribution: Contribution, codec: Codec | str | None) -> Codec:
    """The codec ``contribution`` went out with: its round plan's, else (taken by hand) ``codec``."""
    if contribution.plan is not None:
        planned = get_codec(contribution.plan.codec)
        if codec is not None and get_codec(codec).name != planned.name:
            raise ValueError(
                f"fragment {contribution.fragment} was sent with its round's codec {planned.name}, not"
                f" {get_codec(codec).name}; record it without naming a codec."
            )
        return planned
    if codec is None:
        raise ValueError(
            f"fragment {contribution.fragment}'s contribution has no round plan; name the codec it was sent with."
        )
    return get_codec(codec)
