"""A round the group decided from its DHT votes, without the coordinator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swarm.v1 import coordinator_pb2 as pb


@dataclass(frozen=True)
class GroupDecided:
    """A round decided by the group's DHT votes (the coordinator's commit rule on a complete set)."""

    committed_hash: Optional[str]  # None: void
    holders: list[str]  # the DHT ids of the members that hold the committed state
    votes: list[pb.SignedVote]  # every member's vote as it signed it, for the coordinator to count
