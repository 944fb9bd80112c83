"""A round a group decided by its DHT votes while the coordinator was down, taken as the group decided it.

While the coordinator is unreachable a group decides its round by the commit rule on its members' signed
DHT votes (``swarm.net.votes``) and goes on; back, the coordinator hears each member's report of it. But
members may die in between (a chaos soak killed two of five), and a restarted coordinator may open the
round with only the peers ready at that moment: the survivors' reports then named a group with members
outside the round, counted for nothing, and a restarted peer's lone round was committed instead of the
group's. So a member's report of such a round carries every member's vote as signed; the coordinator
checks the signatures itself (``checked_votes``), adds the group's members to the round, and counts the
vote of each member whose process is gone (restarted, or not alive) as that member's report
(``adopt``). Such a stand-in report counts for the commit rule, but its peer is not a holder of the
committed state: its process, if any, is another one.

Votes count only for peers the coordinator planned with the group: a voter must be a participant of the open
round (or one it went on without), or one of the group that could have gone on without this coordinator (``outage_group``: the
participants of the last round stored when this coordinator process started, alive then). A coordinator that
never restarted therefore adds nobody by votes, and no report can bring in identities that had left.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import AbstractSet, Mapping, Optional

from coordinator.api.errors import BadRequest
from coordinator.rounds import outcome
from coordinator.store.records import OPEN, PeerRecord, ReportRecord, RoundRecord
from swarm.core.trust.round_vote import MAX_SENT_VOTES, Vote, group_id, vote_fragment
from swarm.core.trust.signed_entry import EntryRejected, verify_signed
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


def checked_votes(
    req: pb.ReportRoundRequest, *, run_id: str, coordinator_public_key: bytes, now: float
) -> dict[str, Vote]:
    """The votes ``req`` carries, by voter, once they prove what it claims: one vote signed by each member of
    its group (and no one else) for this run's round ``req.round``, all for one fragment, its own among them
    and the same as its report, every successful vote naming that group. BadRequest (one sentence) if not."""
    group = set(req.group)
    voters = [v.peer_id for v in req.group_votes]
    if (
        len(voters) > MAX_SENT_VOTES
        or len(set(voters)) != len(voters)
        or set(voters) != group
        or req.peer_id not in group
    ):
        raise BadRequest(
            f"round {req.round}: the report's votes are not one from each member of its group of "
            f"{len(group)}; send the group's votes as collected from the DHT."
        )
    key = req.group_votes[0].key
    if vote_fragment(key, run_id, req.round) is None or any(v.key != key for v in req.group_votes):
        raise BadRequest(
            f"round {req.round}: the report's votes are not all for one fragment of this run's round "
            f"{req.round}; send the group's votes as collected from the DHT."
        )
    votes: dict[str, Vote] = {}
    digest = group_id(list(req.group))
    for signed in req.group_votes:
        value = {"body": signed.body, "credential": signed.credential, "signature": signed.signature}
        try:
            vote = verify_signed(
                value,
                key=signed.key,
                subkey=signed.peer_id,
                cls=Vote,
                coordinator_public_key=coordinator_public_key,
                run_id=run_id,
                now=now,
            )
        except EntryRejected as e:
            raise BadRequest(
                f"round {req.round}: the vote of {signed.peer_id} does not check out ({e}); "
                "send the votes exactly as the DHT holds them."
            ) from None
        if vote.ok and vote.group != digest:
            raise BadRequest(
                f"round {req.round}: {signed.peer_id} voted with another group than the report's; "
                "send only the votes of the group this peer averaged with."
            )
        votes[signed.peer_id] = vote
    mine = votes[req.peer_id]
    if (mine.ok, mine.state_hash) != (req.ok, req.state_hash):
        raise BadRequest(
            f"round {req.round}: the report says {req.state_hash or 'failure'} but its own vote says "
            f"{mine.state_hash or 'failure'}; report what this peer voted."
        )
    return votes


def outage_group(latest: Optional[RoundRecord], peers: Mapping[str, PeerRecord]) -> frozenset[str]:
    """The peers a group that went on without the coordinator can hold: the participants of ``latest``, the last
    round stored when this coordinator process started, that were alive then (none for a new run)."""
    if latest is None:
        return frozenset()
    return frozenset(p for p in latest.participants if p in peers and peers[p].alive)


def adopt(
    round_row: RoundRecord,
    reports: Mapping[str, ReportRecord],
    votes: Mapping[str, Vote],
    *,
    reporter: str,
    peers: Mapping[str, PeerRecord],
    now: float,
    outage: AbstractSet[str] = frozenset(),
) -> tuple[RoundRecord, list[ReportRecord]]:
    """The open round with the voters as participants (the group decided the round with them), and a stand-in
    report for each voter whose process is gone (it is not alive, or it runs under another libp2p id now) and who
    has not reported itself, or whose next process reported a failure. Members alive in the same process report
    themselves. Only voters the coordinator planned count: participants of the round (or left out of it), or of
    ``outage`` (``outage_group``); the others' votes are ignored, and the round without them keeps its quorum."""
    if round_row.outcome != OPEN:
        return round_row, []
    planned = set(round_row.participants) | set(round_row.left_out) | set(outage)
    unplanned = sorted(p for p in votes if p not in planned)
    if unplanned:
        logger.warning(
            "round %d: ignored the signed votes of %d peers this coordinator did not plan with the group: %s",
            round_row.round,
            len(unplanned),
            ", ".join(unplanned),
        )
    members = [p for p in sorted(votes) if p in peers and p in planned]
    added = tuple(p for p in members if p not in round_row.participants)
    if added:
        round_row = _with_participants(round_row, added)
    return round_row, _stand_ins(round_row, reports, votes, members, reporter=reporter, peers=peers, now=now)


