"""A member's signed entry: what it posts in the DHT (group entries, votes), checkable by anyone who holds the
run's coordinator key: the members, and the coordinator itself (a group's votes reach it with a report).

An entry is ``{"key", "body", "credential", "signature"}``: ``body`` is the entry (a dataclass, as JSON) with
the DHT expiration it was stored with (``expires_at``), ``credential`` the poster's membership credential from the
coordinator, ``signature`` the poster's signature of the key and the body (an entry cannot be replayed under
another round's key, nor stored again with another expiration: the DHT keeps a subkey's value with the latest
expiration, so were it unsigned, anyone could put a member's older entry back over its newer one). Plain Python, no
DHT: ``swarm.net.dht_entries`` stores and reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any, Optional, TypeVar

from swarm.core.trust.credential import CredentialError, Member, verify_credential, verify_signature

T = TypeVar("T")

ENTRY_PURPOSE = "dht-entry"
MAX_BODY_BYTES = 1024  # an entry's JSON is ~200 bytes; a larger one is refused unparsed
EXPIRES_AT = "expires_at"  # the signed DHT expiration in a body; no entry dataclass has a field of that name
_EXPIRES_AT_BYTES = 48  # what ``,"expires_at":<float>`` adds to a body, allowed beyond MAX_BODY_BYTES


class EntryRejected(ValueError):
    """An entry that is not believed; the message says why."""


def _signed_message(key: str, body: bytes) -> bytes:
    return key.encode() + b"\0" + body


# Fields added to an entry after its first version, left out of the body while at their default (the reader fills
# it in), so a peer of the previous version does not refuse every entry of this one. Only these: every other field
# stays, ``site`` above all, which readers check against the credential when it is there. (A nonzero ``protocol`` is
# refused by a peer from before it, as it should be: the two cut their slices differently.)
OMITTED_AT_DEFAULT = ("closed", "protocol")


def entry_body(entry: Any, *, expires_at: Optional[float] = None) -> bytes:
    """The bytes ``sign_entry`` signs for ``entry`` (a reader refuses more than MAX_BODY_BYTES without the
    expiration)."""
    body = {
        f.name: getattr(entry, f.name)
        for f in fields(entry)
        if not (f.name in OMITTED_AT_DEFAULT and getattr(entry, f.name) == f.default)
    }
    if expires_at is not None:
        body[EXPIRES_AT] = float(expires_at)
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign_entry(member: Member, key: str, entry: Any, *, expires_at: Optional[float] = None) -> dict[str, Any]:
    """The DHT value that stands for ``entry`` under ``key``, signed by ``member``, to be stored with the DHT
    expiration ``expires_at`` (DHT readers and guarded nodes refuse it under any other; None: for a reader
    outside the DHT only, such as the coordinator checking a vote). The key travels in clear too: DHT nodes
    see only its hash, and their ``EntryValidator`` checks the signature with it."""
    body = entry_body(entry, expires_at=expires_at)
    return {
        "key": key,
        "body": body,
        "credential": bytes(member.credential),
        "signature": member.key.sign(ENTRY_PURPOSE, _signed_message(key, body)),
    }


def verify_signed(
    value: Any,
    *,
    key: str,
    subkey: Any,
    cls: type[T],
    coordinator_public_key: bytes,
    run_id: str,
    now: float,
    expiration_time: Optional[float] = None,
) -> T:
    """The entry of type ``cls`` in a signed value posted under ``key`` and ``subkey`` (and, when given, held in
    the DHT until ``expiration_time``), if it checks out against the run's coordinator key; EntryRejected with
    the reason otherwise."""
    signed = signed_fields(
        value,
        key=key,
        subkey=subkey,
        coordinator_public_key=coordinator_public_key,
        run_id=run_id,
        now=now,
        expiration_time=expiration_time,
    )
    signed.pop(EXPIRES_AT, None)
    try:
        return cls(**_typed_fields(signed, cls))
    except (ValueError, TypeError) as e:
        raise EntryRejected(f"malformed {cls.__name__} ({e})") from None


def signed_fields(
    value: Any,
    *,
    key: str,
    subkey: Any,
    coordinator_public_key: bytes,
    run_id: str,
    now: float,
    expiration_time: Optional[float] = None,
) -> dict[str, Any]:
    """The fields of a signed entry for ``key`` under ``subkey`` whose poster's credential is current and
    names the same peer and libp2p id as the entry, and, when ``expiration_time`` is given (the entry came from
    the DHT), was signed with that very expiration; EntryRejected with the reason otherwise."""
    if not isinstance(value, dict) or not all(
        isinstance(value.get(f), bytes) for f in ("body", "credential", "signature")
    ):
        raise EntryRejected("not a signed entry")
    body = value["body"]
    if len(body) > MAX_BODY_BYTES + _EXPIRES_AT_BYTES:
        raise EntryRejected(f"body of {len(body)} bytes, over {MAX_BODY_BYTES + _EXPIRES_AT_BYTES}")
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
        raise EntryRejected(
            f"credential of {credential.peer_id} on an entry of {str(signed.get('peer_id'))[:64]!r} "
            f"under subkey {str(subkey)[:64]!r}"
        )
    if signed.get("dht_peer_id") != credential.dht_peer_id:
        raise EntryRejected(f"libp2p id {str(signed.get('dht_peer_id'))[:64]!r} is not the credential's")
    if "site" in signed and signed["site"] != credential.site:
        raise EntryRejected(f"site {str(signed['site'])[:64]!r} is not the credential's {credential.site[:64]!r}")
    if expiration_time is not None and signed.get(EXPIRES_AT) != expiration_time:
        # the DHT keeps the value of latest expiration: an entry stored again with a later one than its poster
        # signed would pass for the poster's newest
        raise EntryRejected(
            f"held until {expiration_time!r} in the DHT but signed for "
            f"{str(signed.get(EXPIRES_AT))[:32]}: a replay, not what its poster stored"
        )
    return signed


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
