"""A groupmate's restarted process, told apart from a stranger, so that its old process is not waited for.

A peer killed as a round's exchange begins leaves its groupmates waiting for slices its old process will never send,
until their exchange timeout (a chaos soak: 8 s of three peers). Its restarted process, meanwhile, posts its signed
entry for the same round and sends its own slices, which the groupmates refuse: they do not come from the libp2p id
the group lists for that member (``swarm.net.exchange.slices.inbox``). Such a refused sender is looked up in the round's
signed group entries; when a groupmate's entry now names it, that groupmate's old process is gone and the exchange
fails at once (``SliceInbox.member_gone``). Only the holder of that member's key can post such an entry, and a
member could abort the group anyway; a stranger can make a peer read the DHT at most once a second per sender
libp2p id, one look-up at a time, and four times per member of the group in all. The exchange fails only while it
still waits for a slice of that member's old process.
Owned by the transport's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional

from swarm.core.trust import credential
from swarm.net.dht_entries import read_entries
from swarm.net.exchange.rendezvous import Member
from swarm.net.exchange.slices.inbox import SliceInbox

logger = logging.getLogger("swarm.net.exchange.allreduce")

RECHECK_S = 1.0  # a refused sender is looked up again after this (its entry may reach the DHT after its message)
CHECKS_PER_MEMBER = 4  # look-ups per exchange, per member of its group


class RestartedGroupmates:
    def __init__(self, dht) -> None:
        self.dht = dht
        self.inbox: Optional[SliceInbox] = None  # the exchange's, once made on the loop
        self.reader: Optional[credential.Member] = None  # whose credential verifies the entries (None: no look-ups)
        self._groups: dict[str, list[Member]] = {}  # key -> the group of its exchange in progress
        self._checks: dict[str, list[tuple[str, float]]] = {}  # key -> (sender, when) of each look-up
        self._looking: set[str] = set()  # keys with a look-up in flight (one at a time: it takes a worker thread)

    def averaging(self, key: str, group: list[Member]) -> None:
        self._groups[key] = group

    def forget(self, key: str) -> None:
        self._groups.pop(key, None)
        self._checks.pop(key, None)
        self._looking.discard(key)

    def stranger(self, key: str, sender_id: str) -> None:
        """A message for ``key``'s exchange in progress from ``sender_id``, outside its group: look it up (bounded)."""
        group, checks = self._groups.get(key), self._checks.setdefault(key, [])
        now = time.monotonic()
        if (
            self.reader is None
            or self.inbox is None
            or group is None
            or key in self._looking
            or len(checks) >= CHECKS_PER_MEMBER * len(group)
            or any(sender == sender_id and now - at < RECHECK_S for sender, at in checks)
        ):
            return
        checks.append((sender_id, now))
        self._looking.add(key)
        asyncio.ensure_future(self._replaced(key, sender_id, group))

    async def _replaced(self, key: str, sender_id: str, group: list[Member]) -> None:
        """Fail ``key``'s exchange if a groupmate's signed entry for it now names ``sender_id``."""
        try:
            entries = await asyncio.to_thread(read_entries, self.dht, key, Member, member=self.reader)
        except Exception as e:  # a DHT that does not answer: the exchange's own timeout still bounds the wait
            logger.debug("%s: could not read the group entries (%r)", key, e)
            return
        finally:
            self._looking.discard(key)
        for m in group:
            entry = entries.get(m.peer_id)
            if entry is not None and entry.dht_peer_id == sender_id != m.dht_peer_id:
                await self.inbox.member_gone(
                    key,
                    m.dht_peer_id,
                    f"groupmate {m.peer_id} restarted: its new process "
                    "sent this round's slices, so its old process's will "
                    "never come",
                )
                return
