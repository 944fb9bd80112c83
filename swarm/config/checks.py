"""What every config section shares: the error a user mistake raises, the bounds that catch typos, and the range
and path checks."""

from __future__ import annotations

import math
from typing import Any


class ConfigError(ValueError):
    """A user mistake in a run config; the message says what is wrong and what to do."""


# Upper bounds: far beyond any sensible run, low enough that a typo is caught before it allocates or loops.
MAX_STEPS = 10**7  # inner steps, warmup steps
MAX_BATCH = 2**16  # sequences per batch, bytes per sequence
MAX_ROUNDS = 10**9
MAX_PEERS = 10**5
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_LR = 1e3


def check_range(section: str, name: str, value: Any, low: float, high: float) -> None:
    """ConfigError unless ``value`` is a finite number in [low, high]."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and low <= value <= high):
        raise ConfigError(f"[{section}] {name} must be a finite number from {low:g} to {high:g}, got {value!r}.")


MAX_PATH_CHARS = 4096


def check_dir(name: str, path: str) -> None:
    if "\0" in path or len(path) > MAX_PATH_CHARS or not path.strip():
        raise ConfigError(
            f"[logging] {name} must be a directory path of at most {MAX_PATH_CHARS} characters, got {path[:80]!r}."
        )
