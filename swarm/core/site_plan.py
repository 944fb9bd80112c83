"""Two-level averaging's plan and math (``[rounds] hierarchical``): which members of a round's group average
together inside a site, who represents each of those sub-groups across sites, and the average that the
two levels deliver (``two_level_reference``), which the exchange (``swarm.net.exchange.two_level``) and the
simulator both compute, bit for bit.

The plan is a pure function of the group's sites in group order (peer index order), and the sites come from
the coordinator-signed credentials behind the members' DHT entries, so every member that saw the same
verified entries derives the same plan. A site's members, in index order, are cut into
ceil(n / group_size) consecutive sub-groups as equal as possible; a member without a site is a sub-group of
its own. The representative of a sub-group is its first (lowest-index) member.

Level 1 averages each sub-group (a butterfly all-reduce weighted by samples); level 2 averages the
representatives' sub-group averages, each weighted by its sub-group's total samples (derived by every
representative from the signed entries, never declared by the representative); the representative then
hands the level-2 result, as raw fp32 bytes, to its sub-group. A sub-group of one skips level 1 (its
average is its member's Δ), and a plan of one sub-group skips level 2 (its level-1 average is final). A
sub-group whose level 1 fails is withdrawn from level 2, its weight with it (``swarm.net.exchange.withdrawal``):
the result is then level 2 over the other sub-groups' averages, which its live members receive too.
Mathematically the result is the flat sample-weighted mean; in floats it differs from it by rounding.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from swarm.core.average import as_cpu_f32, butterfly_reference, owned_bytes, weighted_average
from swarm.core.codecs.codec import Codec, get_codec

Reduce = Callable[[list[torch.Tensor], list[float]], torch.Tensor]


@dataclass(frozen=True)
class SubGroup:
    site: str
    positions: tuple[int, ...]  # members' positions in the group, ascending; the first is the representative

    @property
    def representative(self) -> int:
        return self.positions[0]


@dataclass(frozen=True)
class SitePlan:
    subgroups: tuple[SubGroup, ...]  # ordered by their representatives' positions
    sites: tuple[str, ...]  # each group position's site

    @property
    def representatives(self) -> list[int]:
        return [s.representative for s in self.subgroups]

    def subgroup_of(self, position: int) -> SubGroup:
        return next(s for s in self.subgroups if position in s.positions)

    def digest(self, group_digest: str) -> str:
        """A digest of the plan over a group (``group_digest``: who the positions are): every message of a
        two-level exchange carries it, so a member that derived another plan is never merged."""
        text = group_digest + "|" + ";".join(",".join(map(str, s.positions)) for s in self.subgroups)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_sites(sites: Sequence[str], group_size: int = 0) -> SitePlan:
    """The plan for a group whose i-th member (in group order) is at ``sites[i]`` ("": no site), with
    sub-groups of at most ``group_size`` members (0: no cap)."""
    if group_size < 0:
        raise ValueError(f"group_size must be 0 (no cap) or positive, got {group_size}.")
    by_site: dict[str, list[int]] = {}
    subgroups = []
    for position, site in enumerate(sites):
        if site:
            by_site.setdefault(site, []).append(position)
        else:
            subgroups.append(SubGroup(site, (position,)))
    for site, positions in by_site.items():
        count = math.ceil(len(positions) / group_size) if group_size else 1
        base, extra = divmod(len(positions), count)
        start = 0
        for i in range(count):
            end = start + base + (1 if i < extra else 0)
            subgroups.append(SubGroup(site, tuple(positions[start:end])))
            start = end
    return SitePlan(tuple(sorted(subgroups, key=lambda s: s.representative)), tuple(sites))


def subgroup_weights(plan: SitePlan, weights: Sequence[float]) -> list[float]:
    """Each sub-group's total weight (its members' capped weights summed as Python floats in group order):
    the representative's weight at level 2."""
    totals = []
    for subgroup in plan.subgroups:
        total = 0.0
        for position in subgroup.positions:
            total += float(weights[position])
        totals.append(total)
    return totals


def two_level_reference(
    contributions: Sequence[torch.Tensor],
    weights: Sequence[float],
    plan: SitePlan,
    codec: Codec | str,
    reduce: Reduce = weighted_average,
) -> torch.Tensor:
    """The average every member of a two-level exchange ends with, computed in one process.
    ``contributions`` are 1-D, in group order; ``weights`` are the capped weights; ``reduce`` is the rule
    each owner applies at both levels."""
    codec = get_codec(codec)
    partials = []
    for subgroup in plan.subgroups:
        if len(subgroup.positions) == 1:
            partials.append(as_cpu_f32(contributions[subgroup.representative]).reshape(-1))
        else:
            partials.append(
                butterfly_reference(
                    [contributions[p] for p in subgroup.positions],
                    [weights[p] for p in subgroup.positions],
                    codec,
                    reduce=reduce,
                )
            )
    if len(partials) == 1:
        return partials[0]
    return butterfly_reference(partials, subgroup_weights(plan, weights), codec, reduce=reduce)


def butterfly_bytes_by_site(numel: int, sites: Sequence[str], codec: Codec | str) -> list[tuple[int, int]]:
    """(in-site, cross-site) payload bytes each member of one butterfly all-reduce over a group at ``sites``
    sends: to owner k its encoded slice k, and its own averaged slice; "" is a site of its own."""
    sizes = owned_bytes(numel, len(sites), codec)  # over all stripes
    out = []
    for i, site in enumerate(sites):
        same = cross = 0
        for k, other in enumerate(sites):
            if k != i:
                if site and other == site:
                    same += sizes[k] + sizes[i]
                else:
                    cross += sizes[k] + sizes[i]
        out.append((same, cross))
    return out


def two_level_bytes_sent(numel: int, plan: SitePlan, codec: Codec | str) -> list[tuple[int, int]]:
    """(in-site, cross-site) payload bytes each member (by group position) sends in a two-level exchange:
    its sub-group's butterfly, the representatives' butterfly, and a representative's raw fp32 result to
    each of its sub-group's other members."""
    out = [(0, 0)] * len(plan.sites)
    reps = plan.representatives
    level2 = butterfly_bytes_by_site(numel, [plan.sites[r] for r in reps], codec) if len(reps) > 1 else []
    for j, subgroup in enumerate(plan.subgroups):
        members = subgroup.positions
        level1 = butterfly_bytes_by_site(numel, [plan.sites[p] for p in members], codec) if len(members) > 1 else []
        for i, position in enumerate(members):
            same, cross = level1[i] if level1 else (0, 0)
            if i == 0 and level2:
                same, cross = same + level2[j][0] + 4 * numel * (len(members) - 1), cross + level2[j][1]
            out[position] = (same, cross)
    return out
