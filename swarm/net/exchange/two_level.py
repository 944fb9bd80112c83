"""Two-level averaging over the network (``[rounds] hierarchical``; the plan and the math are
``swarm.core.site_plan``): each sub-group of a site runs the butterfly all-reduce among itself over its fast
links, the sub-groups' representatives run it across sites with their sub-groups' averages weighted by the
sub-groups' total samples, and each representative hands that result to its sub-group
(``swarm.net.exchange.site_broadcast``). Every member ends with the representatives' cross-site average, the same
bytes everywhere.

A sub-group whose own exchange fails (e.g. a member killed mid-exchange, whose abort or failed send reaches the
sub-group at once) does not fail the others: its representative still takes part across sites but withdraws it
(``swarm.net.exchange.withdrawal``: no contribution, its weight out of every slice's reduction; it still reduces
and sends the slices it owns), so the cross-site average is the surviving sub-groups' and comes without waiting
for any timeout. The representative hands that average to its sub-group as usual, so its live members end with
the same θg as everyone; a member whose representative does not answer a ping fails at once (nobody would hand it
an average). A representative that dies costs the cross-site exchange one failed send, as in a flat group; the
representatives that answer a ping then run it once more among themselves (under a key that names them, so
representatives that disagree on who is gone are never merged) and their sub-groups end with their average; the
dead one's members fail at once. A cross-site exchange whose every sub-group withdrew fails.

What holds at which level: in a sub-group and across sites, the butterfly's guarantees hold as in a flat
group (slices only from the libp2p id of the signed entry's member, declared weights capped, the run's
aggregation rule on every slice, an abort fails the level at once, a withdrawal counts only from the member it
withdraws and only takes a weight out); across sites the weights are the sub-groups' summed capped weights,
which every representative derives from the signed entries, and the rule compares sub-group averages, so a
robust rule needs three or more sub-groups to see an outlier. A
member cannot check its representative's cross-site average: a dishonest representative can give its
sub-group any finite vector (the bound is the commit vote: those members then hold another θg than the
rest). Sites come from coordinator-signed credentials; the plan digest is in every key and message.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from swarm.core.site_plan import SitePlan, plan_sites, subgroup_weights
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.allreduce import Exchange, ExchangeResult
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.rendezvous import Member, group_digest
from swarm.net.exchange.site_broadcast import SiteBroadcast
from swarm.net.exchange.slices.reduction import capped_weights
from swarm.net.link.link_probe import PING_TIMEOUT_S
from swarm.net.link.link_stats import LinkTimings

logger = logging.getLogger(__name__)

CROSS_SITE = "cross"  # the cross-site exchange's run-id suffix: its own handler and keys
PING_TRIES = 3  # a member whose sub-group failed pings its representative this often before it gives up


@dataclass
class TwoLevelResult(ExchangeResult):
    in_site_bytes_sent: int = 0  # to groupmates at this peer's site
    cross_site_bytes_sent: int = 0  # to groupmates at other sites (or without a site)
    representative: bool = False  # this peer took part in the cross-site exchange
    subgroups: int = 1
    withdrawn: bool = False  # this peer's sub-group failed: the average is the other sub-groups', without this peer's


class TwoLevelExchange:
    """Owned by the thread that runs the round's exchanges. ``in_site`` is the run's Exchange (its handler
    serves the sub-groups); the cross-site exchange and the broadcast get handlers of their own."""

    def __init__(self, in_site: Exchange, transport: Transport, *, run_id: str, group_size: int) -> None:
        self.in_site, self.run_id, self.group_size = in_site, run_id, group_size
        aggregation = in_site.aggregation
        # Level-2 weights are sums of at most group_size capped weights (any number with no cap).
        cap = aggregation.max_weight * group_size if group_size else float("inf")
        self.cross_site = Exchange(
            transport, run_id=f"{run_id}.{CROSS_SITE}", aggregation=dataclasses.replace(aggregation, max_weight=cap)
        )
        self.broadcast = SiteBroadcast(transport, run_id=run_id)

    def plan(self, group: list[Member]) -> SitePlan:
        return plan_sites([m.site for m in group], self.group_size)

    def average(
        self,
        *,
        key: str,
        group: list[Member],
        me: Member,
        delta: torch.Tensor,
        timeout_s: float,
        on_phase: Optional[Callable[[str], Optional[float]]] = None,
    ) -> TwoLevelResult:
        """Average ``delta`` with the group in two levels; ExchangeFailed unless this peer holds the final
        average. ``on_phase`` reaches the sub-group's exchange (fault injection)."""
        started = time.perf_counter()
        plan = self.plan(group)
        digest = plan.digest(group_digest(group))
        position = [m.peer_id for m in group].index(me.peer_id)
        subgroup = plan.subgroup_of(position)
        members = [group[p] for p in subgroup.positions]
        cross = len(plan.subgroups) > 1
        represents = cross and subgroup.representative == position
        tag = f"{key}.plan{digest}.sub{subgroup.representative}"
        if cross and not represents:
            self.broadcast.expect(tag, digest=digest, representative=members[0], numel=me.numel)
        results: list[ExchangeResult] = []
        handed_bytes = 0
        try:
            partial: Optional[torch.Tensor] = flat_f32(delta)
            if len(members) > 1:
                partial = self._in_site(tag, members, me, delta, timeout_s, on_phase, results, cross, represents)
            if represents:
                results.append(self._across_sites(key, group, plan, digest, tag, members, partial, timeout_s))
                average = results[-1].average
                handed_bytes = self.broadcast.send(
                    tag, digest=digest, members=members[1:], average=average, timeout_s=timeout_s
                )
            elif cross:
                average = self.broadcast.receive(tag, timeout_s=2 * timeout_s)
            else:
                average = partial
        finally:
            self.broadcast.forget(tag)
        links = merged_links(results)
        sent = sum(r.bytes_sent for r in results) + handed_bytes
        to_other_sites = cross_site_bytes(links, group, me)
        return TwoLevelResult(
            average=average,
            bytes_sent=sent,
            bytes_received=sum(r.bytes_received for r in results),
            seconds=time.perf_counter() - started,
            rejected={k: v for r in results for k, v in r.rejected.items()},
            clipped={k: v for r in results for k, v in r.clipped.items()},
            links=links,
            in_site_bytes_sent=sent - to_other_sites,
            cross_site_bytes_sent=to_other_sites,
            representative=represents,
            subgroups=len(plan.subgroups),
            withdrawn=partial is None,
        )

    def _in_site(
        self,
        tag: str,
        members: list[Member],
        me: Member,
        delta: torch.Tensor,
        timeout_s: float,
        on_phase: Optional[Callable[[str], Optional[float]]],
        results: list[ExchangeResult],
        cross: bool,
        represents: bool,
    ) -> Optional[torch.Tensor]:
        """The sub-group's average (its result appended to ``results``). None when the sub-group's exchange failed
        and the other sub-groups go on without it: its representative withdraws it from level 2, and a member whose
        representative answers waits for the level-2 average as usual (one whose representative is gone fails now:
        nobody would hand it one)."""
        try:
            results.append(
                self.in_site.average(key=tag, group=members, me=me, delta=delta, timeout_s=timeout_s, on_phase=on_phase)
            )
            return results[-1].average
        except ExchangeFailed as e:
            if not cross or not (represents or self._answering(members[:1])):
                raise
            logger.warning(
                "%s: this sub-group's exchange failed (%s); it is withdrawn from the cross-site average, "
                "which this peer still takes",
                tag,
                e,
            )
            return None

    def _answering(self, peers: list[Member]) -> set[str]:
        """The peer ids of ``peers`` that answer a ping (a few tries each, each of at most PING_TIMEOUT_S)."""
        answered: set[str] = set()
        for _ in range(PING_TRIES):
            missing = [m for m in peers if m.peer_id not in answered]
            if not missing:
                break
            answered |= set(self.in_site.transport.run(self.in_site.probe.rtt_s(missing), timeout_s=PING_TIMEOUT_S + 5))
        return answered

    def _across_sites(
        self,
        key: str,
        group: list[Member],
        plan: SitePlan,
        digest: str,
        tag: str,
        members: list[Member],
        partial: Optional[torch.Tensor],
        timeout_s: float,
    ) -> ExchangeResult:
        """This representative's sub-group average exchanged with the other representatives (``partial`` None: its
        sub-group failed and is withdrawn, ``swarm.net.exchange.withdrawal``); on failure its sub-group is told at once."""
        self.cross_site.gather_all = self.in_site.gather_all  # a run that admits strangers: no slice owners here either
        try:
            cross_key, reps, me = self._level_two(key, group, plan, digest, members[0])
            try:
                return self.cross_site.average(key=cross_key, group=reps, me=me, delta=partial, timeout_s=timeout_s)
            except ExchangeFailed as e:
                return self._without_the_gone(cross_key, reps, me, partial, timeout_s, e)
        except ExchangeFailed as e:
            self.broadcast.abort(tag, digest=digest, members=members[1:], reason=str(e))
            raise

    def _without_the_gone(
        self,
        cross_key: str,
        reps: list[Member],
        me: Member,
        partial: Optional[torch.Tensor],
        timeout_s: float,
        failure: ExchangeFailed,
    ) -> ExchangeResult:
        """The cross-site exchange once more, among the representatives that answer a ping, when some do not (their
        process is gone, so is their sub-group's average): under its own key, which names them, so representatives
        that disagree on who is gone are never merged. ``failure`` is raised when every representative answers (the
        exchange failed otherwise) or only this one does."""
        answering = self._answering([r for r in reps if r.peer_id != me.peer_id])  # pinged once, not once per member
        live = [r for r in reps if r.peer_id == me.peer_id or r.peer_id in answering]
        if len(live) == len(reps) or len(live) < 2:
            raise failure
        logger.warning(
            "%s: %s; going on with the %d of %d representatives that answer a ping",
            cross_key,
            str(failure).removeprefix(f"{cross_key}: "),
            len(live),
            len(reps),
        )
        return self.cross_site.average(
            key=f"{cross_key}.among{group_digest(live)}", group=live, me=me, delta=partial, timeout_s=timeout_s
        )

    def _level_two(
        self, key: str, group: list[Member], plan: SitePlan, digest: str, representative: Member
    ) -> tuple[str, list[Member], Member]:
        """The cross-site exchange's key, its group (the representatives, each weighted by its sub-group's summed
        capped weights, derived from the signed entries) and ``representative``'s entry in it."""
        weights = subgroup_weights(plan, capped_weights(self.in_site.aggregation, group, key))
        reps = [dataclasses.replace(group[r], weight=w) for r, w in zip(plan.representatives, weights)]
        me = next(r for r in reps if r.peer_id == representative.peer_id)
        return f"{self.run_id}.{CROSS_SITE}.{key[len(self.run_id) + 1 :]}.plan{digest}", reps, me


