"""Robust aggregation: how the owner of one slice of the pseudo-gradient combines the group's slices
(``[rounds] aggregation``), with weights capped at what a round allows.

Every member's weight is self-declared, so it is clamped to ``max_weight`` (batch size × the most inner
steps one fragment's pseudo-gradient may span, ``swarm.core.round_length.longest_sync_steps``: H, or with
the controller on the largest H it may choose; every member derives the same cap from the run config; a
round's time budget gives no peer more than its round's steps, so an honest peer, fast or slow, is never
clipped) and a weight that is not a positive finite number fails the exchange.

The rules, applied to the decoded slices in group order, all deterministic functions of them:

- every rule first leaves out (weight 0, in this slice's average only) a slice whose norm exceeds
  ``reject_factor`` × the group's median slice norm, in a group of 3 or more (with 2 there is no majority
  to say which one is the outlier);
- ``mean``: the sample-weighted mean (``weighted_average``), bit for bit what the swarm did before rules
  existed as long as nothing is left out;
- ``clipped_mean``: in a group of 3 or more, each slice longer than ``clip_factor`` × the median slice norm
  is scaled down to that norm, then the weighted mean (bit for bit ``mean`` while nothing is clipped or left
  out: an honest group of peers alike). A group of 2 is not clipped: the lower median of two norms is the
  shorter one's, so a peer that ran twice the steps of its one groupmate would be cut to it, and a
  malicious half of a group is beyond any rule anyway. This is the run's rule by default (``[rounds]
  aggregation = "auto"``);
- ``trimmed_mean``: per coordinate, the b largest and b smallest values are dropped (b =
  ``trim_fraction`` × the group, at least 1 in a group of 3 or more, at most what leaves one value) and
  the rest averaged with their weights; a group of 1 or 2 falls back to the mean.

Norms are per slice: an owner sees only its own slice of everyone's vector, so a member can be left
out or clipped on one slice and not on another. The median is the lower median (the middle element,
or the smaller of the two middle ones), computed from norms taken in fp64 and compared as Python floats.
What this does not bound: the owner of a slice computes that slice of the average alone, and every
member applies the bytes the owner sends, so a malicious owner can replace its whole slice (1/K of the
vector, any values the codec can encode) with whatever it likes; only the finiteness check at decode
applies to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from swarm.config import AGGREGATIONS, RunConfig
from swarm.core.average import check_contributions, weighted_average
from swarm.core.round_length import longest_sync_steps

RULES = AGGREGATIONS
_F32 = torch.float32


@dataclass(frozen=True)
class Reduced:
    """One owner's reduction of its slice: the average and what it did to whom (by group position)."""

    average: torch.Tensor
    rejected: dict[int, str] = field(default_factory=dict)  # left out of this slice's average, and why
    clipped: dict[int, str] = field(default_factory=dict)  # scaled down before averaging, and by how much


@dataclass(frozen=True, kw_only=True)
class Aggregation:
    rule: str = "mean"
    clip_factor: float = 2.0
    trim_fraction: float = 0.25
    reject_factor: float = 100.0  # 0: never leave a slice out
    max_weight: float = math.inf  # a member's declared weight is clamped to this

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"aggregation {self.rule!r} is unknown; choose one of {list(RULES)}.")

    @classmethod
    def for_run(cls, run: RunConfig) -> "Aggregation":
        """The run's rule ("auto" resolved), with the weight cap every member derives from the run config alike."""
        rounds = run.rounds
        return cls(
            rule=rounds.aggregation_rule(),
            clip_factor=rounds.clip_factor,
            trim_fraction=rounds.trim_fraction,
            reject_factor=rounds.reject_factor,
            max_weight=float(run.data.batch_size * longest_sync_steps(rounds)),
        )

    def weights(self, declared: Sequence[float], members: Sequence[str]) -> list[float]:
        """The declared weights clamped to ``max_weight``; ValueError naming the first member whose weight
        is not a positive finite number."""
        out = []
        for weight, member in zip(declared, members, strict=True):
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
                raise ValueError(
                    f"member {member} declared the weight {weight!r}; a weight must be a positive,"
                    " finite number of samples, so this exchange is refused."
                )
            out.append(min(float(weight), self.max_weight))
        return out

    def reduce(
        self, slices: Sequence[torch.Tensor], weights: Sequence[float], *, out: torch.Tensor | None = None
    ) -> Reduced:
        """The group's slices (fp32, one shape, group order) combined by the rule (``out``: where a mean is
        written, as ``weighted_average``'s)."""
        if len(slices) != len(weights) or not slices:
            raise ValueError(f"need one weight per slice, got {len(slices)} and {len(weights)}.")
        needs_norms = len(slices) >= 3 and (self.rule == "clipped_mean" or self.reject_factor > 0)
        if not needs_norms:
            return self._combine(list(slices), list(weights), {}, out)
        norms = [slice_norm(s) for s in slices]
        rejected = {}
        if self.reject_factor > 0 and len(slices) >= 3:
            median = lower_median(norms)
            rejected = {
                i: f"slice norm {n:.3g} is over {self.reject_factor:g} x the group's median {median:.3g}: left out"
                for i, n in enumerate(norms)
                if n > self.reject_factor * median
            }
        kept = [i for i in range(len(slices)) if i not in rejected]
        kept_slices = [slices[i] for i in kept]
        clipped: dict[int, str] = {}
        if self.rule == "clipped_mean":
            kept_slices, scaled = clip_to_median([norms[i] for i in kept], kept_slices, self.clip_factor)
            clipped = {kept[j]: f"clipped to {scale:.3g} of its norm" for j, scale in scaled.items()}
        reduced = self._combine(kept_slices, [weights[i] for i in kept], rejected, out)
        return Reduced(reduced.average, rejected, clipped)

    def _combine(
        self, slices: list[torch.Tensor], weights: list[float], rejected: dict[int, str], out: torch.Tensor | None
    ) -> Reduced:
        if self.rule == "trimmed_mean":
            return Reduced(trimmed_mean(slices, weights, self.trim_fraction), rejected)
        return Reduced(weighted_average(slices, weights, out=out), rejected)


