"""Signed entries posted under one DHT key, one subkey per peer (group members, votes).

Any DHT node can store any value under any key and subkey, so an entry is believed only for what its
signature proves: each is stored as ``{"body", "credential", "signature"}``, where ``body`` is the entry
(a dataclass, as JSON), ``credential`` is the poster's membership credential from the coordinator, and
``signature`` is the poster's signature of the DHT key and the body (an entry cannot be replayed under
another round's key). A reader keeps an entry only when the credential is the run's coordinator's and
current, and names the same peer as the subkey and the entry, and the same libp2p id (and site, where the
entry has one) as the entry.
A node guarded by ``guard`` (an ``EntryValidator``) applies the same checks before it stores a record or
takes one from another node, so a forged entry cannot displace a member's entry on it either.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from dataclasses import asdict, fields
from typing import Any, TypeVar

import hivemind
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from swarm.core.credential import CredentialError, Member, verify_credential, verify_signature

logger = logging.getLogger(__name__)
T = TypeVar("T")

ENTRY_PURPOSE = "dht-entry"
MAX_BODY_BYTES = 1024  # an entry's JSON is ~200 bytes; a larger one is refused unparsed
_LOGGED_MAX = 1024  # rejections remembered so each (key, subkey, reason) is logged once
_logged: collections.OrderedDict[tuple[str, str, str], None] = collections.OrderedDict()


class EntryRejected(ValueError):
    """An entry that is not believed; the message says why."""


def _signed_message(key: str, body: bytes) -> bytes:
    return key.encode() + b"\0" + body


def sign_entry(member: Member, key: str, entry: Any) -> dict[str, Any]:
    """The DHT value that stands for ``entry`` under ``key``, signed by ``member``. The key travels in
    clear too: DHT nodes see only its hash, and their ``EntryValidator`` checks the signature with it."""
    body = json.dumps(asdict(entry), sort_keys=True, separators=(",", ":")).encode()
    return {"key": key, "body": body, "credential": bytes(member.credential),
            "signature": member.key.sign(ENTRY_PURPOSE, _signed_message(key, body))}


def store_entry(dht: hivemind.DHT, key: str, entry: Any, *, member: Member, ttl_s: float) -> None:
    """Post ``entry`` (a dataclass whose ``peer_id`` is the member's) under ``key``, signed."""
    assert entry.peer_id == member.peer_id, "a member posts only its own entries"
    dht.store(key, subkey=member.peer_id, value=sign_entry(member, key, entry),
              expiration_time=get_dht_time() + ttl_s)


def verify_entry(value: Any, *, key: str, subkey: Any, cls: type[T], member: Member, now: float) -> T:
    """The entry in a stored DHT value, if it checks out; EntryRejected with the reason otherwise."""
    signed = _signed_fields(value, key=key, subkey=subkey, coordinator_public_key=member.coordinator_public_key,
                            run_id=member.run_id, now=now)
    try:
        return cls(**_typed_fields(signed, cls))
    except (ValueError, TypeError) as e:
        raise EntryRejected(f"malformed {cls.__name__} ({e})") from None


def _signed_fields(value: Any, *, key: str, subkey: Any, coordinator_public_key: bytes, run_id: str,
                   now: float) -> dict[str, Any]:
    """The fields of a signed entry for ``key`` under ``subkey`` whose poster's credential is current and
    names the same peer and libp2p id as the entry; EntryRejected with the reason otherwise."""
    if not isinstance(value, dict) or not all(isinstance(value.get(f), bytes) for f in ("body", "credential", "signature")):
        raise EntryRejected("not a signed entry")
    body = value["body"]
    if len(body) > MAX_BODY_BYTES:
        raise EntryRejected(f"body of {len(body)} bytes, over {MAX_BODY_BYTES}")
    try:
        credential = verify_credential(value["credential"], coordinator_public_key, run_id=run_id, now=now)
    except CredentialError as e:
        raise EntryRejected(str(e)) from None
    if not verify_signature(credential.public_key, value["signature"], ENTRY_PURPOSE, _signed_message(key, body)):
        raise EntryRejected(f"not signed by {credential.peer_id} for this key")
    try:
        signed = json.loads(body.decode())
    except ValueError:
        raise EntryRejected("body is not JSON") from None
    if not isinstance(signed, dict):
        raise EntryRejected("body is not an object")
    if not credential.peer_id == subkey == signed.get("peer_id"):
        raise EntryRejected(f"credential of {credential.peer_id} on an entry of {str(signed.get('peer_id'))[:64]!r} "
                            f"under subkey {str(subkey)[:64]!r}")
    if signed.get("dht_peer_id") != credential.dht_peer_id:
        raise EntryRejected(f"libp2p id {str(signed.get('dht_peer_id'))[:64]!r} is not the credential's")
    if "site" in signed and signed["site"] != credential.site:
        raise EntryRejected(f"site {str(signed['site'])[:64]!r} is not the credential's {credential.site[:64]!r}")
    return signed


class EntryValidator(RecordValidatorBase):
    """Makes a DHT node refuse to store, or to take from another node, any record that is not a member's
    signed entry for that very key (``hivemind.DHT.add_validators``): a forged entry then cannot even
    displace a member's entry under its subkey. The DHT of a run holds nothing else. Runs inside the
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
            _signed_fields(value, key=key, subkey=subkey, coordinator_public_key=self.coordinator_public_key,
                           run_id=self.run_id, now=time.time())
        except Exception:  # noqa: BLE001 - whatever a stranger sent, the answer is "not stored"
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # one per run: a second identical validator (a group rebuilt on the same DHT) is absorbed
        return isinstance(other, EntryValidator) and (other.coordinator_public_key, other.run_id) == (
            self.coordinator_public_key, self.run_id)


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _typed_fields(decoded: Any, cls: type) -> dict[str, Any]:
    """The decoded fields if each has its field's type (floats finite); TypeError otherwise."""
    if not isinstance(decoded, dict):
        raise TypeError("not an object")
    declared = {f.name: str(f.type) for f in fields(cls)}
    for name, value in decoded.items():
        allowed = _TYPES.get(declared.get(name, ""), ())
        if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
            raise TypeError(f"field {name[:32]!r} is missing from {cls.__name__} or has the wrong type")
        if isinstance(value, float) and not math.isfinite(value):
            raise TypeError(f"field {name!r} is not finite")
    return {name: float(v) if declared[name] == "float" else v for name, v in decoded.items()}


def validator_for(member: Member) -> EntryValidator:
    """The validator that makes a DHT node store and take only members' signed entries of ``member``'s run:
    give it to the DHT when it is created (``Transport(record_validators=...)``)."""
    return EntryValidator(coordinator_public_key=member.coordinator_public_key, run_id=member.run_id)


def guard(dht: hivemind.DHT, member: Member) -> None:
    """Guard an already started DHT node like ``validator_for`` does; entries it stored before stay."""
    dht.add_validators([validator_for(member)])


def read_entries(dht: hivemind.DHT, key: str, cls: type[T], *, member: Member) -> dict[str, T]:
    """The entries under ``key`` by subkey that verify against ``member``'s coordinator; the others are
    left out (and logged once each)."""
    found = dht.get(key, latest=True)
    entries: dict[str, T] = {}
    if found is None or not isinstance(found.value, dict):
        return entries
    now = time.time()
    for subkey, item in found.value.items():
        try:
            entries[subkey] = verify_entry(getattr(item, "value", None), key=key, subkey=subkey, cls=cls,
                                           member=member, now=now)
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