def flat_f32(delta: torch.Tensor) -> torch.Tensor:
    """``delta`` as the exchange takes it: one fp32 vector (a copy, so the caller's tensor stays its own)."""
    return delta.detach().reshape(-1).to(torch.float32).clone()


def merged_links(results: list[ExchangeResult]) -> LinkTimings:
    """The link timings of this peer's exchanges at both levels, as one exchange's."""
    return LinkTimings(
        uploads=[t for r in results for t in r.links.uploads],
        downloads=[t for r in results for t in r.links.downloads],
        rtt_s={k: v for r in results for k, v in r.links.rtt_s.items()},
    )


def cross_site_bytes(links: LinkTimings, group: list[Member], me: Member) -> int:
    """Bytes this peer's acknowledged sends carried to groupmates at another site (a groupmate without a
    site counts as another site): the traffic two-level averaging keeps off the slow links."""
    site = {m.peer_id: m.site for m in group}
    return sum(t.bytes for t in links.uploads if not (me.site and site.get(t.peer) == me.site))


def bytes_by_site(result: ExchangeResult, group: list[Member], me: Member) -> tuple[int, int]:
    """(in-site, cross-site) bytes sent in an exchange, flat or two-level: for the round's log line."""
    if isinstance(result, TwoLevelResult):
        return result.in_site_bytes_sent, result.cross_site_bytes_sent
    cross = cross_site_bytes(result.links, group, me)
    return result.bytes_sent - cross, cross
