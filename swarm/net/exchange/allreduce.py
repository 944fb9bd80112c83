"""Butterfly all-reduce of pseudo-gradients over hivemind's libp2p transport, bit-identical on every peer.

Not ``hivemind.averaging.DecentralizedAverager.step``: it hands every peer ``local + (average − local)`` with
the delta compressed per peer, so peers end with different bits (docs/ARCHITECTURE.md). Here the flat vector is
cut into one slice per group member (a large vector in stripes, so an owner sends back one stripe's average
while the next stripe's contributions arrive); each owner reduces its slices of everyone's encoded
contribution in the group's canonical order by the run's aggregation rule (``swarm.core.aggregation``),
encodes the average once and sends those same bytes to every member, so every member holds the same average.
A slice that does not arrive in time fails the exchange; a failing member tells the others at once (an abort
message), so a dead groupmate costs one failed send, not everyone's timeout. A member may withdraw instead of
contributing (``swarm.net.exchange.withdrawal``): the others' average, without its weight. A malicious owner can
still replace its own slice of the average (the bound of a butterfly all-reduce): sparse codecs, and every codec of a
run whose ``[rounds] exchange`` is the all-gather (the default of a run that admits strangers), are exchanged by
an all-gather instead (``swarm.net.exchange.sparse_gather``): every member averages all K contributions itself.

A slice counts for group position s only when it came from the libp2p id the signed group entry of s lists
(the id libp2p's secure channel authenticated, never a field of the message); slices and aborts from anyone
else are dropped and counted, so a stranger can neither replace a member's slice nor abort the honest group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional, Sequence

import torch

from swarm.core.aggregation import Aggregation, Reduced
from swarm.core.average import stripe_count
from swarm.core.codecs.codec import get_codec
from swarm.core.codecs.error_feedback import DroppedInPlace
from swarm.core.codecs.owner_feedback import OwnerFeedback
from swarm.core.trust import credential
from swarm.net.bulk.bulk_channel import BulkChannel
from swarm.net.bulk.bulk_slices import BulkSlices
from swarm.net.bulk.chunk_stream import cancel_all
from swarm.net.bulk.libp2p_slices import Libp2pSlices
from swarm.net.bulk.transport import Transport
from swarm.net.exchange.alone import average_alone
from swarm.net.exchange.butterfly import Butterfly, pause
from swarm.net.exchange.exchange_result import ExchangeResult
from swarm.net.exchange.rendezvous import Member, group_digest
from swarm.net.exchange.restarted_groupmates import RestartedGroupmates
from swarm.net.exchange.result_vectors import ResultVectors
from swarm.net.exchange.slices.inbox import SliceInbox
from swarm.net.exchange.slices.reduction import (
    ExchangeFailed,
    capped_weights,
    check_agreement,
    group_bounds,
    judged,
)
from swarm.net.exchange.slices.sending import SliceSending
from swarm.net.exchange.sparse_gather import gather_average
from swarm.net.exchange.withdrawal import present
from swarm.net.link.link_probe import LinkProbe
from swarm.net.link.link_stats import TransferLog
from swarm.net.link.p2p_address import unreachable_sentence
from swarm.net.link.reachability import shown_maddrs
from swarm.v1 import exchange_pb2

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 2.0  # how long a failing member spends telling its groupmates
FORGET_WAIT_S = 5.0  # how long an exchange's end waits for the loop to clear its buffers (a busy loop does it later)


class Exchange(SliceSending):
    def __init__(
        self,
        transport: Transport,
        *,
        run_id: str,
        aggregation: Aggregation = Aggregation(),
        bulk: bool = True,
        send_in_turn: bool = False,
        pace_mbit_s: float = 0.0,
        uplink_mbit_s: float = 0.0,
        gather_all: bool = False,
    ):
        """``bulk``: slices go over the transport's bulk channel to members that announce one
        (``swarm.net.bulk.bulk_channel``), else over libp2p. ``send_in_turn``: each phase sends to one groupmate at
        a time, position p's i-th send to position p + i (so each link carries one flow at a time), instead of
        to all at once. ``pace_mbit_s``: each bulk connection sends at most this fast (0: unpaced); about the
        links' rate / (K − 1) keeps the K − 1 flows into a member from overrunning its downlink's queue.
        ``uplink_mbit_s``: this peer's uplink as its operator declared it (``swarm peer --uplink-mbit``); without
        ``pace_mbit_s`` each bulk connection of a K-member exchange is paced at 0.95 × uplink / (K − 1).
        ``gather_all``: every codec goes by the all-gather (``RoundConfig.all_gathered``), not only sparse ones;
        the run config gives every member the same value."""
        self.transport = transport
        self.gather_all = gather_all  # the owning thread's between exchanges (read by the loop during one)
        self.aggregation = aggregation  # Aggregation.for_run(run): the rule and the weight cap of the run
        self.send_in_turn = send_in_turn
        self.pace_mbit_s = pace_mbit_s  # the owning thread's between exchanges (read by the loop during one)
        self.uplink_mbit_s = uplink_mbit_s
        self.bulk: Optional[BulkChannel] = None  # the transport's, shared with its other exchanges
        self._bulk_slices: Optional[BulkSlices] = None  # this exchange's use of it
        self._use_bulk = bulk
        self._handler_name = f"swarm_{run_id}.part"
        self._libp2p: Optional[Libp2pSlices] = None  # the slices' other path (made on the loop)
        self.probe = LinkProbe(transport.p2p, run_id=run_id)  # answers this run's pings; times groupmates'
        self._key_prefix = f"{run_id}."  # every key of this run's exchanges (rendezvous.group_key)
        self.inbox: Optional[SliceInbox] = None  # made on the loop
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the transport's, where the inbox lives
        self._received_bytes: dict[str, int] = {}
        self._transfers = TransferLog()  # per key, the timed sends and receives
        self.own_maddrs = shown_maddrs(transport.visible_maddrs)  # what groupmates are told to dial
        self._told_unreachable = False  # the loop thread's: the fix is logged once, not every round
        self._results = ResultVectors()  # the butterfly's result vectors (the loop's)
        self.restarts = RestartedGroupmates(transport.dht)  # made ready on the loop (its inbox)
        self._scratch = ResultVectors(keep=0)  # its decoded contributions and reductions (the loop's; sized per group)
        transport.run(self._start(), timeout_s=30)

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.inbox = SliceInbox(key_prefix=self._key_prefix, own_id=self.transport.peer_id, on_forget=self._forgotten)
        self.restarts.inbox = self.inbox
        self.inbox.on_stranger = self.restarts.stranger
        self._libp2p = Libp2pSlices(
            self.transport,
            handler_name=self._handler_name,
            inbox=self.inbox,
            on_sent=self._sent,
            on_received=self._received,
        )
        await self._libp2p.start()
        await self.probe.start()
        if self._use_bulk:
            self.bulk = await self.transport.open_bulk()
            self._bulk_slices = BulkSlices(
                self.transport,
                self.bulk,
                handler_name=self._handler_name,
                inbox=self.inbox,
                on_sent=self._sent,
                on_received=self._received,
            )
            self._libp2p.bulk = self._bulk_slices

    @property
    def rejected_chunks(self) -> int:
        """Messages dropped because their sender is not the member they claim to be."""
        return self.inbox.rejected

    def read_entries_as(self, member: credential.Member) -> None:
        """Check groupmates' round entries with ``member``'s credential (``swarm.net.exchange.restarted_groupmates``)."""
        self.restarts.reader = member

    def _forgotten(self, key: str) -> None:
        self.restarts.forget(key)
        if not self.inbox.busy:  # the decoded slices' pool, at a real model's size, is not held between rounds
            self._scratch.shrink()
        self._received_bytes.pop(key, None)
        self._transfers.forget(key)
        if self.bulk is not None:
            self.bulk.forget(key)

    @property
    def bulk_address(self) -> str:
        """What this peer's group entry announces as ``Member.bulk`` ("": no bulk channel)."""
        return self.bulk.address if self.bulk is not None else ""

    def average(
        self,
        *,
        key: str,
        group: list[Member],
        me: Member,
        delta: Optional[torch.Tensor],
        timeout_s: float,
        on_phase: Optional[Callable[[str], Optional[float]]] = None,
        shares: Optional[Sequence[float]] = None,
        owner: Optional[OwnerFeedback] = None,
        into_delta: bool = False,
    ) -> ExchangeResult:
        """Average delta with the group; raises ExchangeFailed unless every slice arrived intact.

        ``shares`` (one per group position; None: equal) size each member's slice of the reduction (the
        controller's choice); the group's members must pass the same ones, which their entries' ``plan``
        digest vouches for.

        on_phase("sending") and on_phase("reducing") are called as the exchange passes those points
        (fault injection uses them); a number they return is a delay the exchange awaits there. ``owner``:
        this peer's residual as its slice's owner (``swarm.core.codecs.owner_feedback``; ``average.owner_encode``).
        ``into_delta``: the caller reads ``delta`` no more, so with a lossless codec (or a lossy one whose residual goes
        to a file, ``DroppedInPlace.spills``) the average is written into its memory (each slice once it is sent: no
        model-sized result beside it); a group of one averages alone.
        ``delta`` None: this member withdraws, the average is the other members' (``swarm.net.exchange.withdrawal``).
        """
        on_phase = on_phase or (lambda phase: None)
        failed, completed = "", False
        try:
            result = self.transport.run(
                self._average_or_abort(key, group, me, delta, on_phase, timeout_s, shares, owner, into_delta),
                timeout_s=timeout_s + ABORT_TIMEOUT_S + 5,
            )
            completed = True
            return result
        except (asyncio.TimeoutError, TimeoutError):
            failed = f"the group did not complete the exchange within {timeout_s:.0f}s"
            raise ExchangeFailed(f"{key}: {failed}") from None
        except ExchangeFailed as e:  # the group's failure (an abort went out or came in); not an internal error's
            failed = str(e).removeprefix(f"{key}: ")
            raise
        finally:
            self._forget(key, failed=failed, completed=completed)

    def _forget(self, key: str, *, failed: str, completed: bool) -> None:
        """The inbox forgets ``key``'s exchange, on the loop. A loop that a saturated machine keeps from getting to
        it within FORGET_WAIT_S does it when it gets there (before anything asked of it later), and the exchange
        ends with its own outcome, its result or its ExchangeFailed, not with a timeout of this bookkeeping."""
        forgotten = asyncio.run_coroutine_threadsafe(
            self.inbox.forget(key, failed=failed, completed=completed), self._loop
        )
        try:
            forgotten.result(timeout=FORGET_WAIT_S)
        except TimeoutError:
            logger.warning(
                "%s: this peer's transport loop was busy for %.0fs; it clears the exchange's buffers when it"
                " gets to it",
                key,
                FORGET_WAIT_S,
            )

    async def _average_or_abort(
        self,
        key: str,
        group: list[Member],
        me: Member,
        delta: torch.Tensor,
        on_phase: Callable[[str], Optional[float]],
        timeout_s: float,
        shares: Optional[Sequence[float]] = None,
        owner: Optional[OwnerFeedback] = None,
        into_delta: bool = False,
    ) -> ExchangeResult:
        """_average within timeout_s; on failure tell every groupmate at once (PHASE_ABORT), so they fail
        now instead of waiting out their own timeout for slices that will never come."""
        try:
            return await asyncio.wait_for(
                self._average(key, group, me, delta, on_phase, shares, owner, into_delta), timeout_s
            )
        except (ExchangeFailed, asyncio.TimeoutError, TimeoutError) as e:
            if not isinstance(e, ExchangeFailed) or not e.from_groupmate:
                reason = str(e) if isinstance(e, ExchangeFailed) else f"no complete exchange within {timeout_s:.0f}s"
                await self._abort(key, group, me, reason)
            if isinstance(e, ExchangeFailed) and e.unreachable and not self._received_bytes.get(key):
                raise ExchangeFailed(f"{e}; and no groupmate reached this peer: {self._unreachable_self(key)}") from e
            raise

    def _unreachable_self(self, key: str) -> str:
        """This peer could dial no groupmate and none reached it: most likely its own address is wrong."""
        sentence = unreachable_sentence(self.own_maddrs.split())
        if not self._told_unreachable:
            self._told_unreachable = True
            logger.warning("%s: %s", key, sentence)
        return sentence

    async def _abort(self, key: str, group: list[Member], me: Member, reason: str) -> None:
        position = [m.peer_id for m in group].index(me.peer_id)
        digest = group_digest(group)

        async def tell(member: Member) -> None:
            try:
                await self._send(member, key, digest, exchange_pb2.PHASE_ABORT, 0, position, reason.encode()[:1000])
            except ExchangeFailed as e:  # best effort: a groupmate that misses it waits out its own timeout
                logger.debug("%s: could not tell %s about the abort (%s)", key, member.peer_id, e)

        others = [m for m in group if m.peer_id != me.peer_id]
        try:
            await asyncio.wait_for(asyncio.gather(*(tell(m) for m in others)), ABORT_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass

    async def _average(
        self,
        key: str,
        group: list[Member],
        me: Member,
        delta: torch.Tensor,
        on_phase: Callable[[str], None],
        shares: Optional[Sequence[float]] = None,
        owner: Optional[OwnerFeedback] = None,
        into_delta: bool = False,
    ) -> ExchangeResult:
        started = time.perf_counter()
        codec = get_codec(me.codec)
        check_agreement(key, group, me)
        weights = capped_weights(self.aggregation, group, key)
        gathered = codec.gathered or self.gather_all
        stripes = stripe_count(codec, me.numel, len(group))  # block-aligned slices: quantize like the whole
        bounds = [] if gathered else group_bounds(key, me.numel, len(group), codec.block, shares, stripes)
        flat = None if delta is None else delta.detach().reshape(-1).to(torch.float32).contiguous()
        # a lossy codec's Δ becomes error feedback's residual, unless that goes to a file as each slice is encoded
        into_delta = into_delta and flat is not None and (codec.lossless or DroppedInPlace.spills(flat, codec))
        if len(group) == 1:  # nobody to send to: the exchange's arithmetic alone
            return await self._alone(key, group, flat, codec, weights, on_phase, gathered, owner, into_delta, started)
        self.restarts.averaging(key, group)
        await self.inbox.expect(key, [m.dht_peer_id for m in group], group_digest(group), max(1, len(bounds)))
        position, digest = [m.peer_id for m in group].index(me.peer_id), group_digest(group)
        # all-gather (its one part): every member reduces the whole vector (swarm.net.exchange.sparse_gather)
        if gathered:
            reduced, sent = await gather_average(
                self, key, group, me, flat, codec, weights, lambda phase: pause(on_phase(phase)), into_delta=into_delta
            )
            return self._result(key, group, position, reduced.average, sent, [reduced], started)
        reserved = (
            {}
            if self._bulk_slices is None
            else self._bulk_slices.reserve_butterfly(key, group, digest, position, bounds, codec)  # claimed now
        )
        try:
            return await Butterfly(
                self,
                key,
                group,
                position,
                digest,
                bounds,
                reserved,
                flat,
                codec,
                weights,
                on_phase,
                owner,
                started,
                into_delta,
            ).run()
        finally:
            await cancel_all([r.answer for r in reserved.values() if not r.answer.done()])

    async def _alone(
        self,
        key: str,
        group: list[Member],
        flat: Optional[torch.Tensor],
        codec,
        weights: list[float],
        on_phase: Callable[[str], Optional[float]],
        gathered: bool,
        owner: Optional[OwnerFeedback],
        into_delta: bool,
        started: float,
    ) -> ExchangeResult:
        """A group of one: its average computed as the exchange would (``swarm.net.exchange.alone``); nothing sent."""
        present(key, [flat])  # a withdrawal alone: nothing to average
        for phase in ("sending", "reducing"):
            await pause(on_phase(phase))
        average, reduced = await asyncio.to_thread(
            average_alone,
            self.aggregation,
            codec,
            flat,
            weights,
            key,
            gathered=gathered,
            owner=owner,
            into_delta=into_delta,
        )
        return self._result(key, group, 0, average, 0, [reduced], started)

    def _result(
        self,
        key: str,
        group: list[Member],
        position: int,
        average: torch.Tensor,
        sent: int,
        reductions: list[Reduced],
        started: float,
        phases_s: Optional[dict[str, float]] = None,
    ) -> ExchangeResult:
        """The exchange's result, with what this peer's reductions did to whom and what its links measured (and
        a ping of each groupmate, on links now idle, for the next exchange's RTT)."""
        rejected, clipped = judged(key, group, *reductions)
        rtt_s = self.probe.ping_for_next(group[:position] + group[position + 1 :])
        return ExchangeResult(
            average=average,
            bytes_sent=sent,
            bytes_received=self._received_bytes.get(key, 0),
            seconds=time.perf_counter() - started,
            rejected=rejected,
            clipped=clipped,
            links=self._transfers.timings(key, rtt_s=rtt_s, group=group),
            phases_s={name: round(seconds, 4) for name, seconds in (phases_s or {}).items()},
        )
