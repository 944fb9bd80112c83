"""Telling a user why groupmates cannot exchange: which member could not be dialled, at which addresses,
and what to pass so that it can be. A round voided for that reason otherwise repeats forever, silently."""

from __future__ import annotations

# What libp2p's daemon answers when it finds no address of a peer, or none of them answers.
_DIAL_FAILURES = (
    "routing: not found",
    "failed to dial",
    "no addresses",
    "dial backoff",
    "connection refused",
    "no good addresses",
    "i/o timeout",
)
MAX_SHOWN_MADDRS = 3
MAX_MADDRS_CHARS = 200  # what a member's entry may carry: shown in messages, never dialled


def is_dial_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return any(marker in text for marker in _DIAL_FAILURES)


def shown_maddrs(maddrs: list[str]) -> str:
    """A node's announced addresses as a member's entry carries them: without the /p2p/ id, bounded."""
    bare = [m.split("/p2p/")[0] for m in maddrs[:MAX_SHOWN_MADDRS]]
    return " ".join(bare)[:MAX_MADDRS_CHARS]


def unreachable_groupmate(key: str, peer_id: str, maddrs: str, error: BaseException) -> str:
    """The exchange's failure reason when ``peer_id`` could not be dialled."""
    where = maddrs if maddrs.isprintable() and maddrs else "no announced address"
    detail = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    return (
        f"{key}: cannot reach groupmate {peer_id} at {where} ({detail}); it may have stopped, or if it runs, "
        "it must pass --announce-host ADDRESS reachable from its groupmates (and open the port)"
    )
