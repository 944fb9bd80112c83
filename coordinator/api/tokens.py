"""Join tokens: what a join string carries to let a machine join a run (role ``peer``) or watch it (role
``status``). Kept in the coordinator's store as a hash of the secret, never the secret; the operator
creates, lists and revokes them with ``swarm token`` while the coordinator runs.

A token travels as ``<id>.<secret>``; the run's first join string carries the bare secret of the token
``default``. Secrets are compared in constant time, and only a token whose secret matched is told why it
cannot be used (expired, revoked, used up, the wrong role, all its identities live).

A peer token holds at most ``max_identities`` live identities (peer keys) at once: ``swarm token create``
makes tokens of one, so a stranger's join string cannot mint the members that would outvote a group; the
first join string, the operator's own, holds any number. A key that is live already (a restarted peer) is
the same identity and joins again whatever the count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from typing import Collection, Optional, Protocol

from coordinator.api.errors import BadToken, Rejection
from coordinator.store.records import TokenRecord

DEFAULT_ID = "default"
ROLES = ("peer", "status")
CREATED_MAX_IDENTITIES = 1  # a created token's limit unless ``--max-identities`` says otherwise


class TokenRefused(Rejection):
    """A token whose secret matched but which cannot be used for this."""

    code = "PERMISSION_DENIED"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def split(token: str) -> tuple[str, str]:
    """``(id, secret)`` of a token as a join string carries it."""
    token_id, dot, secret = token.partition(".")
    return (token_id, secret) if dot else (DEFAULT_ID, token)


def new_token(
    *,
    now: float,
    role: str = "peer",
    site: str = "",
    expires_in_s: Optional[float] = None,
    max_uses: Optional[int] = None,
    max_identities: Optional[int] = CREATED_MAX_IDENTITIES,
) -> tuple[TokenRecord, str]:
    """A new token and its text for a join string (the only time the secret is seen)."""
    if role not in ROLES:
        raise ValueError(f"a token's role is one of {', '.join(ROLES)}, not {role!r}.")
    token_id, secret = "t-" + secrets.token_hex(4), secrets.token_urlsafe(24)
    record = TokenRecord(
        id=token_id,
        secret_hash=hash_secret(secret),
        role=role,
        site=site,
        created_at=now,
        expires_at=None if expires_in_s is None else now + expires_in_s,
        max_uses=max_uses,
        max_identities=max_identities,
    )
    return record, f"{token_id}.{secret}"


def default_token(secret: str, *, now: float) -> TokenRecord:
    """The first join string's token: the operator's own, for any number of peers."""
    return TokenRecord(id=DEFAULT_ID, secret_hash=hash_secret(secret), created_at=now, max_identities=None)


def first_join_string_note(state_dir: str) -> str:
    """What ``swarm coordinator`` says of the join string it prints (its token holds any number of peers)."""
    return (
        f"this join string holds {identities(None)} (token {DEFAULT_ID}): give it only to machines you run; "
        f"for anyone else, `swarm token create --state-dir {state_dir}` prints a join string for "
        f"{identities(CREATED_MAX_IDENTITIES)} (--max-identities N for more)."
    )


def matching(record: Optional[TokenRecord], secret: str) -> TokenRecord:
    """``record`` if ``secret`` is its secret; BadToken (the same for an unknown id) otherwise."""
    expected = record.secret_hash if record is not None else hash_secret("")
    if not hmac.compare_digest(expected, hash_secret(secret)) or record is None:
        raise BadToken()
    return record


def admit(record: TokenRecord, *, now: float, peer_id: str = "", live: Collection[str] = ()) -> TokenRecord:
    """The token with one more use, if it may admit the identity ``peer_id`` now, ``live`` being the live
    identities it admitted; TokenRefused with the reason otherwise."""
    if record.role != "peer":
        raise TokenRefused(
            f"token {record.id} is a {record.role} token: it can watch this run but not join it; "
            "ask the operator for a peer join string."
        )
    usable(record, now=now)
    if record.max_uses is not None and record.uses >= record.max_uses:
        raise TokenRefused(
            f"token {record.id} was already used {record.uses} times, its limit; "
            "ask the operator for a new join string."
        )
    if record.max_identities is not None and peer_id not in live and len(live) >= record.max_identities:
        raise TokenRefused(
            f"token {record.id} holds at most {identities(record.max_identities)} at once and {len(live)} "
            f"{'is' if len(live) == 1 else 'are'} live; stop one of its peers (or wait for one to leave), or ask "
            "the operator for a join string whose token holds more (swarm token create --max-identities N)."
        )
    return dataclasses.replace(record, uses=record.uses + 1)


def identities(count: Optional[int]) -> str:
    """``1 identity``, ``3 identities``, ``any number of identities`` (None)."""
    return "any number of identities" if count is None else f"{count} identit{'y' if count == 1 else 'ies'}"


def usable(record: TokenRecord, *, now: float) -> None:
    """Raise TokenRefused when the token is revoked or expired."""
    if record.revoked:
        raise TokenRefused(f"token {record.id} was revoked; ask the operator for a new join string.")
    if record.expires_at is not None and now >= record.expires_at:
        raise TokenRefused(
            f"token {record.id} expired {now - record.expires_at:.0f}s ago; ask the operator for a new join string."
        )


class TokenStore(Protocol):
    def get_token(self, token_id: str) -> Optional[TokenRecord]: ...

    def put_token(self, token: TokenRecord) -> None: ...

    def revoked_token_ids(self) -> frozenset[str]: ...

    def live_identities(self, token_id: Optional[str] = None) -> dict[str, frozenset[str]]: ...


def admit_joiner(store: TokenStore, token: str, *, now: float, peer_id: str) -> TokenRecord:
    """The peer token ``token`` names, its use counted, for the identity ``peer_id``; BadToken or TokenRefused
    when it may not join."""
    token_id, secret = split(token)
    record = matching(store.get_token(token_id), secret)
    live = store.live_identities(record.id).get(record.id, frozenset()) if record.max_identities is not None else ()
    record = admit(record, now=now, peer_id=peer_id, live=live)
    store.put_token(record)
    return record


def check_watcher(store: TokenStore, token: str, *, now: float) -> TokenRecord:
    """Any valid token (peer or status) may watch the run."""
    token_id, secret = split(token)
    record = matching(store.get_token(token_id), secret)
    usable(record, now=now)
    return record


def revoked(store: TokenStore, token_id: str) -> bool:
    return token_id in store.revoked_token_ids()
