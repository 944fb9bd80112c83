"""SliceInbox on its own (the exchange's tests run it with real peers): what it does with messages for a key
whose exchange already ended here."""

from __future__ import annotations

import asyncio

import pytest

from swarm.net.exchange.exchange_failed import ExchangeFailed
from swarm.net.exchange.slices.inbox import MAX_FAILED_KEYS, SliceInbox
from swarm.v1 import exchange_pb2

pytestmark = pytest.mark.timeout(30)

PREFIX = "run-inbox."
LATE = "QmLateProcess"  # a groupmate's restarted process: a libp2p id the ended exchange never knew


def key(n: int) -> str:
    return f"{PREFIX}round{n}.fragment0"


async def late_slice(inbox: SliceInbox, k: str) -> bool:
    return await inbox.deliver(k, "digest", exchange_pb2.PHASE_CONTRIBUTION, 0, 1, b"bytes", sender_id=LATE)


def inbox() -> SliceInbox:
    return SliceInbox(key_prefix=PREFIX, own_id="QmSelf", on_forget=lambda k: None)


def test_a_key_whose_exchange_failed_refuses_late_slices_with_the_reason_and_one_that_succeeded_only_strangers() -> (
    None
):
    async def scenario() -> None:
        box = inbox()
        for k in (key(1), key(2)):
            await box.expect(k, ["QmSelf", "QmOldProcess"], "digest", 2)
        await box.forget(key(1), failed="cannot reach groupmate b\n\x1b[31m")
        await box.forget(key(2), completed=True)

        assert not await late_slice(box, key(1))
        # only printable characters
        assert box.refusal(key(1), LATE) == (
            f"this peer's exchange of {key(1)} already failed (cannot reach groupmate b  [31m); it cannot complete"
        )
        assert box.rejected == 0  # a late groupmate, not an intruder
        # succeeded here: a member's retried slice is still taken (early, as before), anyone else's refused
        assert await box.deliver(
            key(2), "digest", exchange_pb2.PHASE_CONTRIBUTION, 0, 1, b"bytes", sender_id="QmOldProcess"
        )
        assert not await late_slice(box, key(2))
        assert box.refusal(key(2), LATE) == (
            f"this peer's exchange of {key(2)} is over: it completed in a group"
            " without this sender, so the sender's exchange cannot complete"
        )
        assert box.rejected == 0

    asyncio.run(scenario())


def test_only_the_latest_failed_keys_are_kept_and_a_new_exchange_of_one_takes_slices_again() -> None:
    async def scenario() -> None:
        box = inbox()
        for n in range(MAX_FAILED_KEYS + 1):
            await box.forget(key(n), failed=f"failure {n}")
        assert await late_slice(box, key(0))  # the oldest was dropped: early buffering as for any key
        assert not await late_slice(box, key(MAX_FAILED_KEYS))

        await box.expect(key(MAX_FAILED_KEYS), ["QmSelf", LATE], "digest", 1)  # the key is exchanged anew
        assert await late_slice(box, key(MAX_FAILED_KEYS))
        assert "already failed" not in box.refusal(key(MAX_FAILED_KEYS), LATE)
        await box.forget(key(MAX_FAILED_KEYS), completed=True)  # ... and succeeds: a member's late retry is taken
        assert await late_slice(box, key(MAX_FAILED_KEYS))

    asyncio.run(scenario())


def test_a_member_whose_process_is_gone_fails_the_exchange_only_while_one_of_its_slices_is_missing() -> None:
    """Its restarted process showed up (swarm.net.exchange.restarted_groupmates): slices its old process sent before it died
    still count, and only a wait for one it never sent fails at once."""

    async def scenario() -> None:
        box = inbox()
        k, old = key(7), "QmOldProcess"
        await box.expect(k, ["QmSelf", old], "digest", 2)
        assert await box.deliver(k, "digest", exchange_pb2.PHASE_CONTRIBUTION, 0, 1, b"sent", sender_id=old)
        await box.member_gone(k, old, "groupmate p-b restarted")
        sent = ("digest", exchange_pb2.PHASE_CONTRIBUTION, 0, 1, old)
        assert await box.wait_for(k, [sent], []) == [b"sent"]
        with pytest.raises(ExchangeFailed, match="groupmate p-b restarted"):
            await box.wait_for(k, [("digest", exchange_pb2.PHASE_AVERAGED, 1, 1, old)], [])

    asyncio.run(scenario())
