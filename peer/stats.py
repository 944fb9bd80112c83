"""What a peer knows about itself, shared between the training loop and the heartbeat thread."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from swarm.v1 import coordinator_pb2 as pb


@dataclass
class PeerStats:
    state: int = pb.PEER_STATE_JOINING
    round: int = 0
    params_hash: str = ""
    params_round: int = 0
    model_fingerprint: str = ""
    param_count: int = 0
    dht_peer_id: str = ""
    dht_maddrs: tuple[str, ...] = ()
    loss: float = math.nan
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    inner_time_s: float = 0.0
    inner_steps: int = 0
    tokens: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    eval_loss: float = math.nan
    eval_round: int = -1
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def update(self, **changes) -> None:
        with self.lock:
            for name, value in changes.items():
                setattr(self, name, value)

    def add(self, **increments) -> None:
        with self.lock:
            for name, value in increments.items():
                setattr(self, name, getattr(self, name) + value)

    def heartbeat_request(self, peer_id: str) -> pb.HeartbeatRequest:
        with self.lock:
            return pb.HeartbeatRequest(
                peer_id=peer_id,
                state=self.state,
                round=self.round,
                params_hash=self.params_hash,
                params_round=self.params_round,
                model_fingerprint=self.model_fingerprint,
                param_count=self.param_count,
                dht_peer_id=self.dht_peer_id,
                dht_maddrs=list(self.dht_maddrs),
                loss=self.loss,
                step_time_s=self.step_time_s,
                tokens_per_s=self.tokens_per_s,
                inner_time_s=self.inner_time_s,
                wall_time_s=time.monotonic() - self.started,
                inner_steps=self.inner_steps,
                tokens=self.tokens,
                bytes_sent=self.bytes_sent,
                bytes_received=self.bytes_received,
                eval_loss=self.eval_loss,  # NaN until the first evaluation
                eval_round=max(self.eval_round, 0),
            )
