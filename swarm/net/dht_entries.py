"""Typed entries posted under one DHT key, one subkey per peer (group members, votes).

hivemind stores a dictionary value as {subkey: ValueWithExpiration}; each entry here is a dataclass
serialized with ``asdict`` whose ``peer_id`` field is also its subkey, so a peer can only speak for
itself under its own subkey.
"""

from __future__ import annotations

import logging
from typing import TypeVar

import hivemind

logger = logging.getLogger(__name__)
T = TypeVar("T")


def read_entries(dht: hivemind.DHT, key: str, cls: type[T]) -> dict[str, T]:
    """The well-formed entries under ``key`` by subkey; malformed ones, or ones whose ``peer_id`` is
    not their subkey, are left out (and logged)."""
    found = dht.get(key, latest=True)
    entries: dict[str, T] = {}
    if found is None or not isinstance(found.value, dict):
        return entries
    for subkey, item in found.value.items():
        try:
            entry = cls(**getattr(item, "value", None))
        except TypeError:
            logger.warning("%s: ignoring a malformed %s entry under %r", key, cls.__name__, subkey)
            continue
        if getattr(entry, "peer_id", None) == subkey:
            entries[subkey] = entry
    return entries
