"""Signed DHT entries without a network: what a reader and a guarded node accept, fuzzed (bounded)."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from testbed.members import make_member

from swarm.core.trust.credential import PeerKey
from swarm.core.trust.signed_entry import verify_signed
from swarm.net.dht_entries import EntryRejected, EntryValidator, sign_entry, verify_entry
from swarm.net.exchange.rendezvous import Member
from swarm.net.votes import Vote

pytestmark = pytest.mark.timeout(60)

RUN_ID = "run-entries"
KEY = "run-entries.round1.fragment0"
COORDINATOR = PeerKey.generate()
MEMBER = make_member(COORDINATOR, RUN_ID, "QmMember")
READER = make_member(COORDINATOR, RUN_ID, "QmReader")
VALIDATOR = EntryValidator(coordinator_public_key=COORDINATOR.public_key, run_id=RUN_ID)
ENTRY = Member(peer_id=MEMBER.peer_id, dht_peer_id="QmMember", index=3, weight=12.0, numel=10, codec="fp32")
EXPIRES = time.time() + 3600.0
SIGNED = sign_entry(MEMBER, KEY, ENTRY, expires_at=EXPIRES)


def _read(value, *, subkey=MEMBER.peer_id, cls=Member, key=KEY, expiration_time=EXPIRES):
    return verify_entry(
        value, key=key, subkey=subkey, cls=cls, member=READER, now=time.time(), expiration_time=expiration_time
    )


def test_a_members_signed_entry_reads_back_exactly() -> None:
    assert _read(SIGNED) == ENTRY
    vote = Vote(peer_id=MEMBER.peer_id, dht_peer_id="QmMember", ok=True, state_hash="abc")
    assert _read(sign_entry(MEMBER, KEY, vote, expires_at=EXPIRES), cls=Vote) == vote


def test_an_entry_held_in_the_dht_longer_or_shorter_than_its_poster_signed_is_a_replay() -> None:
    """The DHT keeps a subkey's value of latest expiration: a member's older entry stored again with a later one
    would displace its newer entry, so the expiration is signed and checked by readers and guarded nodes."""
    for held_until in (EXPIRES + 600.0, EXPIRES - 1.0, EXPIRES + 1e-6):
        with pytest.raises(EntryRejected, match="a replay"):
            _read(SIGNED, expiration_time=held_until)
        assert not VALIDATOR.validate(_record(KEY, MEMBER.peer_id, SIGNED, held_until))
    assert VALIDATOR.validate(_record(KEY, MEMBER.peer_id, SIGNED, EXPIRES))
    unstamped = sign_entry(MEMBER, KEY, ENTRY)  # what no DHT reader takes: it says nothing of its expiration
    with pytest.raises(EntryRejected, match="a replay"):
        _read(unstamped)
    assert not VALIDATOR.validate(_record(KEY, MEMBER.peer_id, unstamped, EXPIRES))


def test_a_reader_outside_the_dht_checks_the_signature_without_an_expiration() -> None:
    """The coordinator checks votes a report carries, as signed, with no DHT record around them."""
    vote = Vote(peer_id=MEMBER.peer_id, dht_peer_id="QmMember", ok=True, state_hash="abc")
    signed = sign_entry(MEMBER, KEY, vote, expires_at=EXPIRES)
    assert (
        verify_signed(
            signed,
            key=KEY,
            subkey=MEMBER.peer_id,
            cls=Vote,
            coordinator_public_key=COORDINATOR.public_key,
            run_id=RUN_ID,
            now=time.time(),
        )
        == vote
    )


def test_a_reader_of_the_previous_version_reads_an_entry_whose_new_fields_are_at_their_defaults() -> None:
    """Fields at their defaults are left out of the signed body, so the matchmaking entry's ``closed`` (a later
    field) does not make an older peer, whose Member has no such field, refuse every entry."""
    import dataclasses

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class OldMember:  # Member as it was before ``closed``
        peer_id: str
        dht_peer_id: str
        index: int
        weight: float
        numel: int
        codec: str
        live_peers: int = 0
        maddrs: str = ""
        site: str = ""
        plan: str = ""
        bulk: str = ""

    assert b"closed" not in SIGNED["body"]
    assert _read(SIGNED, cls=OldMember).index == ENTRY.index
    marked = dataclasses.replace(ENTRY, closed="1,3")
    assert _read(sign_entry(MEMBER, KEY, marked, expires_at=EXPIRES)) == marked


@pytest.mark.parametrize(
    "tamper, reason",
    [
        (lambda v: {**v, "signature": bytes(64)}, "not signed by"),
        (
            lambda v: {**v, "credential": make_member(PeerKey.generate(), RUN_ID, "QmMember").credential},
            "not signed by this run's coordinator",
        ),
        (lambda v: {**v, "credential": make_member(COORDINATOR, "other-run", "QmMember").credential}, "is for run"),
        (
            lambda v: {**v, "credential": make_member(COORDINATOR, RUN_ID, "QmMember", expires_in_s=-5).credential},
            "expired",
        ),
        (lambda v: {**v, "body": v["body"].replace(b"12.0", b"1e30")}, "not signed by"),
        (lambda v: {"body": v["body"]}, "not a signed entry"),
    ],
)
def test_a_tampered_entry_is_rejected_with_its_reason(tamper, reason: str) -> None:
    with pytest.raises(EntryRejected, match=reason):
        _read(tamper(SIGNED))


def test_an_entry_whose_fields_have_the_wrong_type_or_are_not_finite_is_rejected() -> None:
    for weight in ("heavy", float("inf"), float("nan"), True):
        forged = sign_entry(MEMBER, KEY, Member(**{**vars(ENTRY), "weight": weight}), expires_at=EXPIRES)
        with pytest.raises(EntryRejected, match="malformed Member"):
            _read(forged)


values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=values,
    subkey=st.text(max_size=20) | st.integers(-(2**63), 2**63 - 1),
    fields=st.dictionaries(st.sampled_from(["key", "body", "credential", "signature"]), values, max_size=4),
)
def test_no_value_a_stranger_stores_is_believed_or_crashes_a_reader_or_a_node(value, subkey, fields) -> None:
    for candidate in (value, {**SIGNED, **fields} if fields else {}):
        for cls in (Member, Vote):
            with pytest.raises(EntryRejected):
                _read(candidate, subkey=subkey, cls=cls)
        assert VALIDATOR.validate(_record(KEY, subkey, candidate, EXPIRES)) is False


def _record(key: str, subkey, value, expiration_time: float) -> DHTRecord:
    """The record a DHT node validates when it is asked to store ``value`` until ``expiration_time``."""
    return DHTRecord(
        DHTID.generate(source=key).to_bytes(),
        MSGPackSerializer.dumps(subkey),
        MSGPackSerializer.dumps(value),
        expiration_time,
    )
