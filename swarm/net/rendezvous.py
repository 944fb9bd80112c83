"""Forming a round's averaging group through the hivemind DHT.

Every peer that finished its inner steps posts one entry (its ids, position and weight) under the
round's key, signed with its key and carrying its credential (``swarm.net.dht_entries``: entries that do
not verify are ignored), then reads the key until every planned participant has posted or the matchmaking
window closes. The group is the posted entries of planned participants, ordered by peer index, so
every member that sees the same entries derives the same group, parts and weights. Members compare
a digest of the group in every message, so a peer that saw a different group is caught, not merged.
An entry's ``site`` is its poster's coordinator-signed site (``swarm.net.dht_entries`` refuses any other),
so two-level averaging (``swarm.net.two_level``) partitions the group by sites no member chose for itself.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import hivemind

from swarm.core import credential
from swarm.core.round_vote import group_key
from swarm.net.dht_entries import read_entries, store_entry

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
    bulk: str = ""  # host:port of its bulk channel (swarm.net.bulk_channel; "": none, its slices go over libp2p)


def group_digest(members: list[Member]) -> str:
    text = "|".join(f"{m.peer_id},{m.dht_peer_id},{m.index},{m.weight!r},{m.numel},{m.codec},{m.live_peers}"
                    + (f",{m.site!r}" if m.site else "") + (f",{m.plan}" if m.plan else "")
                    + (f",bulk={m.bulk!r}" if m.bulk else "") for m in members)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rendezvous(
    dht: hivemind.DHT,
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
) -> list[Member]:
    """Post this peer under key and return the group, ordered by peer index.

    planned() returns the planned participants' peer ids, or None when the plan is unknown (the
    coordinator is unreachable): then whoever posted within the window forms the group. ``member`` signs
    this peer's entry and checks the others'. processes() maps planned peers to the libp2p id of their
    current process, as far as the coordinator said (read after each planned()): an entry under another
    id was left by a process that has since been replaced (a peer restarted mid-round, which cannot be
    reached there), and does not count as that peer's.
    """
    store_entry(dht, key, me, member=member, ttl_s=ttl_s)
    if on_posted is not None:
        on_posted()
    deadline = time.monotonic() + window_s
    expected = planned()
    next_plan_at = time.monotonic() + plan_refresh_s
    while True:
        current = processes()
        posted = {pid: m for pid, m in read_entries(dht, key, Member, member=member).items()
                  if current.get(pid, m.dht_peer_id) == m.dht_peer_id}
        posted[me.peer_id] = me
        if expected is not None and expected <= set(posted):
            break
        if time.monotonic() >= deadline:
            logger.info("%s: matchmaking window closed with %d of %s planned peers", key, len(posted),
                        "?" if expected is None else len(expected))
            break
        if time.monotonic() >= next_plan_at:
            expected = planned() or expected
            next_plan_at = time.monotonic() + plan_refresh_s
        time.sleep(poll_s)  # polling the DHT: there is no change notification to await
    members = [m for pid, m in posted.items() if expected is None or pid in expected or pid == me.peer_id]
    return sorted(members, key=lambda m: (m.index, m.peer_id))


def participation_scale(group: list[Member]) -> float:
    """The factor on the group's averaged Δ when the run has live peers outside the group: as if
    each of them had contributed a zero Δ. Every member computes it from the same group entries, so
    all apply the same factor; 1.0 when the group is the whole run (or no member knew the count)."""
    live = max((m.live_peers for m in group), default=0)
    return min(1.0, len(group) / live) if live > 0 else 1.0

