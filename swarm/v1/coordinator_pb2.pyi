from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PeerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PEER_STATE_UNSPECIFIED: _ClassVar[PeerState]
    PEER_STATE_JOINING: _ClassVar[PeerState]
    PEER_STATE_READY: _ClassVar[PeerState]
    PEER_STATE_TRAINING: _ClassVar[PeerState]
    PEER_STATE_EXCHANGING: _ClassVar[PeerState]
    PEER_STATE_LEFT: _ClassVar[PeerState]
    PEER_STATE_EVICTED: _ClassVar[PeerState]

class RoundOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUND_OUTCOME_UNSPECIFIED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_OPEN: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_COMMITTED: _ClassVar[RoundOutcome]
    ROUND_OUTCOME_VOIDED: _ClassVar[RoundOutcome]
PEER_STATE_UNSPECIFIED: PeerState
PEER_STATE_JOINING: PeerState
PEER_STATE_READY: PeerState
PEER_STATE_TRAINING: PeerState
PEER_STATE_EXCHANGING: PeerState
PEER_STATE_LEFT: PeerState
PEER_STATE_EVICTED: PeerState
ROUND_OUTCOME_UNSPECIFIED: RoundOutcome
ROUND_OUTCOME_OPEN: RoundOutcome
ROUND_OUTCOME_COMMITTED: RoundOutcome
ROUND_OUTCOME_VOIDED: RoundOutcome

class ChallengeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChallengeResponse(_message.Message):
    __slots__ = ("nonce", "expires_in_s")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    expires_in_s: float
    def __init__(self, nonce: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("token", "site", "device", "name", "swarm_version", "public_key", "nonce", "dht_peer_id", "dht_public_key", "signature", "dht_signature", "protocol")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SWARM_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DHT_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DHT_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    DHT_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    token: str
    site: str
    device: str
    name: str
    swarm_version: str
    public_key: bytes
    nonce: bytes
    dht_peer_id: str
    dht_public_key: bytes
    signature: bytes
    dht_signature: bytes
    protocol: int
    def __init__(self, token: _Optional[str] = ..., site: _Optional[str] = ..., device: _Optional[str] = ..., name: _Optional[str] = ..., swarm_version: _Optional[str] = ..., public_key: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., dht_peer_id: _Optional[str] = ..., dht_public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., dht_signature: _Optional[bytes] = ..., protocol: _Optional[int] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("peer_id", "run_id", "run_spec_json", "dht_initial_peers", "heartbeat_interval_s", "lease_s", "peer_index", "round", "session", "credential", "coordinator_public_key", "protocol")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    DHT_INITIAL_PEERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PEER_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_id: str
    run_spec_json: str
    dht_initial_peers: _containers.RepeatedScalarFieldContainer[str]
    heartbeat_interval_s: float
    lease_s: float
    peer_index: int
    round: RoundInfo
    session: int
    credential: bytes
    coordinator_public_key: bytes
    protocol: int
    def __init__(self, peer_id: _Optional[str] = ..., run_id: _Optional[str] = ..., run_spec_json: _Optional[str] = ..., dht_initial_peers: _Optional[_Iterable[str]] = ..., heartbeat_interval_s: _Optional[float] = ..., lease_s: _Optional[float] = ..., peer_index: _Optional[int] = ..., round: _Optional[_Union[RoundInfo, _Mapping]] = ..., session: _Optional[int] = ..., credential: _Optional[bytes] = ..., coordinator_public_key: _Optional[bytes] = ..., protocol: _Optional[int] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "outcome", "participants", "committed_hash", "holders", "last_committed_round", "last_committed_hash", "finished", "open_round", "live_peers", "behind_peers", "choice", "plan", "participant_dht_ids", "participant_count", "poll_interval_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_FIELD_NUMBER: _ClassVar[int]
    LIVE_PEERS_FIELD_NUMBER: _ClassVar[int]
    BEHIND_PEERS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_DHT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANT_COUNT_FIELD_NUMBER: _ClassVar[int]
    POLL_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    round: int
    outcome: RoundOutcome
    participants: _containers.RepeatedScalarFieldContainer[str]
    committed_hash: str
    holders: _containers.RepeatedScalarFieldContainer[str]
    last_committed_round: int
    last_committed_hash: str
    finished: bool
    open_round: int
    live_peers: int
    behind_peers: int
    choice: RoundChoice
    plan: RoundPlan
    participant_dht_ids: _containers.RepeatedScalarFieldContainer[str]
    participant_count: int
    poll_interval_s: float
    def __init__(self, round: _Optional[int] = ..., outcome: _Optional[_Union[RoundOutcome, str]] = ..., participants: _Optional[_Iterable[str]] = ..., committed_hash: _Optional[str] = ..., holders: _Optional[_Iterable[str]] = ..., last_committed_round: _Optional[int] = ..., last_committed_hash: _Optional[str] = ..., finished: _Optional[bool] = ..., open_round: _Optional[int] = ..., live_peers: _Optional[int] = ..., behind_peers: _Optional[int] = ..., choice: _Optional[_Union[RoundChoice, _Mapping]] = ..., plan: _Optional[_Union[RoundPlan, _Mapping]] = ..., participant_dht_ids: _Optional[_Iterable[str]] = ..., participant_count: _Optional[int] = ..., poll_interval_s: _Optional[float] = ...) -> None: ...

class RoundChoice(_message.Message):
    __slots__ = ("codec", "shares", "inner_steps", "fragments", "overlap_steps", "reason", "predicted_exchange_s", "window_s", "round")
    class SharesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    codec: str
    shares: _containers.ScalarMap[str, float]
    inner_steps: int
    fragments: int
    overlap_steps: int
    reason: str
    predicted_exchange_s: float
    window_s: float
    round: int
    def __init__(self, codec: _Optional[str] = ..., shares: _Optional[_Mapping[str, float]] = ..., inner_steps: _Optional[int] = ..., fragments: _Optional[int] = ..., overlap_steps: _Optional[int] = ..., reason: _Optional[str] = ..., predicted_exchange_s: _Optional[float] = ..., window_s: _Optional[float] = ..., round: _Optional[int] = ...) -> None: ...

class RoundPlan(_message.Message):
    __slots__ = ("budget_s", "deadline_s", "peers", "left_out")
    BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    budget_s: float
    deadline_s: float
    peers: _containers.RepeatedCompositeFieldContainer[PlannedPeer]
    left_out: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, budget_s: _Optional[float] = ..., deadline_s: _Optional[float] = ..., peers: _Optional[_Iterable[_Union[PlannedPeer, _Mapping]]] = ..., left_out: _Optional[_Iterable[str]] = ...) -> None: ...

class PlannedPeer(_message.Message):
    __slots__ = ("peer_id", "inner_steps", "step_time_s")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    inner_steps: int
    step_time_s: float
    def __init__(self, peer_id: _Optional[str] = ..., inner_steps: _Optional[int] = ..., step_time_s: _Optional[float] = ...) -> None: ...

class PeerMetrics(_message.Message):
    __slots__ = ("state", "round", "state_hash", "state_round", "model_fingerprint", "param_count", "dht_peer_id", "dht_maddrs", "loss", "step_time_s", "tokens_per_s", "eval_loss", "eval_round", "inner_time_s", "wall_time_s", "inner_steps", "tokens", "bytes_sent", "bytes_received", "contributions_rejected", "contributions_clipped", "foreign_messages_dropped", "upload_mbit_s", "download_mbit_s", "rtt_ms", "step_time_probed")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_ROUND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    DHT_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    DHT_MADDRS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROUND_FIELD_NUMBER: _ClassVar[int]
    INNER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBIT_S_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBIT_S_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_PROBED_FIELD_NUMBER: _ClassVar[int]
    state: PeerState
    round: int
    state_hash: str
    state_round: int
    model_fingerprint: str
    param_count: int
    dht_peer_id: str
    dht_maddrs: _containers.RepeatedScalarFieldContainer[str]
    loss: float
    step_time_s: float
    tokens_per_s: float
    eval_loss: float
    eval_round: int
    inner_time_s: float
    wall_time_s: float
    inner_steps: int
    tokens: int
    bytes_sent: int
    bytes_received: int
    contributions_rejected: int
    contributions_clipped: int
    foreign_messages_dropped: int
    upload_mbit_s: float
    download_mbit_s: float
    rtt_ms: float
    step_time_probed: bool
    def __init__(self, state: _Optional[_Union[PeerState, str]] = ..., round: _Optional[int] = ..., state_hash: _Optional[str] = ..., state_round: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., param_count: _Optional[int] = ..., dht_peer_id: _Optional[str] = ..., dht_maddrs: _Optional[_Iterable[str]] = ..., loss: _Optional[float] = ..., step_time_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., eval_loss: _Optional[float] = ..., eval_round: _Optional[int] = ..., inner_time_s: _Optional[float] = ..., wall_time_s: _Optional[float] = ..., inner_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., contributions_rejected: _Optional[int] = ..., contributions_clipped: _Optional[int] = ..., foreign_messages_dropped: _Optional[int] = ..., upload_mbit_s: _Optional[float] = ..., download_mbit_s: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., step_time_probed: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("peer_id", "metrics")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    metrics: PeerMetrics
    def __init__(self, peer_id: _Optional[str] = ..., metrics: _Optional[_Union[PeerMetrics, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("round", "lease_s", "credential", "heartbeat_interval_s")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    round: RoundInfo
    lease_s: float
    credential: bytes
    heartbeat_interval_s: float
    def __init__(self, round: _Optional[_Union[RoundInfo, _Mapping]] = ..., lease_s: _Optional[float] = ..., credential: _Optional[bytes] = ..., heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("peer_id", "reason")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    reason: str
    def __init__(self, peer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportRoundRequest(_message.Message):
    __slots__ = ("peer_id", "round", "ok", "state_hash", "group", "samples", "inner_steps", "inner_time_s", "exchange_time_s", "bytes_sent", "bytes_received", "loss", "error", "param_count", "upload_mbit_s", "download_mbit_s", "rtt_ms", "group_votes", "group_digest", "group_size")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    INNER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBIT_S_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBIT_S_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    GROUP_VOTES_FIELD_NUMBER: _ClassVar[int]
    GROUP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    ok: bool
    state_hash: str
    group: _containers.RepeatedScalarFieldContainer[str]
    samples: int
    inner_steps: int
    inner_time_s: float
    exchange_time_s: float
    bytes_sent: int
    bytes_received: int
    loss: float
    error: str
    param_count: int
    upload_mbit_s: float
    download_mbit_s: float
    rtt_ms: float
    group_votes: _containers.RepeatedCompositeFieldContainer[SignedVote]
    group_digest: str
    group_size: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., ok: _Optional[bool] = ..., state_hash: _Optional[str] = ..., group: _Optional[_Iterable[str]] = ..., samples: _Optional[int] = ..., inner_steps: _Optional[int] = ..., inner_time_s: _Optional[float] = ..., exchange_time_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., loss: _Optional[float] = ..., error: _Optional[str] = ..., param_count: _Optional[int] = ..., upload_mbit_s: _Optional[float] = ..., download_mbit_s: _Optional[float] = ..., rtt_ms: _Optional[float] = ..., group_votes: _Optional[_Iterable[_Union[SignedVote, _Mapping]]] = ..., group_digest: _Optional[str] = ..., group_size: _Optional[int] = ...) -> None: ...

class SignedVote(_message.Message):
    __slots__ = ("peer_id", "key", "body", "credential", "signature")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    key: str
    body: bytes
    credential: bytes
    signature: bytes
    def __init__(self, peer_id: _Optional[str] = ..., key: _Optional[str] = ..., body: _Optional[bytes] = ..., credential: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ReportRoundResponse(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: RoundInfo
    def __init__(self, round: _Optional[_Union[RoundInfo, _Mapping]] = ...) -> None: ...

class GetRoundRequest(_message.Message):
    __slots__ = ("peer_id", "round")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("token", "page_size", "page_token")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    page_size: int
    page_token: str
    def __init__(self, token: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_id", "open_round", "rounds_committed", "rounds_voided", "committed_hash", "eval_loss", "eval_round", "initial_eval_loss", "finished", "max_rounds", "inner_steps", "codec", "model_preset", "param_count", "loss", "uptime_s", "committed_round", "fragments", "overlap_steps", "outer_optimizer", "error_feedback", "aggregation", "model", "model_source", "controller")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    OPEN_ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_VOIDED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROUND_FIELD_NUMBER: _ClassVar[int]
    INITIAL_EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_PRESET_FIELD_NUMBER: _ClassVar[int]
    PARAM_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_ROUND_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    open_round: int
    rounds_committed: int
    rounds_voided: int
    committed_hash: str
    eval_loss: float
    eval_round: int
    initial_eval_loss: float
    finished: bool
    max_rounds: int
    inner_steps: int
    codec: str
    model_preset: str
    param_count: int
    loss: float
    uptime_s: float
    committed_round: int
    fragments: int
    overlap_steps: int
    outer_optimizer: str
    error_feedback: bool
    aggregation: str
    model: str
    model_source: str
    controller: RoundChoice
    def __init__(self, run_id: _Optional[str] = ..., open_round: _Optional[int] = ..., rounds_committed: _Optional[int] = ..., rounds_voided: _Optional[int] = ..., committed_hash: _Optional[str] = ..., eval_loss: _Optional[float] = ..., eval_round: _Optional[int] = ..., initial_eval_loss: _Optional[float] = ..., finished: _Optional[bool] = ..., max_rounds: _Optional[int] = ..., inner_steps: _Optional[int] = ..., codec: _Optional[str] = ..., model_preset: _Optional[str] = ..., param_count: _Optional[int] = ..., loss: _Optional[float] = ..., uptime_s: _Optional[float] = ..., committed_round: _Optional[int] = ..., fragments: _Optional[int] = ..., overlap_steps: _Optional[int] = ..., outer_optimizer: _Optional[str] = ..., error_feedback: _Optional[bool] = ..., aggregation: _Optional[str] = ..., model: _Optional[str] = ..., model_source: _Optional[str] = ..., controller: _Optional[_Union[RoundChoice, _Mapping]] = ...) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("id", "name", "site", "state", "device", "rounds_joined", "rounds_missed", "last_seen_s", "compute_utilization", "metrics", "restarts")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_JOINED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_MISSED_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    site: str
    state: str
    device: str
    rounds_joined: int
    rounds_missed: int
    last_seen_s: float
    compute_utilization: float
    metrics: PeerMetrics
    restarts: int
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., site: _Optional[str] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., rounds_joined: _Optional[int] = ..., rounds_missed: _Optional[int] = ..., last_seen_s: _Optional[float] = ..., compute_utilization: _Optional[float] = ..., metrics: _Optional[_Union[PeerMetrics, _Mapping]] = ..., restarts: _Optional[int] = ...) -> None: ...

class Totals(_message.Message):
    __slots__ = ("bytes_sent", "bytes_received", "ddp_equivalent_bytes", "compute_utilization", "tokens", "inner_steps", "inner_time_s", "wall_time_s", "contributions_rejected", "contributions_clipped", "foreign_messages_dropped")
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DDP_EQUIVALENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    INNER_TIME_S_FIELD_NUMBER: _ClassVar[int]
    WALL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTIONS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    FOREIGN_MESSAGES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    bytes_sent: int
    bytes_received: int
    ddp_equivalent_bytes: int
    compute_utilization: float
    tokens: int
    inner_steps: int
    inner_time_s: float
    wall_time_s: float
    contributions_rejected: int
    contributions_clipped: int
    foreign_messages_dropped: int
    def __init__(self, bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., ddp_equivalent_bytes: _Optional[int] = ..., compute_utilization: _Optional[float] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., inner_time_s: _Optional[float] = ..., wall_time_s: _Optional[float] = ..., contributions_rejected: _Optional[int] = ..., contributions_clipped: _Optional[int] = ..., foreign_messages_dropped: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("run", "peers", "totals", "next_page_token", "peers_omitted")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PEERS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    run: RunStatus
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    totals: Totals
    next_page_token: str
    peers_omitted: int
    def __init__(self, run: _Optional[_Union[RunStatus, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., totals: _Optional[_Union[Totals, _Mapping]] = ..., next_page_token: _Optional[str] = ..., peers_omitted: _Optional[int] = ...) -> None: ...

class GetHistoryRequest(_message.Message):
    __slots__ = ("token", "after_round", "max_rounds")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    AFTER_ROUND_FIELD_NUMBER: _ClassVar[int]
    MAX_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    token: str
    after_round: int
    max_rounds: int
    def __init__(self, token: _Optional[str] = ..., after_round: _Optional[int] = ..., max_rounds: _Optional[int] = ...) -> None: ...

class RoundHistory(_message.Message):
    __slots__ = ("round", "outcome", "opened_at", "decided_at", "participants", "reported", "holders", "group_size", "codec", "inner_steps", "fragments", "bytes_sent", "bytes_received", "ddp_equivalent_bytes", "exchange_s", "inner_s", "mean_loss", "eval_loss", "tokens", "utilization", "committed_hash", "reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    OPENED_AT_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    REPORTED_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DDP_EQUIVALENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    INNER_S_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_HASH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    outcome: RoundOutcome
    opened_at: float
    decided_at: float
    participants: int
    reported: int
    holders: int
    group_size: int
    codec: str
    inner_steps: int
    fragments: int
    bytes_sent: int
    bytes_received: int
    ddp_equivalent_bytes: int
    exchange_s: float
    inner_s: float
    mean_loss: float
    eval_loss: float
    tokens: int
    utilization: float
    committed_hash: str
    reason: str
    def __init__(self, round: _Optional[int] = ..., outcome: _Optional[_Union[RoundOutcome, str]] = ..., opened_at: _Optional[float] = ..., decided_at: _Optional[float] = ..., participants: _Optional[int] = ..., reported: _Optional[int] = ..., holders: _Optional[int] = ..., group_size: _Optional[int] = ..., codec: _Optional[str] = ..., inner_steps: _Optional[int] = ..., fragments: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., ddp_equivalent_bytes: _Optional[int] = ..., exchange_s: _Optional[float] = ..., inner_s: _Optional[float] = ..., mean_loss: _Optional[float] = ..., eval_loss: _Optional[float] = ..., tokens: _Optional[int] = ..., utilization: _Optional[float] = ..., committed_hash: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PeerRoundHistory(_message.Message):
    __slots__ = ("round", "peer_id", "site", "ok", "holder", "loss", "inner_s", "exchange_s", "bytes_sent", "tokens_per_s", "step_time_s", "upload_mbit_s", "download_mbit_s", "rtt_ms")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    INNER_S_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_MBIT_S_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_MBIT_S_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    round: int
    peer_id: str
    site: str
    ok: bool
    holder: bool
    loss: float
    inner_s: float
    exchange_s: float
    bytes_sent: int
    tokens_per_s: float
    step_time_s: float
    upload_mbit_s: float
    download_mbit_s: float
    rtt_ms: float
    def __init__(self, round: _Optional[int] = ..., peer_id: _Optional[str] = ..., site: _Optional[str] = ..., ok: _Optional[bool] = ..., holder: _Optional[bool] = ..., loss: _Optional[float] = ..., inner_s: _Optional[float] = ..., exchange_s: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., step_time_s: _Optional[float] = ..., upload_mbit_s: _Optional[float] = ..., download_mbit_s: _Optional[float] = ..., rtt_ms: _Optional[float] = ...) -> None: ...

class GetHistoryResponse(_message.Message):
    __slots__ = ("rounds", "peer_rounds", "more")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PEER_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundHistory]
    peer_rounds: _containers.RepeatedCompositeFieldContainer[PeerRoundHistory]
    more: bool
    def __init__(self, rounds: _Optional[_Iterable[_Union[RoundHistory, _Mapping]]] = ..., peer_rounds: _Optional[_Iterable[_Union[PeerRoundHistory, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...
