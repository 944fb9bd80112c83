"""The round's vote, posted in the DHT too, so a group can decide a round while the coordinator is down.

Every member posts (ok, hash of its tentative state) under the round's key, signed like the group
entries (``swarm.net.dht_entries``), so nobody votes for another peer. When the coordinator
cannot be reached, a member that reads the votes of *every* groupmate applies the coordinator's own
rule to them (``swarm.core.commit_rule``: a hash commits with a quorum of the group, else the round is
void); the group is the set of voters, as every vote under one group key comes from that group. Members
that saw the same complete set of votes therefore decide the same; a member that cannot see them all
decides nothing and waits for the coordinator, which later receives the same reports and, by the
same rule, confirms the decision (a peer whose local decision is contradicted resyncs).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import hivemind

from swarm.core import commit_rule
from swarm.core.credential import Member
from swarm.net.dht_entries import read_entries, store_entry

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Vote:
    peer_id: str
    dht_peer_id: str
    ok: bool
    state_hash: str


def vote_key(group_key: str) -> str:
    return f"{group_key}.votes"


def post_vote(dht: hivemind.DHT, group_key: str, vote: Vote, *, member: Member, ttl_s: float) -> None:
    store_entry(dht, vote_key(group_key), vote, member=member, ttl_s=ttl_s)


def collect_votes(dht: hivemind.DHT, group_key: str, members: list[str], *, member: Member, timeout_s: float,
                  poll_s: float = 0.2) -> Optional[dict[str, Vote]]:
    """Every member's vote (signed by that member), or None when some are still missing after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        votes = {p: v for p, v in read_entries(dht, vote_key(group_key), Vote, member=member).items() if p in members}
        if set(votes) == set(members):
            return votes
        if time.monotonic() >= deadline:
            logger.info("%s: %d of %d votes arrived", group_key, len(votes), len(members))
            return None
        time.sleep(poll_s)  # polling the DHT: there is no change notification to await


def group_decision(votes: dict[str, Vote]) -> Optional[str]:
    """The coordinator's rule on a complete set of a group's votes (keyed by member): the committed hash,
    or None (void)."""
    group = frozenset(votes)
    verdict = commit_rule.decide(
        [commit_rule.Claim(peer_id, v.ok, v.state_hash, group) for peer_id, v in votes.items()], group)
    logger.info("group of %d decided by its votes: %s", len(group), verdict.reason)
    return verdict.committed_hash