def _with_participants(round_row: RoundRecord, added: tuple[str, ...]) -> RoundRecord:
    """``round_row`` with the voters it had not planned (``added``) as participants."""
    # the plan lists a budget per participant: they trained before the coordinator was back, so theirs is the
    # round's largest, their step time unknown
    aligned = len(round_row.budgets) == len(round_row.participants)
    budgets, times = round_row.budgets, round_row.step_times_s
    if aligned:
        budgets, times = budgets + (max(budgets, default=0),) * len(added), times + (0.0,) * len(added)
    logger.info(
        "round %d: taken with the group that decided it while the coordinator was away (%d more participants: %s)",
        round_row.round,
        len(added),
        ", ".join(added),
    )
    return dataclasses.replace(
        round_row,
        participants=round_row.participants + added,
        budgets=budgets,
        step_times_s=times,
        left_out=tuple(p for p in round_row.left_out if p not in added),
    )


def _stand_ins(
    round_row: RoundRecord,
    reports: Mapping[str, ReportRecord],
    votes: Mapping[str, Vote],
    members: list[str],
    *,
    reporter: str,
    peers: Mapping[str, PeerRecord],
    now: float,
) -> list[ReportRecord]:
    """A report standing in for each member whose process is gone, from its signed vote (``adopt``)."""
    group = tuple(sorted(votes))
    stand_ins = []
    for peer_id in members:
        vote, peer, earlier = votes[peer_id], peers[peer_id], reports.get(peer_id)
        if peer_id == reporter or (peer.alive and peer.dht_peer_id == vote.dht_peer_id):
            continue
        stand_in = ReportRecord(
            round=round_row.round,
            peer_id=peer_id,
            reported_at=now,
            ok=vote.ok,
            state_hash=vote.state_hash,
            group=group,
            error=outcome.BY_VOTE,
        )
        # none, its placeholder, its next process's failure
        if earlier is None or outcome.supersedes(stand_in, earlier):
            stand_ins.append(stand_in)
            logger.info(
                "peer %s: round %d: its process is gone; its signed vote counts (%s)",
                peer_id,
                round_row.round,
                f"hash {vote.state_hash[:12]}" if vote.ok else "failure",
            )
    return stand_ins
