"""``swarm token``: create, list and revoke a run's join tokens in the coordinator's state dir.

It writes the coordinator's SQLite store directly; a running coordinator reads tokens from the store at
each join, status request and member call, so a change applies at once, without a restart.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Optional

from coordinator.api import tokens
from coordinator.server import JOIN_STRING_FILE
from coordinator.store.database import STORE_FILE, Store
from coordinator.store.records import TokenRecord
from swarm.config import ConfigError
from swarm.control import tls
from swarm.control.joinstring import JoinString

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Seconds in ``30m``, ``24h``, ``7d`` (or ``90s``)."""
    match = _DURATION.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--expires {text!r} is not a duration; write it like 90s, 30m, 24h or 7d.")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def _store(state_dir: Path) -> Store:
    if not (state_dir / STORE_FILE).is_file():
        raise ConfigError(
            f"{state_dir} holds no coordinator state; give the --state-dir the coordinator was started with."
        )
    return Store(state_dir / STORE_FILE)


def _join_string(state_dir: Path, token: str) -> JoinString:
    """The run's join string with ``token``: address from the coordinator's join-string file, fingerprint
    from its certificate."""
    try:
        current = JoinString.parse((state_dir / JOIN_STRING_FILE).read_text().strip())
        cert = (state_dir / tls.CERT_FILE).read_bytes()
    except OSError as e:
        raise ConfigError(
            f"cannot read the coordinator's {Path(e.filename or '').name or 'files'} in {state_dir} "
            "(start the coordinator once to create them)."
        ) from None
    return JoinString(host=current.host, port=current.port, token=token, fingerprint=tls.fingerprint(cert))


MAX_IDENTITIES = 10**5  # the most --max-identities takes (a run's peers are far fewer)


def create(
    state_dir: Path,
    *,
    role: str = "peer",
    expires: Optional[str] = None,
    max_uses: Optional[int] = None,
    site: str = "",
    max_identities: int = tokens.CREATED_MAX_IDENTITIES,
) -> str:
    """A new token, stored; returns the join string that carries it. A peer token holds at most
    ``max_identities`` live identities at once (one machine's peer each)."""
    if max_uses is not None and max_uses < 1:
        raise ConfigError(f"--max-uses {max_uses} would admit nobody; give 1 or more, or leave it out.")
    if not 1 <= max_identities <= MAX_IDENTITIES:
        raise ConfigError(
            f"--max-identities {max_identities} is not from 1 to {MAX_IDENTITIES}; give how many "
            "peers may hold the token at once (1 per machine you hand it to)."
        )
    expires_in_s = parse_duration(expires) if expires else None
    store = _store(state_dir)
    try:
        record, text = tokens.new_token(
            now=time.time(),
            role=role,
            site=site,
            expires_in_s=expires_in_s,
            max_uses=max_uses,
            max_identities=max_identities if role == "peer" else None,
        )
        join = _join_string(state_dir, text)
        store.put_token(record)
    finally:
        store.close()
    return str(join)


def list_tokens(state_dir: Path) -> list[tuple[TokenRecord, int]]:
    """The run's tokens, each with how many live identities (members not left or evicted) it admitted."""
    store = _store(state_dir)
    try:
        live = store.live_identities()
        return [(record, len(live.get(record.id, ()))) for record in store.tokens()]
    finally:
        store.close()


def revoke(state_dir: Path, token_id: str) -> TokenRecord:
    store = _store(state_dir)
    try:
        with store.transaction():
            record = store.get_token(token_id)
            if record is None:
                raise ConfigError(f"this run has no token {token_id!r}; `swarm token list` shows its tokens.")
            record = TokenRecord(**{**record.__dict__, "revoked": True})
            store.put_token(record)
        return record
    finally:
        store.close()


def describe(record: TokenRecord, *, now: float, live: int = 0) -> str:
    """One line per token for ``swarm token list``; ``live``: its live identities."""
    if record.revoked:
        state = "revoked"
    elif record.expires_at is not None and now >= record.expires_at:
        state = "expired"
    elif record.expires_at is not None:
        state = f"expires in {(record.expires_at - now) / 3600:.1f}h"
    else:
        state = "no expiry"
    uses = f"{record.uses}/{record.max_uses}" if record.max_uses is not None else str(record.uses)
    if record.role != "peer":
        held = "-"
    else:
        held = f"{live}/{record.max_identities if record.max_identities is not None else 'any'}"
    return f"{record.id:<12} {record.role:<7} {record.site or '-':<12} uses {uses:<8} identities {held:<9} {state}"
