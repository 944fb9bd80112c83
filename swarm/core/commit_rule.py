"""The commit rule, shared by the coordinator and by a group deciding a round without it."""

from __future__ import annotations

from collections import Counter
from typing import Optional


def winning_hash(counts: Counter) -> Optional[tuple[str, int]]:
    """The commit rule, shared by the coordinator and by a group deciding without it: the hash most
    successful votes hold (ties: the smallest hash) and its count, or None (void) when there is none."""
    if not counts:
        return None
    return min(counts.items(), key=lambda item: (-item[1], item[0]))
