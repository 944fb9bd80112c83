"""Forming a round's averaging group through the hivemind DHT.

Every peer that finished its inner steps posts one entry (its ids, position and weight) under the
round's key, signed with its key and carrying its credential (``swarm.net.dht_entries``: entries that do
not verify are ignored), then reads the key until every planned participant has posted or the matchmaking
window closes. The group is the posted entries of planned participants, ordered by peer index, so
every member that sees the same entries derives the same group, parts and weights. Members compare
a digest of the group in every message, so a peer that saw a different group is caught, not merged.
An entry's ``site`` is its poster's coordinator-signed site (``swarm.net.dht_entries`` refuses any other),
so two-level averaging (``swarm.net.exchange.two_level``) partitions the group by sites no member chose for itself.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional

from swarm.core.trust import credential
from swarm.core.trust.round_vote import group_key  # noqa: F401  re-exported: peers, scripts and tests import it from here
from swarm.core.trust.signed_entry import MAX_BODY_BYTES, entry_body
from swarm.net.dht_entries import read_entries, store_entry
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.hivemind_api import DHT

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Member:
    peer_id: str  # swarm peer id given by the coordinator
    dht_peer_id: str  # libp2p peer id, where its parts are sent
    index: int  # the peer's index in the run: orders the group
    weight: float  # samples processed this round
    numel: int
    codec: str
    live_peers: int = 0  # the run's live peers as this member last heard from the coordinator (0: unknown)
    maddrs: str = ""  # the addresses its node announces (reachability.shown_maddrs): only shown in messages
    site: str = ""  # its credential's site (a reader refuses an entry whose site is not its credential's)
    plan: str = ""  # digest of the round's controller choice (codec and shares) it applies ("": controller off)
    bulk: str = ""  # host:port of its bulk channel (swarm.net.bulk.bulk_channel; "": none, its slices go over libp2p)
    # Posted again once its matchmaking has closed: the indexes of the group it formed ("0,2,3"), so a planned peer
    # that posts later and is not among them fails at once instead of waiting out the exchange ("": still open).
    closed: str = ""
    # The wire protocol it speaks (swarm.core.wire_protocol.PROTOCOL; 0: posted by a peer from before the field),
    # left out of its entry at 0: members that cut their slices differently cannot average together.
    protocol: int = 0


def group_digest(members: list[Member]) -> str:
    text = "|".join(
        f"{m.peer_id},{m.dht_peer_id},{m.index},{m.weight!r},{m.numel},{m.codec},{m.live_peers}"
        + (f",{m.site!r}" if m.site else "")
        + (f",{m.plan}" if m.plan else "")
        + (f",bulk={m.bulk!r}" if m.bulk else "")
        + (f",protocol={m.protocol}" if m.protocol else "")
        for m in members
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rendezvous(
    dht: DHT,
    *,
    key: str,
    me: Member,
    member: credential.Member,
    planned: Callable[[], Optional[set[str]]],
    window_s: float,
    ttl_s: float,
    poll_s: float = 0.1,
    plan_refresh_s: float = 1.0,
    on_posted: Optional[Callable[[], None]] = None,
    processes: Callable[[], Mapping[str, str]] = dict,
    plan_holds: Callable[[], bool] = lambda: False,
    hold_s: Optional[float] = None,
) -> list[Member]:
    """Post this peer under key and return the group, ordered by peer index.

    planned() returns the planned participants' peer ids, or None when the plan is unknown (the
    coordinator is unreachable): then whoever posted within the window forms the group. ``member`` signs
    this peer's entry and checks the others'. processes() maps planned peers to the libp2p id of their
    current process, as far as the coordinator said (read after each planned()): an entry under another
    id was left by a process that has since been replaced (a peer restarted mid-round, which cannot be
    reached there), and does not count as that peer's.

    plan_holds(): the last planned() answer is the coordinator's plan of the open round. Then the window stays
    open (up to ``hold_s``, default twice ``window_s``; this peer's entry is posted again as its ttl runs down)
    while that plan lists a peer that has not posted, so every member closes on the coordinator's decision (it
    leaves late peers out, evicts dead ones, or voids the round), not each on its own clock (with overlap a peer
    posts as a round opens; one whose budget was cut to a few steps posts long before its groupmates).
    A formed group's members post again with its indexes (``_mark_closed``): a planned peer posting later and not
    among them fails at once with ExchangeFailed instead of waiting out the exchange's timeout.
    """
    store_entry(dht, key, me, member=member, ttl_s=ttl_s)
    if on_posted is not None:
        on_posted()
    posted_at = time.monotonic()
    deadline, longest = posted_at + window_s, posted_at + (2 * window_s if hold_s is None else hold_s)
    expected = planned()
    next_plan_at = time.monotonic() + plan_refresh_s
    while True:
        posted = _posted(dht, key, me, member, processes())
        _check_not_left_behind(key, me, posted, expected)
        if expected is not None and expected <= set(posted):
            break
        if time.monotonic() >= deadline and not (expected is not None and plan_holds() and time.monotonic() < longest):
            planned_count = "?" if expected is None else len(expected)
            logger.info("%s: matchmaking window closed with %d of %s planned peers", key, len(posted), planned_count)
            break
        if time.monotonic() >= next_plan_at:
            expected = planned() or expected
            next_plan_at = time.monotonic() + plan_refresh_s
        if time.monotonic() - posted_at > ttl_s / 3:  # held open for long: keep this peer's entry alive
            store_entry(dht, key, me, member=member, ttl_s=ttl_s, wait=False)
            posted_at = time.monotonic()
        time.sleep(poll_s)  # polling the DHT: there is no change notification to await
    members = _group(posted, expected, me)
    _mark_closed(dht, key, me, members, member=member, ttl_s=ttl_s)
    return members


def _group(posted: Mapping[str, Member], expected: Optional[set[str]], me: Member) -> list[Member]:
    """The group: the posted entries of planned participants (of everyone when the plan is unknown) and this
    peer's own, ordered by peer index."""
    return sorted(
        (m for pid, m in posted.items() if expected is None or pid in expected or pid == me.peer_id),
        key=lambda m: (m.index, m.peer_id),
    )


