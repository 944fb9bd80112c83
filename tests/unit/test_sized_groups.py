"""A group too large to name (more than NAMED_GROUP_MAX members) is reported by its digest and size: such a round
commits on a majority of its planned participants, a liar's digest or size is one vote that never lowers the quorum,
a report that could have named its group is refused in one sentence, and a peer of such a group waits for the
coordinator instead of deciding by votes it cannot carry."""

import pytest

from coordinator.api.errors import BadRequest
from coordinator.rounds.settling import SETTLE_EVERY_S
from swarm.core.trust import commit_rule
from swarm.core.trust.commit_rule import Claim, decide, group_size, sized_group
from swarm.core.trust.round_vote import group_id
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.test_offline_votes import _decided_alone, _link, _vote
from tests.unit.test_round_info_bounded import polled, swarm

pytestmark = pytest.mark.timeout(240)

BIG = commit_rule.NAMED_GROUP_MAX + 76


def test_a_majority_of_a_sized_group_commits_and_a_liars_digest_is_one_vote() -> None:
    planned = {f"p{i}" for i in range(BIG * 2)}
    ids = sorted(planned)
    honest = sized_group(group_id(ids), len(ids))
    claims = [Claim(p, True, "h1", honest) for p in ids[: BIG + 1]]
    liar = sized_group("f" * 16, commit_rule.NAMED_GROUP_MAX + 1)  # says its group is as small as it may be
    claims += [Claim(p, True, "h2", liar) for p in ids[BIG + 1 : BIG + 300]]
    verdict = decide(claims, planned)
    assert verdict.committed_hash == "h1" and len(verdict.holders) == BIG + 1
    assert f"{BIG + 1} of {2 * BIG} group members" in verdict.reason
    assert group_size(honest) == 2 * BIG and group_size(frozenset(ids[:3])) == 3
    # fewer than half the planned participants: no quorum, whatever size the digest says
    short = decide(claims[: BIG - 10], planned)
    assert short.committed_hash is None and "no quorum" in short.reason
    # a sized group claimed by peers not planned counts for nothing
    assert decide([Claim("stranger", True, "h3", liar)], planned).committed_hash is None


@pytest.mark.slow  # a coordinator engine with more participants than a report may name
def test_a_round_too_large_to_name_its_group_commits_with_the_reporters_as_holders() -> None:
    now = [1_000.0]
    engine, ids = swarm(BIG, clock=lambda: now[0])
    digest = group_id(ids)
    with pytest.raises(BadRequest, match="name a group of up to 1024 members"):
        engine.report(
            pb.ReportRoundRequest(
                peer_id=ids[0],
                round=1,
                ok=True,
                state_hash="cd" * 8,
                group_digest=digest,
                group_size=12,
                samples=10,
                inner_steps=10,
            )
        )
    reporters, liars = ids[:-100], ids[-100:]  # the liars name another group and hash
    for p in ids:
        now[0] += 0.001
        lying = p in liars
        engine.report(
            pb.ReportRoundRequest(
                peer_id=p,
                round=1,
                ok=True,
                state_hash=("ef" if lying else "cd") * 8,
                group_digest="0" * 16 if lying else digest,
                group_size=len(ids),
                samples=10,
                inner_steps=10,
            )
        )
    now[0] += SETTLE_EVERY_S
    engine.tick()
    info, _ = polled(engine, ids[0], 1)
    assert info.outcome == pb.ROUND_OUTCOME_COMMITTED and info.committed_hash == "cd" * 8
    assert {int(h.split("-")[1]) for h in info.holders} <= set(range(len(reporters)))  # holders by DHT id: dht-i
    assert engine.history(engine.run.token, max_rounds=1).rounds[0].group_size == len(ids)


def test_a_peer_reports_a_group_too_large_to_name_by_digest_and_waits_for_the_coordinator() -> None:
    asked: list = []
    group = [f"p-{i}" for i in range(BIG)]
    link = _link(set(group), asked)
    link.coordinator_decided = True
    vote = _vote(7, group)
    request = link.report_request(vote)
    assert list(request.group) == [] and request.group_digest == group_id(group) and request.group_size == BIG
    assert _decided_alone(link, vote) is None and not asked  # no votes to decide by: the coordinator decides
    small = link.report_request(_vote(7, group[:5]))
    assert list(small.group) == group[:5] and not small.group_digest and not small.group_size
