"""Where an exchange's slices wait until the exchange takes them, and who may put them there.

A slice counts for group position s only when it came from the libp2p id the (signed) group entry of s
lists: the sender's id is the one libp2p's secure channel authenticated, never a field of the message.
Before this peer knows a key's group, a few slices per sender wait for it (a member sends each peer at most
two messages per stripe and an abort per key); once the group is known, slices and aborts from anyone else
are dropped and counted, and so are a member's messages for a phase or a part its exchange does not have (each
one would otherwise take memory until the exchange ends). Once this peer's exchange of a key has failed, messages
for that key are refused with the reason: their sender (e.g. a groupmate's restarted process, which the abort did
not reach) then fails at once instead of waiting out its timeout for slices this peer will never send. So are a
completed exchange's messages from anyone outside its group (e.g. a restarted process that a restarted coordinator,
not yet told how far the group got while it was away, sent into a round the group had already decided), while a
member's retried slice is still taken and acknowledged. A message for a key being averaged from a libp2p id outside
its group is reported (``on_stranger``): the exchange checks whether it is a member's restarted process, whose old
process's slices will then never come (``member_gone`` fails the exchange at once).
Owned by the transport's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Callable, Optional

from swarm.core.average import MAX_STRIPES
from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.rendezvous import Member
from swarm.v1 import exchange_pb2

logger = logging.getLogger("swarm.net.exchange.allreduce")  # the exchange's log, where these lines always were

MAX_OPEN_KEYS = 4  # rounds whose early parts are buffered; older ones are dropped
MAX_FAILED_KEYS = 8  # keys whose exchange failed here, remembered to refuse their late messages
MAX_COMPLETED_KEYS = 8  # keys whose exchange completed here, with their members, to refuse anyone else's
MAX_EARLY_SLOTS_PER_SENDER = 2 * MAX_STRIPES + 4  # buffered per sender and key before the group is known (a member
# sends 2 per stripe and an abort)
Slot = tuple[str, int, int, int, str]  # (group digest, phase, part, sender position, sender's libp2p id)
EXCHANGED_PHASES = (exchange_pb2.PHASE_CONTRIBUTION, exchange_pb2.PHASE_AVERAGED)  # with parts; an abort has none


class SliceInbox:
    def __init__(self, *, key_prefix: str, own_id: str, on_forget: Callable[[str], None]) -> None:
        """``key_prefix``: every key of this run's exchanges; ``own_id``: this peer's libp2p id (its own
        slices'); ``on_forget(key)``: called (under ``cond``) when a key's slices are dropped."""
        self.key_prefix, self.own_id, self.on_forget = key_prefix, own_id, on_forget
        self._slots: dict[str, dict[Slot, bytes | memoryview]] = {}
        self._groups: dict[str, list[str]] = {}  # key -> the libp2p id of each position, while it is averaged
        self._digests: dict[str, str] = {}  # key -> the digest of the group this peer averages it in
        self._disagreed: dict[str, str] = {}  # key -> a member whose message names another group (libp2p id)
        self._parts: dict[str, int] = {}  # key -> how many parts its exchange has
        # key -> why this peer's exchange of it failed; never a key being averaged (expect takes it out)
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._completed: OrderedDict[str, frozenset[str]] = OrderedDict()  # key -> its members' libp2p ids; likewise
        self._gone: dict[str, tuple[str, str]] = {}  # key -> (libp2p id, why) of a member whose slices will never come
        self.rejected = 0  # messages dropped because their sender is not the member they claim to be
        # called (under ``cond``) with a key being averaged and the libp2p id of a sender outside its group
        self.on_stranger: Callable[[str, str], None] = lambda key, sender_id: None
        self.cond = asyncio.Condition()  # made on the loop (an Exchange's start)

    async def deliver(
        self,
        key: str,
        digest: str,
        phase: int,
        part: int,
        sender: int,
        payload: bytes | memoryview,
        *,
        sender_id: Optional[str] = None,
    ) -> bool:
        """Buffer a slice from ``sender_id`` (this peer's own when None); False when it was dropped: this
        key's group is known and ``sender_id`` is not the libp2p id of position ``sender`` in it, or the
        group is not known yet and the slice cannot be an early one of this run's members."""
        sender_id = sender_id or self.own_id
        slot = (digest, phase, part, sender, sender_id)
        async with self.cond:
            if not self.admitted(key, slot):
                self.reject(key, sender_id, sender, slot)
                return False
            self._slots[key][slot] = payload
            self.cond.notify_all()
            return True

    def admitted(self, key: str, slot: Slot) -> bool:
        """Whether ``slot``'s sender is that position's member of ``key``'s group (or, while the group is not
        known, may be: ``_may_buffer_early``); under ``cond``."""
        if key in self._groups:
            return self._belongs(key, slot)
        return self._may_buffer_early(key, slot)

    def _belongs(self, key: str, slot: Slot) -> bool:
        """Whether ``slot`` comes from its position's member of ``key``'s known group and is a message of its
        exchange."""
        return self._fits(key, slot) and self._in_range(key, slot)

    def _fits(self, key: str, slot: Slot) -> bool:
        """Whether ``slot`` names this peer's group of ``key`` and its sender is that position's member."""
        ids, sender, sender_id = self._groups[key], slot[3], slot[4]
        return slot[0] == self._digests[key] and 0 <= sender < len(ids) and ids[sender] == sender_id

    def _in_range(self, key: str, slot: Slot) -> bool:
        """Whether ``slot`` is one of the messages ``key``'s exchange has: a contribution or an averaged slice of one
        of its parts, or an abort (part 0)."""
        phase, part = slot[1], slot[2]
        if phase == exchange_pb2.PHASE_ABORT:
            return part == 0
        return phase in EXCHANGED_PHASES and 0 <= part < self._parts.get(key, 0)

    def _may_buffer_early(self, key: str, slot: Slot) -> bool:
        """Whether a slice that came before this peer knows the key's group may wait for it (opening a
        buffer for the key if needed). A member sends each peer at most two messages per stripe and key (its
        contribution, its averaged slice) and an abort, so a sender with more is not an honest member; the
        buffers of keys being averaged are never evicted for a new key."""
        if not key.startswith(self.key_prefix) or key in self._failed or self._completed_without(key, slot[4]):
            return False
        if key in self._slots:
            inbox = self._slots[key]
            return slot in inbox or sum(s[4] == slot[4] for s in inbox) < MAX_EARLY_SLOTS_PER_SENDER
        return self._open(key, force=False)

    def _open(self, key: str, *, force: bool) -> bool:
        """Open a buffer for ``key``, evicting the oldest buffers of keys not being averaged to stay within
        MAX_OPEN_KEYS; False (unless ``force``) when only keys being averaged are open."""
        idle = [k for k in self._slots if k not in self._groups]
        excess = len(self._slots) + 1 - MAX_OPEN_KEYS
        if excess > len(idle) and not force:
            return False
        for stale in idle[: max(0, excess)]:
            self._slots.pop(stale)
            self.on_forget(stale)
        self._slots[key] = {}
        return True

    async def expect(self, key: str, ids: list[str], digest: str, parts: int) -> None:
        """From now on accept slices for ``key`` only from the group's members (``ids``: the libp2p id of
        each position), each for its own position, naming this group (``digest``) and one of the exchange's
        ``parts``; drop what strangers sent before this peer knew the group. A member whose message names another
        group (its matchmaking saw other entries) fails the exchange at once (``wait_for``): it will never send this
        group's slices."""
        async with self.cond:
            self._failed.pop(key, None)
            self._completed.pop(key, None)
            self._gone.pop(key, None)
            self._groups[key], self._digests[key], self._parts[key] = ids, digest, parts
            if key not in self._slots:
                self._open(key, force=True)
            inbox = self._slots[key]
            for slot in [s for s in inbox if not self._belongs(key, s)]:
                inbox.pop(slot)
                self.reject(key, slot[4], slot[3], slot)
        if key in self._disagreed:  # a groupmate's early message already named another group: do not send
            raise self._disagreement(key, [])

    def refusal(self, key: str, sender_id: str, slot: Optional[Slot] = None) -> str:
        """The sentence a dropped message's sender gets back (its ack's error)."""
        if key in self._failed:
            return f"this peer's exchange of {key} already failed ({self._failed[key]}); it cannot complete"
        if self._completed_without(key, sender_id):
            return (
                f"this peer's exchange of {key} is over: it completed in a group without this sender, so the"
                " sender's exchange cannot complete"
            )
        if slot is not None and self._out_of_range(key, slot):
            return (
                f"this exchange has no phase {slot[1]} part {slot[2]} (it has {self._parts.get(key, 0)} parts);"
                " the sender's exchange is cut otherwise, e.g. another Swarm version's"
            )
        if sender_id in self._groups.get(key, ()):
            return "this peer averages this round in another group (its matchmaking saw other entries)"
        return "this slice's sender is not that member of the group"

    def _out_of_range(self, key: str, slot: Slot) -> bool:
        """A message from the right member of this group for a phase or part its exchange does not have."""
        return key in self._groups and self._fits(key, slot) and not self._in_range(key, slot)

    def reject(self, key: str, sender_id: str, sender: int, slot: Optional[Slot] = None) -> None:
        """Count a dropped message (under ``cond``); from a member of ``key``'s group, for another group, it means
        that member averages in another group."""
        if key in self._failed or self._completed_without(key, sender_id):
            return  # a late message for an exchange that ended here: refused with the reason, not an intruder's
        out_of_range = slot is not None and self._out_of_range(key, slot)
        if not out_of_range and sender_id in self._groups.get(key, ()) and sender_id != self.own_id:
            self._disagreed.setdefault(key, sender_id)
            self.cond.notify_all()
            return
        if key in self._groups and sender_id not in self._groups[key]:
            self.on_stranger(key, sender_id)
        self.rejected += 1
        if self.rejected & (self.rejected - 1) == 0:  # the 1st, 2nd, 4th, 8th...: never a flood
            why = (
                f"phase {slot[1]} part {slot[2]}, which this exchange does not have"
                if out_of_range
                else "not that member's libp2p id, or more than a member sends"
            )
            logger.warning(
                "%s: dropped a message from %s claiming group position %d: %s (%d dropped so far)",
                key,
                sender_id,
                sender,
                why,
                self.rejected,
            )

    async def wait_for(self, key: str, wanted: list[Slot], group: list[Member]) -> list[bytes | memoryview]:
        """The wanted slices once all are here; ExchangeFailed as soon as a groupmate aborts (only a member
        can: ``expect`` dropped every other sender's messages)."""
        digest = wanted[0][0]

        def aborted() -> Optional[tuple[int, bytes]]:
            for (d, phase, _, sender, sender_id), data in self._slots.get(key, {}).items():
                if phase == exchange_pb2.PHASE_ABORT and d == digest and group[sender].dht_peer_id == sender_id:
                    return sender, data
            return None

        async with self.cond:

            def never_coming() -> bool:  # a wanted slice from a member whose process is gone, not here
                gone = self._gone.get(key)
                return gone is not None and any(w[4] == gone[0] and w not in self._slots.get(key, {}) for w in wanted)

            await self.cond.wait_for(
                lambda: (
                    aborted()
                    or key in self._disagreed
                    or never_coming()
                    or all(w in self._slots.get(key, {}) for w in wanted)
                )
            )
            if key in self._disagreed:
                raise self._disagreement(key, group)
            if never_coming():
                raise ExchangeFailed(f"{key}: {self._gone[key][1]}")
            abort = aborted()
            if abort is not None:
                sender, why = abort
                who = group[sender].peer_id
                raise ExchangeFailed(
                    f"{key}: groupmate {who} gave up ({why.decode(errors='replace')})", from_groupmate=True
                )
            return [self._slots[key][w] for w in wanted]

    def let_go(self, key: str, slot: Slot) -> None:
        """The exchange has read ``slot``'s slice: its buffer goes now rather than at ``forget`` (a model's slices
        would otherwise all be held to the end of the exchange)."""
        self._slots.get(key, {}).pop(slot, None)

    def _disagreement(self, key: str, group: list[Member]) -> ExchangeFailed:
        """The error for a groupmate whose message named another group (its peer id when ``group`` has it)."""
        who = next((m.peer_id for m in group if m.dht_peer_id == self._disagreed[key]), self._disagreed[key])
        return ExchangeFailed(
            f"{key}: groupmate {who} averages in another group (its matchmaking window closed on "
            "other entries, e.g. a late peer's); this round's exchange cannot complete"
        )

    async def member_gone(self, key: str, sender_id: str, why: str) -> None:
        """The member of ``key``'s exchange in progress at libp2p id ``sender_id`` will never send again (``why``): the
        exchange fails if it still waits for a slice of that member's."""
        async with self.cond:
            if key in self._groups:
                self._gone.setdefault(key, (sender_id, why))
                self.cond.notify_all()

    def _completed_without(self, key: str, sender_id: str) -> bool:
        """Whether ``key``'s exchange completed here in a group ``sender_id`` was not in."""
        return key in self._completed and sender_id not in self._completed[key]

    async def forget(self, key: str, *, failed: str = "", completed: bool = False) -> None:
        """``key``'s exchange is over: its slices go, and what others keep for it (``on_forget``); ``failed``: why
        it failed here (its late messages are then refused with that reason); ``completed``: it completed here (its
        members' late messages are still taken, anyone else's refused)."""
        async with self.cond:
            if failed:  # told to whoever sends for the key later: printable characters, bounded
                _remember(
                    self._failed, key, "".join(c if c.isprintable() else " " for c in failed[:300]), MAX_FAILED_KEYS
                )
            elif completed and key in self._groups:
                _remember(self._completed, key, frozenset(self._groups[key]), MAX_COMPLETED_KEYS)
            self._slots.pop(key, None)
            self._groups.pop(key, None)
            self._digests.pop(key, None)
            self._disagreed.pop(key, None)
            self._gone.pop(key, None)
            self._parts.pop(key, None)
            self.on_forget(key)

    def averaging(self, key: str) -> bool:
        """Whether ``key``'s exchange is in progress here."""
        return key in self._groups

    @property
    def busy(self) -> bool:
        """Whether any exchange is in progress here."""
        return bool(self._groups)

    def group_size(self, key: str) -> int:
        """The members of ``key``'s exchange in progress here (0: none)."""
        return len(self._groups.get(key, ()))


def _remember(ended: OrderedDict, key: str, value, limit: int) -> None:
    """``ended[key] = value``, keeping only the ``limit`` latest keys."""
    ended[key] = value
    while len(ended) > limit:
        ended.popitem(last=False)
