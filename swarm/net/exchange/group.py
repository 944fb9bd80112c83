"""The round's group over hivemind: rendezvous in the DHT, the butterfly all-reduce, and the DHT votes a
group decides by while the coordinator is unreachable. The round runner's GroupExchange and VoteBoard."""

from __future__ import annotations

import logging
import math
import statistics
from typing import Callable, Mapping, Optional, Protocol

import torch

from swarm.config import RunConfig
from swarm.core.aggregation import Aggregation
from swarm.core.codecs.codec import get_codec
from swarm.core.trust import credential
from swarm.core.wire_protocol import PROTOCOL
from swarm.net.bulk.transport import Transport
from swarm.net.dht_entries import guard
from swarm.net.exchange.allreduce import Exchange, ExchangeFailed
from swarm.net.exchange.exchange_result import ExchangeResult
from swarm.net.exchange.rendezvous import Member, group_key, participation_scale, rendezvous
from swarm.net.exchange.two_level import TwoLevelExchange, bytes_by_site
from swarm.net.group_decided import GroupDecided
from swarm.net.link.link_probe import PING_TIMEOUT_S
from swarm.net.link.link_stats import LinkEstimates
from swarm.net.votes import MAX_SENT_VOTES, collect_votes, group_decision, group_id, post_vote
from swarm.net.votes import Vote as DhtVote
from swarm.train.contribution import Contribution
from swarm.train.host_memory import release_free_memory
from swarm.train.round import Averaged, SyncFailed, Vote
from swarm.train.round_plan import RoundPlan
from swarm.v1 import coordinator_pb2 as pb

SENT = torch.empty(0)  # a contribution's Δ once the exchange sent it and nothing reads it again

logger = logging.getLogger(__name__)

VOTE_TTL_S = 600.0  # a vote outlives the longest outage the group decides through


class RoundFaults(Protocol):
    """The faults injected into a round's phases (the peer's fault plan: `--faults` or SWARM_FAULTS; empty by default)."""

    def at(self, round_no: int, phase: str) -> None: ...

    def fire(self, round_no: int, phase: str) -> float: ...

    def scale(self, round_no: int, what: str) -> float: ...


