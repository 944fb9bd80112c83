"""An attacker's identity: a peer key joined with a token of its own (a token holds a bounded number of them), which
talks to the coordinator as a member does but never trains."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from swarm.app import token_admin
from swarm.control.client import CoordinatorClient, CoordinatorRejected
from swarm.control.joinstring import JoinString
from swarm.core.trust.credential import PeerKey
from swarm.net.link.libp2p_identity import Libp2pIdentity
from swarm.v1 import coordinator_pb2 as pb


class Identity:
    """One identity of the attacker's, joined with a token of its own."""

    def __init__(self, state_dir: Path, workdir: Path, name: str) -> None:
        self.join, self.name = JoinString.parse(token_admin.create(state_dir, role="peer")), name
        self.client = CoordinatorClient(self.join, request_timeout_s=5)
        self.libp2p = Libp2pIdentity.create(workdir / f"{name}-p2p.key")
        self.rejoin()
        self.reported: set[int] = set()
        self.info: Optional[pb.RoundInfo] = None  # the round as its last heartbeat heard it

    def rejoin(self) -> None:
        """Join (again, as a new identity of the same token: a slow attack round can outlast a lease)."""
        self.key = PeerKey.generate()
        self.joined = self.client.join(key=self.key, libp2p=self.libp2p, name=self.name)
        self.peer_id = self.joined.peer_id

    def member(self):
        from swarm.core.trust.credential import Member

        return Member(
            key=self.key,
            credential=self.joined.credential,
            run_id=self.joined.run_id,
            coordinator_public_key=self.joined.coordinator_public_key,
        )

    def planned_round(self, run: dict, **metrics) -> int:
        """Claim to hold the committed state; the open round it is planned into and has not reported (0: none)."""
        try:
            self.info = self.client.heartbeat(
                self.peer_id,
                state=pb.PEER_STATE_READY,
                state_hash=run["committed_hash"],
                state_round=run["committed_round"],
                **metrics,
            ).round
        except CoordinatorRejected as e:
            if "evicted" not in e.details and "left the run" not in e.details:
                raise
            self.rejoin()
            return 0
        number = self.info.open_round
        if number and self.peer_id in self.info.participants and number not in self.reported:
            self.reported.add(number)
            return number
        return 0

    def vote(self, run_id: str, round_no: int, state_hash: str, group: list[str]) -> dict:
        from swarm.core.trust.round_vote import Vote, group_id, group_key, vote_key
        from swarm.core.trust.signed_entry import sign_entry

        entry = Vote(
            peer_id=self.peer_id, dht_peer_id=self.libp2p.peer_id, ok=True, state_hash=state_hash, group=group_id(group)
        )
        return sign_entry(self.member(), vote_key(group_key(run_id, round_no, 0)), entry)

    def close(self) -> None:
        self.client.close()
