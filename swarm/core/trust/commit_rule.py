"""The commit rule, shared by the coordinator and by a group deciding a round without it.

A report claims "I averaged with this group and hold this hash". The group is judged against the plan, not
against what reporters say: a round plans one group, its participants, and a hash commits only when more than
half of the planned participants still in the round (``standing``: those not known to be gone without a report)
— and more than half of the group the reports name, at least two unless it is alone — reported that hash *with
that same group*. A report naming a group it is not in, or members that were not planned into the round,
counts for nothing; so a peer (or many) naming a group of its own is one vote of the planned group, never a
quorum of its own, an honest majority that reports later still wins, and only the agreeing members hold the
committed state. Equal support for two hashes is a tie: the round is void, whatever the hashes.

A group of more than ``NAMED_GROUP_MAX`` members is reported by its digest and size (``sized_group``): who is in it
cannot be checked then, but nothing rests on that check — each supporter is still a planned participant that reported
itself, and the quorum is still a majority of the planned participants standing, so a liar's digest or size is one
vote and never lowers the quorum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Collection, Iterable, Optional

NAMED_GROUP_MAX = 1024  # members a report names; a larger group is reported by its digest and size
_SIZED = "#"  # a sized group's one element starts with it (peer ids never do): "#<digest>:<size>"


def sized_group(digest: str, size: int) -> frozenset[str]:
    """A group too large to name, as the rule reads it: its digest (``round_vote.group_id``) and its size."""
    return frozenset({f"{_SIZED}{digest}:{size}"})


def group_size(group: Collection[str]) -> int:
    """Members of ``group``: a named group's count, or a sized group's size."""
    if len(group) == 1:
        (only,) = group
        if only.startswith(_SIZED):
            return int(only.rsplit(":", 1)[1])
    return len(group)


def is_sized(group: Collection[str]) -> bool:
    return len(group) == 1 and next(iter(group)).startswith(_SIZED)


@dataclass(frozen=True)
class Claim:
    """One member's report: the hash of the state it computed with ``group`` (ok=False: it failed)."""

    peer_id: str
    ok: bool
    state_hash: str
    group: frozenset[str]


@dataclass(frozen=True)
class Candidate:
    """A hash, the group that says it computed it, and the members of that group who said so."""

    state_hash: str
    group: tuple[str, ...]  # sorted
    supporters: tuple[str, ...]  # sorted
    planned: int = 0  # how many planned participants stand in the round (its quorum is a majority of them)

    @property
    def needed(self) -> int:
        return max(quorum(group_size(self.group)), quorum(self.planned))

    @property
    def has_quorum(self) -> bool:
        return len(self.supporters) >= self.needed


@dataclass(frozen=True)
class Verdict:
    committed_hash: Optional[str]  # None: void
    holders: tuple[str, ...]  # the supporters of the committed hash, sorted; () when void
    reason: str  # "committed: …" or "voided: …", in words


def quorum(group_size: int) -> int:
    """Reports a group of ``group_size`` needs to commit: a strict majority, and two unless it is alone (0: none)."""
    return 1 if group_size <= 1 else max(2, group_size // 2 + 1)


def counted(claims: Iterable[Claim], participants: AbstractSet[str]) -> list[Claim]:
    """The successful claims whose group contains their reporter and only planned ``participants`` (a sized group:
    any, from a planned reporter).

    Each distinct group is checked against ``participants`` once: claims sharing one group cost O(1) each."""
    planned: dict[frozenset[str], tuple[bool, bool]] = {}  # group -> (sized, only planned members)
    found = []
    for claim in claims:
        if not (claim.ok and claim.state_hash and claim.peer_id in participants):
            continue
        judged = planned.get(claim.group)
        if judged is None:
            sized = is_sized(claim.group)
            judged = planned[claim.group] = (sized, sized or claim.group <= participants)
        if judged[1] and (judged[0] or claim.peer_id in claim.group):
            found.append(claim)
    return found


def candidates(
    claims: Iterable[Claim], participants: AbstractSet[str], standing: Optional[AbstractSet[str]] = None
) -> list[Candidate]:
    """Every (hash, group) some counted claim names, best first: with a quorum, then by supporters, then
    the smallest hash (and group), so that every reader of the same claims ranks them the same (``decide``
    voids a tie at the top, so the order among equals never picks a winner). ``standing``: the planned
    participants the quorum is a majority of (default: all of ``participants``)."""
    planned = len(participants if standing is None else standing)
    support: dict[tuple[str, frozenset[str]], set[str]] = {}
    for claim in counted(claims, participants):
        support.setdefault((claim.state_hash, claim.group), set()).add(claim.peer_id)
    found = [Candidate(h, tuple(sorted(g)), tuple(sorted(s)), planned) for (h, g), s in support.items()]
    return sorted(found, key=lambda c: (not c.has_quorum, -len(c.supporters), c.state_hash, c.group))


def decide(
    claims: Iterable[Claim], participants: AbstractSet[str], standing: Optional[AbstractSet[str]] = None
) -> Verdict:
    """The round's verdict on ``claims`` from peers planned as ``participants``, of whom ``standing`` (default:
    all) are still in the round: the quorum is a majority of those."""
    claims = list(claims)
    ranked = candidates(claims, participants, standing)
    ignored = sum(1 for c in claims if c.ok and c.state_hash) - len(counted(claims, participants))
    aside = (
        f"; {ignored} reports ignored: their group lacked the reporter or named peers not in the round"
        if ignored
        else ""
    )
    if not ranked:
        return Verdict(None, (), f"voided: no participant reported a successful exchange{aside}")
    best = ranked[0]
    of = f"{len(best.supporters)} of {group_size(best.group)} group members"
    if best.planned > group_size(best.group):
        of += f" ({best.planned} planned participants in the round)"
    if len(ranked) > 1 and len(ranked[1].supporters) == len(best.supporters):
        tied = [c for c in ranked if len(c.supporters) == len(best.supporters)]
        return Verdict(
            None,
            (),
            f"voided: a tie: {len(tied)} hashes or groups reported by {len(best.supporters)} "
            f"members each ({', '.join(_short(c.state_hash) for c in tied[:4])}){aside}",
        )
    if not best.has_quorum:
        return Verdict(
            None, (), f"voided: hash {_short(best.state_hash)} reported by {of}, no quorum (needs {best.needed}){aside}"
        )
    others = sum(len(c.supporters) for c in ranked[1:])
    dissent = f"; {others} reported other hashes or groups" if others else ""
    return Verdict(
        best.state_hash, best.supporters, f"committed: {of} agree on {_short(best.state_hash)}{dissent}{aside}"
    )


def _short(digest: str) -> str:
    return digest if len(digest) <= 12 else digest[:12] + "…"