NORM_CHUNK = 1 << 18  # elements converted to fp64 at a time: a scratch that stays in cache


def slice_norm(t: torch.Tensor) -> float:
    """The L2 norm in fp64 (a finite fp32 slice never overflows it), as a Python float: the squares summed
    chunk by chunk in a fixed order, so the same slice gives the same norm, without converting the whole
    slice to fp64 at once (at tens of MB, that copy cost an exchange's owner more than the reduction)."""
    flat = t.reshape(-1)
    scratch = torch.empty(min(NORM_CHUNK, flat.numel()), dtype=torch.float64)
    total = 0.0
    for start in range(0, flat.numel(), NORM_CHUNK):
        part = scratch[: min(NORM_CHUNK, flat.numel() - start)]
        part.copy_(flat[start : start + NORM_CHUNK])
        total += float(torch.dot(part, part))
    return math.sqrt(total)


def lower_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def clip_to_median(
    norms: Sequence[float], slices: Sequence[torch.Tensor], factor: float
) -> tuple[list[torch.Tensor], dict[int, float]]:
    """Each slice longer than ``factor`` × the lower median norm scaled down to it (one fp32 multiply by
    the scale rounded once to fp32); returns the slices and {position: scale} of those it scaled. A
    median of 0 leaves every slice as it is (there is no length to clip to)."""
    bound = factor * lower_median(norms)
    out, scaled = [], {}
    for i, (n, s) in enumerate(zip(norms, slices)):
        if bound > 0 and n > bound:
            scaled[i] = bound / n
            s = s * torch.tensor(scaled[i], dtype=_F32)
        out.append(s)
    return out, scaled


def trim_count(group: int, fraction: float) -> int:
    """Values dropped at each end per coordinate: ``fraction`` of the group, at least 1 in a group of 3
    or more, and never so many that nothing is left (0 in a group of 1 or 2)."""
    if group < 3:
        return 0
    return min((group - 1) // 2, max(1, math.floor(fraction * group)))


def trimmed_mean(slices: Sequence[torch.Tensor], weights: Sequence[float], fraction: float) -> torch.Tensor:
    """Per coordinate: sort the group's values (stable, so ties keep group order), drop the b smallest and
    b largest, and take the weighted mean of the rest, summed from the smallest kept value up with one
    rounding per op (like ``weighted_average``). b = 0: exactly ``weighted_average``."""
    b = trim_count(len(slices), fraction)
    if b == 0:
        return weighted_average(slices, weights)
    check_contributions(slices, weights)
    values, order = torch.sort(torch.stack(list(slices)), dim=0, stable=True)
    w = torch.tensor([float(x) for x in weights], dtype=_F32)[order]  # each value's weight, fp32
    acc, total = values[b] * w[b], w[b]
    for j in range(b + 1, len(slices) - b):
        acc = acc + (values[j] * w[j])
        total = total + w[j]
    return acc / total
