"""The round's vote, posted in the DHT too, so a group can decide a round while the coordinator is down.

Every member posts (ok, hash of its tentative state) under the round's key, signed like the group
entries (``swarm.net.dht_entries``), so nobody votes for another peer. When the coordinator
cannot be reached, a member that reads the votes of *every* groupmate applies the coordinator's own
rule to them (``swarm.core.trust.commit_rule``: a hash commits with a quorum of the group and of the plan it was
matched by, else the round is void); the group is the set of voters, as every vote under one group key comes from
that group. Members
that saw the same complete set of votes therefore decide the same; a member that cannot see them all
decides nothing and waits for the coordinator, which later receives the same reports and, by the
same rule, confirms the decision (a peer whose local decision is contradicted resyncs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional

from swarm.core.trust import commit_rule
from swarm.core.trust.credential import Member
from swarm.core.trust.round_vote import MAX_SENT_VOTES, Vote, group_id, vote_key
from swarm.net.dht_entries import read_signed_entries, store_entry
from swarm.net.hivemind_api import DHT

__all__ = ["MAX_SENT_VOTES", "Ballots", "Vote", "collect_votes", "group_decision", "group_id", "post_vote", "vote_key"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ballots:
    """A group's complete votes, by member, each with the signed DHT value it came in: a member passes those
    on to the coordinator, which checks the signatures itself (``coordinator.rounds.offline_votes``)."""

    votes: dict[str, Vote]
    signed: dict[str, dict[str, Any]]


def post_vote(dht: DHT, group_key: str, vote: Vote, *, member: Member, ttl_s: float) -> None:
    store_entry(dht, vote_key(group_key), vote, member=member, ttl_s=ttl_s)


def collect_votes(
    dht: DHT, group_key: str, members: list[str], *, member: Member, timeout_s: float, poll_s: float = 0.2
) -> Optional[Ballots]:
    """Every member's vote (signed by that member), or None when some are still missing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = read_signed_entries(dht, vote_key(group_key), Vote, member=member)
        votes = {p: v for p, (v, _) in found.items() if p in members}
        if set(votes) == set(members):
            return Ballots(votes, {p: found[p][1] for p in members})
        if time.monotonic() >= deadline:
            logger.info("%s: %d of %d votes arrived", group_key, len(votes), len(members))
            return None
        time.sleep(poll_s)  # polling the DHT: there is no change notification to await


def group_decision(votes: dict[str, Vote], planned: Optional[set[str]] = None) -> Optional[str]:
    """The coordinator's rule on a complete set of a group's votes (keyed by member): the committed hash,
    or None (void). ``planned``: the participants the group was matched by (None: the group), whose majority
    the quorum is, so that a group that is a minority of its plan does not commit here either."""
    group = frozenset(votes)
    standing = group | frozenset(planned or ())
    verdict = commit_rule.decide(
        [commit_rule.Claim(peer_id, v.ok, v.state_hash, group) for peer_id, v in votes.items()], standing, standing
    )
    logger.info("group of %d decided by its votes: %s", len(group), verdict.reason)
    return verdict.committed_hash
