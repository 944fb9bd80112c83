"""How many inner steps a round may have: ``[rounds] inner_steps`` (H), or with the adaptive controller on
(``controller = "auto"``) up to the longer H it may choose for a round whose exchange does not hide behind
H steps: ``controller_max_inner_steps`` (default ``MAX_INNER_STEPS_FACTOR`` × H). Every member derives it
from the run config alike; the weight cap and a peer's step budget are bounded by it."""

from __future__ import annotations

from swarm.config.run import RoundConfig
from swarm.core.fragments import round_steps

MAX_INNER_STEPS_FACTOR = 4  # without controller_max_inner_steps: the longest round the controller chooses, x H


def longest_inner_steps(rounds: RoundConfig) -> int:
    """The largest H any round of the run may have."""
    if rounds.controller != "auto":
        return rounds.inner_steps
    return rounds.controller_max_inner_steps or MAX_INNER_STEPS_FACTOR * rounds.inner_steps


def longest_round_steps(round_no: int, rounds: RoundConfig) -> int:
    """The most inner steps round ``round_no`` may have (a fragment's share of the largest H)."""
    return round_steps(round_no, longest_inner_steps(rounds), rounds.fragments)


def longest_sync_steps(rounds: RoundConfig) -> int:
    """The most inner steps one fragment's pseudo-gradient may span (between two of its syncs): H, or with
    the controller on, F rounds of at most ``ceil(largest H / F)`` steps each (rounds of different H)."""
    if rounds.controller != "auto":
        return rounds.inner_steps
    f = rounds.fragments
    return f * -(-longest_inner_steps(rounds) // f)