def _posted(dht: DHT, key: str, me: Member, member: credential.Member, current: Mapping[str, str]) -> dict[str, Member]:
    """The entries under ``key`` by peer id, this peer's own included; an entry under a libp2p id other than the
    one the coordinator gave for its peer's current process (``current``) was left by a replaced process."""
    posted = {
        pid: m
        for pid, m in read_entries(dht, key, Member, member=member).items()
        if current.get(pid, m.dht_peer_id) == m.dht_peer_id
    }
    posted[me.peer_id] = me
    return posted


def _mark_closed(
    dht: DHT, key: str, me: Member, members: list[Member], *, member: credential.Member, ttl_s: float
) -> None:
    """Post this peer's entry again with its formed group's indexes (``Member.closed``), without waiting (a dead DHT
    node must not delay the exchange); a larger group (~150) is not marked, and a late peer then times out."""
    marked = replace(me, closed=",".join(str(m.index) for m in members))
    if len(entry_body(marked)) <= MAX_BODY_BYTES:
        store_entry(dht, key, marked, member=member, ttl_s=ttl_s, wait=False)


def _check_not_left_behind(key: str, me: Member, posted: Mapping[str, Member], expected: Optional[set[str]]) -> None:
    """ExchangeFailed if a planned groupmate has already formed its group without this peer."""
    mine = str(me.index)
    gone = sorted(
        m.peer_id
        for pid, m in posted.items()
        if pid != me.peer_id and m.closed and (expected is None or pid in expected) and mine not in m.closed.split(",")
    )
    if gone:
        raise ExchangeFailed(
            f"{key}: the group averaged without this peer ({', '.join(gone)} closed matchmaking before it posted: "
            "it finished its inner steps after the matchmaking window); it takes the committed state and goes on "
            "with the next round"
        )


def participation_scale(group: list[Member]) -> float:
    """The factor on the group's averaged Δ when the run has live peers outside the group: as if
    each of them had contributed a zero Δ. Every member computes it from the same group entries, so
    all apply the same factor; 1.0 when the group is the whole run (or no member knew the count)."""
    live = max((m.live_peers for m in group), default=0)
    return min(1.0, len(group) / live) if live > 0 else 1.0