class DhtGroup:
    """Owned by the round runner's executor thread (``average``, ``post``, ``decide``); ``live_peers`` is
    written by the main thread from the coordinator's answers (a plain int: a stale read is harmless).
    ``member`` (the peer's key and credential, ``CoordinatorLink.member``) signs this peer's DHT entries and
    checks its groupmates'. A contribution's round plan (``swarm.train.round_plan``, made by the round runner) says
    the codec it is sent with, the shares of the reduction and the digest its group entry carries. It refuses a run
    a real swarm cannot exchange (``RoundConfig.check_real_swarm``)."""

    def __init__(
        self,
        transport: Transport,
        run: RunConfig,
        *,
        run_id: str,
        peer_id: str,
        peer_index: int,
        planned: Callable[[int], Optional[set[str]]],
        faults: RoundFaults,
        member: Optional[credential.Member],
        processes: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        if member is None:
            raise ValueError(
                "the round's group needs this peer's credential (CoordinatorLink.member after the join) "
                "to sign its entries and check its groupmates'."
            )
        if member.peer_id != peer_id:
            raise ValueError(f"the credential is for {member.peer_id}, not this peer ({peer_id}); rejoin to get one.")
        run.rounds.check_real_swarm()
        self.transport, self.run, self.run_id, self.member = transport, run, run_id, member
        self.peer_id, self.peer_index = peer_id, peer_index
        if not getattr(transport, "validates_entries", False):  # normally guarded from its start (PeerParts.transport)
            guard(transport.dht, member)  # this node refuses to store or relay forged entries
        self.planned = planned  # the coordinator's plan for a round, or the last known group while it is down
        self.processes = processes  # the planned peers' current libp2p ids, as of the last planned() answer
        self.plan_holds: Callable[[], bool] = lambda: False  # the last planned() answer is the coordinator's (the link)
        self.faults = faults
        self.exchange = Exchange(
            transport,
            run_id=run_id,
            aggregation=Aggregation.for_run(run),
            gather_all=run.rounds.all_gathered(),  # a run that admits strangers: no slice owners
        )
        # a groupmate's restarted process then fails its old one's exchange at once
        self.exchange.read_entries_as(member)
        self.two_level = (
            TwoLevelExchange(self.exchange, transport, run_id=run_id, group_size=run.rounds.group_size)
            if run.rounds.hierarchical
            else None
        )  # [rounds] hierarchical: by site, then across sites
        self.live_peers = 0  # the run's live peers as last heard from the coordinator (0: not yet)
        self.links = LinkEstimates()  # from every exchange's timings
        self.plans: dict[int, set[str]] = {}  # round -> the plan its group was matched by (the last 8 rounds)

    def probe_rtt_ms(self) -> float:
        """A first RTT estimate before any exchange: the median over the run's peers this node is connected
        to (NaN: none answered). Throughput waits for the first exchange: probing it would cost a transfer."""
        answers = self.transport.run(self.exchange.probe.rtt_s_to_connected(), timeout_s=PING_TIMEOUT_S + 5)
        seconds = list(answers.values())
        return 1000 * statistics.median(seconds) if seconds else math.nan

    def key(self, round_no: int, fragment: int) -> str:
        return group_key(self.run_id, round_no, fragment)

    def average(self, round_no: int, contribution: Contribution) -> Averaged:
        delta, weight = contribution.delta, float(contribution.samples)
        plan = contribution.plan
        if plan is None or plan.round_no != round_no:
            raise ValueError(
                f"round {round_no}: the contribution carries no plan of the round; the round runner"
                " makes it (RoundRunner.start)."
            )
        codec = plan.codec
        if self.faults.scale(round_no, "delta") != 1.0 or self.faults.scale(round_no, "weight") != 1.0:
            delta = delta * self.faults.scale(round_no, "delta")  # a Byzantine peer (attack soaks only)
            weight *= self.faults.scale(round_no, "weight")
        me = self._me(contribution, plan, weight)
        key = self.key(round_no, contribution.fragment)
        try:
            group = self._rendezvous(round_no, key, me)
            dropped_before = self.exchange.rejected_chunks
            # this peer reads Δ no more once sent: the exchange writes Δ̄ into its memory where the codec lets it (a
            # lossless one, or a lossy one whose residual goes to a file, swarm.train.sent_feedback)
            lossless = get_codec(codec).lossless
            into_delta = contribution.lowrank is None
            result = self._reduce(round_no, key, group, me, delta, plan, contribution.owner, into_delta)
        except ExchangeFailed as e:
            raise SyncFailed(str(e)) from e
        self.links.observe(result.links)
        scale = participation_scale(group)
        average = result.average if scale == 1.0 else result.average.mul_(scale)  # in place: no second Δ̄
        in_site, cross_site = bytes_by_site(result, group, me)
        # Δ's memory is Δ̄'s now (or, in two levels, freed before the outer step and the vote)
        if into_delta and lossless:
            contribution.delta = SENT
        release_free_memory()
        logger.info(
            "[%s r%d] averaged fragment %d with %d peers in %.2fs (%s, %d bytes sent: %d in-site, %d cross-site)%s",
            self.peer_id,
            round_no,
            contribution.fragment,
            len(group),
            result.seconds,
            codec,
            result.bytes_sent,
            in_site,
            cross_site,
            f", outer step scaled by {scale:.2f} ({len(group)} of {max(m.live_peers for m in group)} live peers)"
            if scale != 1.0
            else "",
        )
        return self._averaged(average, group, result, dropped_before)

    def _me(self, contribution: Contribution, plan: RoundPlan, weight: float) -> Member:
        """This peer's entry in the group's rendezvous: its contribution's weight, size, codec and plan."""
        return Member(
            peer_id=self.peer_id,
            dht_peer_id=self.transport.peer_id,
            index=self.peer_index,
            weight=weight,
            numel=contribution.delta.numel(),
            codec=plan.codec,
            plan=plan.digest,
            live_peers=self.live_peers if self.run.rounds.scale_by_participation else 0,
            maddrs=self.exchange.own_maddrs,
            site=self.member.site,
            bulk=self.exchange.bulk_address,
            protocol=PROTOCOL,
        )

    def _rendezvous(self, round_no: int, key: str, me: Member) -> list[Member]:
        """The group ``me`` is matched into under ``key`` by the rendezvous in the DHT."""
        rounds = self.run.rounds
        return rendezvous(
            self.transport.dht,
            key=key,
            me=me,
            member=self.member,
            planned=lambda: self._plan(round_no),
            window_s=rounds.matchmaking_window_s,
            ttl_s=2 * rounds.matchmaking_window_s + rounds.exchange_timeout_s,
            plan_holds=self.plan_holds,
            hold_s=rounds.round_timeout_s,
            on_posted=lambda: self.faults.at(round_no, "matchmaking"),
            processes=self.processes,
        )

    def _averaged(
        self, average: torch.Tensor, group: list[Member], result: ExchangeResult, dropped_before: int
    ) -> Averaged:
        """The round runner's account of one averaged fragment."""
        return Averaged(
            average=average,
            group=[m.peer_id for m in group],
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            seconds=result.seconds,
            contributions_rejected=len(result.rejected),
            contributions_clipped=len(result.clipped),
            foreign_messages_dropped=self.exchange.rejected_chunks - dropped_before,
            upload_mbit_s=self.links.upload_mbit_s,
            download_mbit_s=self.links.download_mbit_s,
            rtt_ms=self.links.rtt_ms,
        )

    def _reduce(
        self,
        round_no: int,
        key: str,
        group: list,
        me: Member,
        delta,
        plan: RoundPlan,
        owner=None,
        into_delta: bool = False,
    ):
        """The all-reduce: flat with the plan's shares (the controller's), or in two levels (whose sub-groups cut equal slices:
        the shares size a flat group's slices). ``into_delta``: the flat one may write Δ̄ into Δ's memory."""
        on_phase = lambda phase: self.faults.fire(round_no, phase)  # noqa: E731
        timeout_s = self.run.rounds.exchange_timeout_s
        if self.two_level is not None:
            return self.two_level.average(
                key=key, group=group, me=me, delta=delta, timeout_s=timeout_s, on_phase=on_phase
            )
        return self.exchange.average(
            key=key,
            group=group,
            me=me,
            delta=delta,
            timeout_s=timeout_s,
            shares=plan.shares_of([m.peer_id for m in group]),
            on_phase=on_phase,
            owner=owner,
            into_delta=into_delta,
        )

    def _plan(self, round_no: int) -> Optional[set[str]]:
        """``planned``, kept as the plan this peer matched its group by: a decision by the group's votes counts its
        quorum over it (``swarm.core.trust.commit_rule``), as the coordinator does."""
        plan = self.planned(round_no)
        if plan is not None:
            self.plans = {r: p for r, p in self.plans.items() if r > round_no - 8}
            self.plans[round_no] = set(plan)
        return plan

    def post(self, vote: Vote) -> None:
        post_vote(
            self.transport.dht,
            self.key(vote.round_no, vote.fragment),
            DhtVote(
                peer_id=self.peer_id,
                dht_peer_id=self.transport.peer_id,
                ok=vote.ok,
                state_hash=vote.state_hash,
                group=group_id(vote.group) if vote.ok else "",
            ),
            member=self.member,
            ttl_s=VOTE_TTL_S,
        )

    def group_decision(self, vote: Vote) -> Optional[GroupDecided]:
        """The group's own decision on ``vote``'s round by the commit rule, once every groupmate's vote is
        in the DHT; None when some are missing."""
        if not vote.group:
            return None
        ballots = collect_votes(
            self.transport.dht,
            self.key(vote.round_no, vote.fragment),
            vote.group,
            member=self.member,
            timeout_s=self.run.rounds.exchange_timeout_s,
        )
        if ballots is None:
            return None
        committed = group_decision(ballots.votes, self.plans.get(vote.round_no))
        holders = (
            [v.dht_peer_id for v in ballots.votes.values() if v.ok and v.state_hash == committed] if committed else []
        )
        return GroupDecided(committed, holders, signed_votes(ballots.signed))


def signed_votes(signed: Mapping[str, dict]) -> list[pb.SignedVote]:
    """A group's votes as the coordinator receives them with a report of the round the group decided alone
    (none for a group too large to send them all: the coordinator then counts its members' own reports only)."""
    if len(signed) > MAX_SENT_VOTES:
        return []
    return [
        pb.SignedVote(
            peer_id=peer_id,
            key=value["key"],
            body=value["body"],
            credential=value["credential"],
            signature=value["signature"],
        )
        for peer_id, value in sorted(signed.items())
    ]
