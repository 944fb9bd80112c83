"""A member's vote for a round, as it posts it in the DHT (``swarm.net.votes``) and, when its group decided the
round while the coordinator was unreachable, as the coordinator receives it with a report
(``coordinator.rounds.offline_votes``). Plain Python: both sides read it."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Optional

MAX_SENT_VOTES = 128  # a report carries at most this many signed votes (~0.8 KB each; requests are capped at 256 KiB)


@dataclass(frozen=True, kw_only=True)
class Vote:
    peer_id: str
    dht_peer_id: str
    ok: bool
    state_hash: str
    group: str = ""  # ``group_id`` of the members it averaged with ("": its exchange failed)


def group_key(run_id: str, round_no: int, fragment: int | str = 0) -> str:
    """The DHT key of a round's fragment: its group entries are posted under it, its votes under ``vote_key``."""
    return f"{run_id}.round{round_no}.fragment{fragment}"


def vote_key(group_key: str) -> str:
    return f"{group_key}.votes"


def vote_fragment(key: str, run_id: str, round_no: int) -> Optional[int]:
    """The fragment whose votes ``key`` holds, if it is a vote key of ``run_id``'s round ``round_no`` (else None)."""
    before, after = vote_key(group_key(run_id, round_no, "\x00")).split("\x00")
    found = re.fullmatch(re.escape(before) + "([0-9]{1,6})" + re.escape(after), key)
    return int(found.group(1)) if found else None


def group_id(group: list[str]) -> str:
    """What a vote says of its group: the digest of its members' peer ids, so a vote is not counted for
    another group than the one its voter averaged with."""
    return hashlib.sha256("|".join(sorted(group)).encode()).hexdigest()[:16] if group else ""
