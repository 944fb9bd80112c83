"""Signed entries posted under one DHT key, one subkey per peer (group members, votes).

Any DHT node can store any value under any key and subkey, so an entry is believed only for what its
signature proves (``swarm.core.trust.signed_entry``: the body, the poster's credential, its signature of the key
and the body, which holds the entry's DHT expiration). A reader keeps an entry only when the credential is the
run's coordinator's and current, and names the same peer as the subkey and the entry, and the same libp2p id
(and site, where the entry has one) as the entry, and the DHT holds it until the expiration its poster signed.
The DHT keeps, per subkey, the value of latest expiration, and a member's expirations only grow (one ttl, later
posts): so the newest entry a member posted is the one read, and an older one stored again by anyone (with its
signed expiration, or refused) cannot take its place.
A node guarded by ``guard`` (an ``EntryValidator``) applies the same checks before it stores a record or
takes one from another node, so a forged entry cannot displace a member's entry on it either.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, TypeVar

from swarm.core.trust.credential import Member
from swarm.core.trust.signed_entry import EntryRejected, sign_entry, signed_fields, verify_signed
from swarm.net.hivemind_api import DHT, DHTID, DHTRecord, MSGPackSerializer, RecordValidatorBase, get_dht_time

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = [
    "EntryRejected",
    "EntryValidator",
    "guard",
    "read_entries",
    "read_signed_entries",
    "sign_entry",
    "store_entry",
    "validator_for",
    "verify_entry",
    "verify_signed",
]
_LOGGED_MAX = 1024  # rejections remembered so each (key, subkey, reason) is logged once
_logged: collections.OrderedDict[tuple[str, str, str], None] = collections.OrderedDict()


def store_entry(dht: DHT, key: str, entry: Any, *, member: Member, ttl_s: float, wait: bool = True) -> None:
    """Post ``entry`` (a dataclass whose ``peer_id`` is the member's) under ``key``, signed (``wait=False``: in
    the DHT's own process, without waiting for it)."""
    assert entry.peer_id == member.peer_id, "a member posts only its own entries"
    expires_at = get_dht_time() + ttl_s
    dht.store(
        key,
        subkey=member.peer_id,
        value=sign_entry(member, key, entry, expires_at=expires_at),
        expiration_time=expires_at,
        return_future=not wait,
    )


def verify_entry(
    value: Any, *, key: str, subkey: Any, cls: type[T], member: Member, now: float, expiration_time: float
) -> T:
    """The entry in a DHT value held until ``expiration_time``, if it checks out; EntryRejected with the reason
    otherwise."""
    return verify_signed(
        value,
        key=key,
        subkey=subkey,
        cls=cls,
        coordinator_public_key=member.coordinator_public_key,
        run_id=member.run_id,
        now=now,
        expiration_time=expiration_time,
    )


class EntryValidator(RecordValidatorBase):
    """Makes a DHT node refuse to store, or to take from another node, any record that is not a member's
    signed entry for that very key and expiration (``hivemind.DHT.add_validators``): a forged or replayed
    entry then cannot even displace a member's entry under its subkey. The DHT of a run holds nothing else. Runs inside the
    DHT's process, so it holds only the run's id and the coordinator's public key."""

    def __init__(self, *, coordinator_public_key: bytes, run_id: str) -> None:
        self.coordinator_public_key, self.run_id = bytes(coordinator_public_key), run_id

    def validate(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
            value = MSGPackSerializer.loads(record.value)
            key = value.get("key") if isinstance(value, dict) else None
            if not isinstance(key, str) or DHTID.generate(source=key).to_bytes() != record.key:
                return False
            signed_fields(
                value,
                key=key,
                subkey=subkey,
                coordinator_public_key=self.coordinator_public_key,
                run_id=self.run_id,
                now=time.time(),
                expiration_time=record.expiration_time,
            )
        except Exception:  # noqa: BLE001 - whatever a stranger sent, the answer is "not stored"
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # one per run: a second identical validator (a group rebuilt on the same DHT) is absorbed
        return isinstance(other, EntryValidator) and (other.coordinator_public_key, other.run_id) == (
            self.coordinator_public_key,
            self.run_id,
        )


def validator_for(member: Member) -> EntryValidator:
    """The validator that makes a DHT node store and take only members' signed entries of ``member``'s run:
    give it to the DHT when it is created (``Transport(record_validators=...)``)."""
    return EntryValidator(coordinator_public_key=member.coordinator_public_key, run_id=member.run_id)


def guard(dht: DHT, member: Member) -> None:
    """Guard an already started DHT node like ``validator_for`` does; entries it stored before stay."""
    dht.add_validators([validator_for(member)])


def read_entries(dht: DHT, key: str, cls: type[T], *, member: Member) -> dict[str, T]:
    """The entries under ``key`` by subkey that verify against ``member``'s coordinator; the others are
    left out (and logged once each)."""
    return {subkey: entry for subkey, (entry, _) in read_signed_entries(dht, key, cls, member=member).items()}


def read_signed_entries(dht: DHT, key: str, cls: type[T], *, member: Member) -> dict[str, tuple[T, dict]]:
    """``read_entries``, each entry with the signed value it came in (to pass on to a reader who checks it)."""
    found = dht.get(key, latest=True)
    entries: dict[str, tuple[T, dict]] = {}
    if found is None or not isinstance(found.value, dict):
        return entries
    now = time.time()
    for subkey, item in found.value.items():
        value = getattr(item, "value", None)
        try:
            entries[subkey] = (
                verify_entry(
                    value,
                    key=key,
                    subkey=subkey,
                    cls=cls,
                    member=member,
                    now=now,
                    expiration_time=getattr(item, "expiration_time", math.nan),
                ),
                value,
            )
        except EntryRejected as e:
            _log_once(key, subkey, str(e), cls)
    return entries


def _log_once(key: str, subkey: Any, reason: str, cls: type) -> None:
    """Readers poll a key many times a second: each rejection is logged once, not on every read."""
    seen = (key, repr(subkey)[:64], reason)
    if seen in _logged:
        return
    _logged[seen] = None
    while len(_logged) > _LOGGED_MAX:
        _logged.popitem(last=False)
    logger.warning("%s: ignoring a %s entry under subkey %s: %s", key, cls.__name__, repr(subkey)[:64], reason)
