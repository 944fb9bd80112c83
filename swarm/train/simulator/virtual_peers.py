"""N virtual peers in one process, each running its rounds through the same round runner as a real
peer, with an in-process board as their group exchange, vote board, coordinator and state store."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional

import torch

from swarm.config import RunConfig
from swarm.core.aggregation import Aggregation
from swarm.core.all_gather import gather_bytes_by_site, gather_reference
from swarm.core.average import butterfly_bounds, butterfly_reference, stripe_count
from swarm.core.codecs import lowrank
from swarm.core.codecs.codec import Codec, get_codec
from swarm.core.fragments import round_end_step
from swarm.core.site_plan import butterfly_bytes_by_site, plan_sites, two_level_bytes_sent, two_level_reference
from swarm.core.state import GlobalState
from swarm.core.trust import commit_rule
from swarm.train.contribution import Contribution, TrainStats
from swarm.train.round import Averaged, Decision, Hooks, InlineExecutor, Outcome, RoundRunner, Vote
from swarm.train.trainer import LocalTrainer

# (peer index, round, its honest contribution) -> what it sends: a Byzantine peer in a benchmark or test.
Tamper = Callable[[int, int, Contribution], Contribution]
# (owner index, round, the average of a butterfly slice it owns) -> the average it sends instead, or None to send the
# honest one: a malicious slice owner in a benchmark or test (an all-gather has no owners).
OwnerTamper = Callable[[int, int, torch.Tensor], Optional[torch.Tensor]]


def steps_between(rate: Fraction, start: int, end: int) -> int:
    """Inner steps a peer at ``rate`` completes between nominal steps ``start`` and ``end`` (a time
    budget: progress carries over, so a 1/3-speed peer does exactly one step in three)."""
    return math.floor(rate * end) - math.floor(rate * start)


class Board:
    """The in-process group, vote board and coordinator of N virtual peers. Every virtual peer runs on
    its own thread holding ``cond``'s lock, released only while it waits here for the others: so one
    peer computes at a time (the bits and the inner-step timings are those of a sequential run), and
    the round runner blocks exactly where a real peer would."""

    def __init__(
        self,
        peers: int,
        rounds: int,
        wire: Codec,
        aggregation: Aggregation = Aggregation(),
        *,
        sites: Optional[list[str]] = None,
        hierarchical: bool = False,
        group_size: int = 0,
        shapes: Optional[list[list[tuple[int, ...]]]] = None,
        gather_all: bool = False,
        owner_tamper: Optional[OwnerTamper] = None,
    ) -> None:
        self.peers, self.rounds, self.wire = peers, rounds, wire
        self.gathered = wire.gathered or gather_all  # every peer decodes all contributions (swarm.core.all_gather)
        self.owner_tamper = owner_tamper
        # a lowrank codec: each fragment's layout of matrices and dense parts (swarm.core.codecs.lowrank)
        self.layouts = [lowrank.layout(f, wire.rank) for f in shapes or []] if wire.lowrank else []
        self.lowrank_rounds: dict[int, lowrank.LowRankRound] = {}
        self.aggregation = aggregation
        self.sites = sites or [""] * peers  # each virtual peer's site, as its credential would carry it
        # [rounds] hierarchical: the two-level plan of the group of every virtual peer (None: one flat group)
        self.plan = plan_sites(self.sites, group_size) if hierarchical else None
        self.cond = threading.Condition()
        self.contributions: dict[int, dict[int, Contribution]] = {}
        self.averages: dict[int, torch.Tensor] = {}
        self.votes: dict[int, dict[int, Vote]] = {}
        self.cross_site_bytes: dict[int, dict[int, int]] = {}  # round -> peer -> bytes sent to other sites
        # round -> [i][j] payload bytes peer i sent peer j: a variable_size codec's, counted from its payloads
        self.pair_bytes: dict[int, list[list[int]]] = {}
        self.failed: Optional[BaseException] = None

    def wait_all(self, table: dict[int, dict], round_no: int) -> None:
        self.cond.notify_all()
        if not self.cond.wait_for(lambda: self.failed is not None or len(table[round_no]) == self.peers, timeout=600):
            raise RuntimeError(f"sim round {round_no}: a virtual peer never arrived")
        if self.failed is not None:
            raise RuntimeError("another virtual peer failed") from self.failed

    def average(self, index: int, round_no: int, contribution: Contribution) -> Averaged:
        self.contributions.setdefault(round_no, {})[index] = contribution
        self.wait_all(self.contributions, round_no)
        ordered = [self.contributions[round_no][i] for i in range(self.peers)]
        if round_no not in self.averages:
            weights = self.aggregation.weights([float(c.samples) for c in ordered], [str(i) for i in range(self.peers)])
            reduce = lambda d, w: self.aggregation.reduce(d, w).average  # noqa: E731
            deltas = [c.delta for c in ordered]
            if self.wire.lowrank:  # two butterflies of the factors (swarm.core.codecs.lowrank)
                lay = self.layouts[ordered[0].fragment]
                qs = [c.lowrank.q_for(lay) if c.lowrank is not None else lowrank.initial_q(lay, 0) for c in ordered]
                done = lowrank.lowrank_reference(deltas, weights, self.wire, lay, qs, reduce=reduce)
                self.averages[round_no], self.lowrank_rounds[round_no] = done.average, done
            elif self.gathered:
                pairs = [[0] * self.peers for _ in range(self.peers)] if self.wire.variable_size else None
                self.averages[round_no] = gather_reference(deltas, weights, self.wire, reduce=reduce, pair_bytes=pairs)
                if pairs is not None:
                    self.pair_bytes[round_no] = pairs
            else:
                owners = [c.owner for c in ordered]  # peer i owns slice i
                pairs = [[0] * self.peers for _ in range(self.peers)] if self.wire.variable_size else None
                self.averages[round_no] = (
                    butterfly_reference(deltas, weights, self.wire, reduce=reduce, owners=owners, pair_bytes=pairs)
                    if self.plan is None
                    else two_level_reference(deltas, weights, self.plan, self.wire, reduce=reduce)
                )
                if pairs is not None:
                    self.pair_bytes[round_no] = pairs
                if self.owner_tamper is not None and self.plan is None:
                    self._tamper_owned(round_no, self.averages[round_no])
        if self.wire.lowrank and contribution.lowrank is not None:
            done = self.lowrank_rounds[round_no]
            contribution.lowrank.stage(done.q_next, done.delivered[index])
        if round_no in self.pair_bytes:
            in_site, cross_site = self.sent_by_site(self.pair_bytes[round_no])[index]
        else:
            in_site, cross_site = self.bytes_sent(contribution.delta.numel(), contribution.fragment)[index]
        self.cross_site_bytes.setdefault(round_no, {})[index] = cross_site
        return Averaged(
            average=self.averages[round_no], group=[str(i) for i in range(self.peers)], bytes_sent=in_site + cross_site
        )

    def _tamper_owned(self, round_no: int, average: torch.Tensor) -> None:
        """What malicious owners send instead of their slices' averages, encoded and decoded as every member would
        decode it, written into ``average`` (every member decodes the owner's same bytes)."""
        k, numel = self.peers, average.numel()
        bounds = butterfly_bounds(numel, k, self.wire.block, stripe_count(self.wire, numel, k))
        for part, (start, end) in enumerate(bounds):
            sent = self.owner_tamper(part % k, round_no, average[start:end].clone())
            if sent is not None:
                average[start:end] = self.wire.decode(
                    self.wire.encode(sent.to(torch.float32).contiguous()), end - start
                )

    def bytes_sent(self, numel: int, fragment: int = 0) -> list[tuple[int, int]]:
        """(in-site, cross-site) payload bytes each virtual peer sends in one exchange of ``numel`` elements."""
        if self.wire.lowrank:
            lay = self.layouts[fragment]
            both = [butterfly_bytes_by_site(n, self.sites, self.wire.values) for n in (lay.p_numel, lay.q_numel)]
            return [(a[0] + b[0], a[1] + b[1]) for a, b in zip(*both)]
        if self.gathered:
            return gather_bytes_by_site(numel, self.sites, self.wire)
        if self.plan is not None:
            return two_level_bytes_sent(numel, self.plan, self.wire)
        return butterfly_bytes_by_site(numel, self.sites, self.wire)

    def sent_by_site(self, pairs: list[list[int]]) -> list[tuple[int, int]]:
        """(in-site, cross-site) bytes of each peer from the bytes ``pairs[i][j]`` peer i sent peer j."""
        out = []
        for i, site in enumerate(self.sites):
            same = sum(n for j, n in enumerate(pairs[i]) if j != i and site and self.sites[j] == site)
            out.append((same, sum(pairs[i]) - same))
        return out

    def decide(self, vote: Vote, index: int) -> Decision:
        self.votes.setdefault(vote.round_no, {})[index] = vote
        self.wait_all(self.votes, vote.round_no)
        everyone = frozenset(str(i) for i in range(self.peers))  # one group of every virtual peer
        committed = commit_rule.decide(
            [commit_rule.Claim(str(i), v.ok, v.state_hash, everyone) for i, v in self.votes[vote.round_no].items()],
            everyone,
        ).committed_hash
        return Decision(vote.round_no, committed, finished=vote.round_no == self.rounds)


@dataclass
class VirtualPeer(Hooks):
    """One virtual peer's side of the board (its exchange, votes, decider and store) and its records."""

    index: int
    board: Board
    trained_stats: dict[int, TrainStats] = field(default_factory=dict)
    bytes_sent: dict[int, int] = field(default_factory=dict)
    hashes: dict[int, str] = field(default_factory=dict)
    evals: dict[int, float] = field(default_factory=dict)
    # Benchmarks and tests only: what this peer sends instead of its contribution (an attacker); its
    # own trainer keeps the honest contribution.
    tamper: Optional[Tamper] = None

    def average(self, round_no: int, contribution: Contribution) -> Averaged:
        sent = contribution if self.tamper is None else self.tamper(self.index, round_no, contribution)
        averaged = self.board.average(self.index, round_no, sent)
        self.bytes_sent[round_no] = averaged.bytes_sent
        return averaged

    def post(self, vote: Vote) -> None:
        pass  # the board sees every vote in decide

    def decide(self, vote: Vote) -> Decision:
        return self.board.decide(vote, self.index)

    def still_planned(self, round_no: int) -> bool:
        return True

    def round_choice(self, round_no: int) -> None:
        return None  # no controller: every round's plan is the run's config (swarm.train.round_plan)

    def save_vote(self, state: GlobalState) -> None:
        pass

    def committed(self, state: GlobalState, *, provisional: bool) -> None:
        self.hashes[state.round_no] = state.state_hash

    def voided(self, round_no: int, *, provisional: bool) -> None:
        raise RuntimeError(f"sim round {round_no} was voided: the virtual peers disagree")

    def trained(self, round_no: int, stats: TrainStats) -> None:
        self.trained_stats[round_no] = stats

    def evaluated(self, round_no: int, loss: float) -> None:
        self.evals[round_no] = loss


def drive(runner: RoundRunner, peer: VirtualPeer, rounds: int) -> None:
    board = peer.board
    with board.cond:
        try:
            carry = None
            for r in range(1, rounds + 1):
                result = runner.run_round(r, carry)
                if result.outcome not in (Outcome.COMMITTED, Outcome.IN_FLIGHT):
                    raise RuntimeError(f"sim round {r}: {result.outcome.value} on virtual peer {peer.index}")
                carry = result.pending
            if carry is not None:  # the run ends: the peers wait for the last exchange
                runner.finish(carry)
        except BaseException as e:
            board.failed = board.failed or e
            board.cond.notify_all()
            raise


def run_peers(
    run: RunConfig,
    trainers: list[LocalTrainer],
    rates: list[Fraction],
    rounds: int,
    tamper: Optional[Tamper] = None,
    sites: Optional[list[str]] = None,
    owner_tamper: Optional[OwnerTamper] = None,
) -> list[VirtualPeer]:
    """Every virtual peer runs its rounds through the round runner, on its own thread. ``tamper``
    (benchmarks and tests) replaces what the peers send, see ``Tamper``, and ``owner_tamper`` what butterfly slice
    owners send, see ``OwnerTamper``; ``sites`` are the peers' sites."""
    board = Board(
        len(trainers),
        rounds,
        get_codec(run.rounds.codec),
        Aggregation.for_run(run),
        sites=sites,
        hierarchical=run.rounds.hierarchical,
        group_size=run.rounds.group_size,
        shapes=[trainers[0].fragment_shapes(f) for f in range(run.rounds.fragments)],
        gather_all=run.rounds.all_gathered(),
        owner_tamper=owner_tamper,
    )
    peers, threads, errors = [], [], []
    for i, (trainer, rate) in enumerate(zip(trainers, rates)):
        peer = VirtualPeer(i, board, tamper=tamper)
        runner = RoundRunner(
            trainer,
            run,
            exchange=peer,
            votes=peer,
            decider=peer,
            store=peer,
            hooks=peer,
            executor=InlineExecutor(),
            evaluate=i == 0,
            budget=budget(rate, run),
        )
        threads.append(threading.Thread(target=guard, args=(errors, drive, runner, peer, rounds), name=f"sim-peer-{i}"))
        peers.append(peer)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return peers


def budget(rate: Fraction, run: RunConfig):
    """A time budget: in round r a peer at ``rate`` does the steps it completes by the round's nominal
    end, the first of them by the nominal τ-th step (when the previous exchange lands)."""
    h, num_fragments, overlap = run.rounds.inner_steps, run.rounds.fragments, run.rounds.overlap_steps

    def steps(round_no: int) -> tuple[int, int]:
        start, end = round_end_step(round_no - 1, h, num_fragments), round_end_step(round_no, h, num_fragments)
        return steps_between(rate, start, start + overlap), steps_between(rate, start, end)

    return steps


def guard(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # re-raised on the caller's thread
        errors.append(e)
