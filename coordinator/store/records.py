"""The coordinator's state as plain records: the run, its peers, its rounds and the peers' reports.

The logic (membership, rounds) reads and replaces these; the store saves them as JSON rows (a peer's
metrics, a protobuf message, in a column of their own).
States and outcomes use the protocol's enum numbers (``swarm.v1.coordinator_pb2``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from google.protobuf.message import Message

from swarm.v1 import coordinator_pb2 as pb

JOINING = pb.PEER_STATE_JOINING
READY = pb.PEER_STATE_READY
TRAINING = pb.PEER_STATE_TRAINING
EXCHANGING = pb.PEER_STATE_EXCHANGING
LEFT = pb.PEER_STATE_LEFT
EVICTED = pb.PEER_STATE_EVICTED
GONE_STATES = (LEFT, EVICTED)
HOLDING_STATES = (READY, TRAINING, EXCHANGING)  # states in which a peer holds a usable global state

OPEN = pb.ROUND_OUTCOME_OPEN
COMMITTED = pb.ROUND_OUTCOME_COMMITTED
VOIDED = pb.ROUND_OUTCOME_VOIDED

NAN = float("nan")


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    run_id: str
    token: str
    run_spec_json: str
    created_at: float
    model_fingerprint: str = ""  # derived from the config when the run starts (coordinator.store.run_identity)
    param_count: int = 0
    initial_hash: str = ""  # hash of round 0's state, derived likewise
    next_peer_index: int = 0
    ddp_equivalent_bytes: int = 0
    finished_at: float | None = None
    eval_loss: float = NAN
    eval_round: int = -1  # -1: no evaluation reported yet
    initial_eval_loss: float = NAN
    grpc_port: int = 0  # the port the last server bound, reused on restart so the join string holds
    dht_port: int = 0  # the DHT node's, reused on restart so the peers' address for it holds

    @property
    def finished(self) -> bool:
        return self.finished_at is not None


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    peer_id: str
    peer_index: int
    joined_at: float
    last_seen: float
    lease_expiry: float
    state: int = JOINING
    gone_reason: str = ""  # why it left or was evicted, in words
    name: str = ""
    site: str = ""
    device: str = ""
    swarm_version: str = ""
    public_key: str = ""  # its Ed25519 key (hex), proven at join: every later call is signed by it
    session: int = 0  # counts its joins: a call of an older session comes from a replaced process
    dht_peer_id: str = ""  # its libp2p id, proven at join
    token_id: str = ""  # the join token it was admitted with
    credential_expires_at: float = 0.0  # of the newest credential issued to it
    # From its latest heartbeat, kept whole; the coordinator acts on the state hash and round, the model
    # fingerprint and the DHT addresses in it.  Never mutated in place: a heartbeat replaces it.
    metrics: pb.PeerMetrics = field(default_factory=lambda: pb.PeerMetrics(state_round=-1))  # -1: no state yet
    # kept by the coordinator
    rounds_joined: int = 0
    rounds_missed: int = 0

    @property
    def alive(self) -> bool:
        return self.state not in GONE_STATES


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    round: int
    opened_at: float
    participants: tuple[str, ...] = ()
    outcome: int = OPEN
    decided_at: float | None = None
    committed_hash: str = ""
    holders: tuple[str, ...] = ()  # peer ids that reported the committed hash
    mean_loss: float = NAN
    reason: str = ""  # why it was decided so, in words
    choice: str = ""  # the controller's choice for it as JSON (coordinator.rounds.controller; "": controller off)
    # The time budget (coordinator.rounds.budgets): each participant's inner steps and the step time they came
    # from, aligned with ``participants`` (empty: every participant does the full steps).
    budget_s: float = 0.0  # the round's compute seconds (0: none measured)
    deadline_s: float = 0.0  # after opened_at: a participant not ready by it plus report_grace_s is left out (0: none)
    budgets: tuple[int, ...] = ()
    step_times_s: tuple[float, ...] = ()
    left_out: tuple[str, ...] = ()  # participants the round went on without (too slow); no longer in participants
    # when the late participants' grace began, if not at the deadline (0): inf while most of them were late past the
    # deadline (the round waits), then the moment more than half were ready (coordinator.rounds.outcome.leave_out)
    grace_from: float = 0.0


@dataclass(frozen=True, kw_only=True)
class ReportRecord:
    round: int
    peer_id: str
    reported_at: float
    ok: bool = False
    state_hash: str = ""
    group: tuple[str, ...] = ()
    samples: int = 0
    inner_steps: int = 0
    inner_time_s: float = 0.0
    exchange_time_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    loss: float = NAN
    error: str = ""
    param_count: int = 0


@dataclass(frozen=True, kw_only=True)
class TokenRecord:
    """A join token (see coordinator.api.tokens); ``secret_hash`` is all the store keeps of its secret."""

    id: str
    secret_hash: str  # SHA-256 hex of the secret
    role: str = "peer"
    site: str = ""  # when set, peers admitted with it are at this site, whatever they say
    created_at: float = 0.0
    expires_at: Optional[float] = None  # joins are refused after it (members admitted before stay)
    max_uses: Optional[int] = None
    uses: int = 0
    revoked: bool = False  # no join, and the members it admitted are evicted at their next call
    # live identities (peer keys) it may hold at once; None: any number (the first join string's, and every
    # token stored without the field)
    max_identities: Optional[int] = None


R = TypeVar("R")


def to_json(record: Any) -> str:
    """The record's plain fields as JSON; a protobuf message field is left to the store."""
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return json.dumps({k: v for k, v in values.items() if not isinstance(v, Message)}, sort_keys=True)


def from_json(cls: type[R], text: str) -> R:
    """Rebuild a record, ignoring fields a newer version dropped and defaulting fields it added."""
    data = json.loads(text)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            value = data[f.name]
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


def finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
