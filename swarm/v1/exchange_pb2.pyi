from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_CONTRIBUTION: _ClassVar[Phase]
    PHASE_AVERAGED: _ClassVar[Phase]
    PHASE_ABORT: _ClassVar[Phase]
PHASE_UNSPECIFIED: Phase
PHASE_CONTRIBUTION: Phase
PHASE_AVERAGED: Phase
PHASE_ABORT: Phase

class TensorChunk(_message.Message):
    __slots__ = ("key", "group_digest", "phase", "part", "sender", "chunk", "num_chunks", "data", "bulk_claims")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BULK_CLAIMS_FIELD_NUMBER: _ClassVar[int]
    key: str
    group_digest: str
    phase: Phase
    part: int
    sender: int
    chunk: int
    num_chunks: int
    data: bytes
    bulk_claims: _containers.RepeatedCompositeFieldContainer[BulkClaim]
    def __init__(self, key: _Optional[str] = ..., group_digest: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., part: _Optional[int] = ..., sender: _Optional[int] = ..., chunk: _Optional[int] = ..., num_chunks: _Optional[int] = ..., data: _Optional[bytes] = ..., bulk_claims: _Optional[_Iterable[_Union[BulkClaim, _Mapping]]] = ...) -> None: ...

class BulkClaim(_message.Message):
    __slots__ = ("phase", "part", "mac_key", "max_bytes", "ticket")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    MAC_KEY_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    phase: Phase
    part: int
    mac_key: bytes
    max_bytes: int
    ticket: bytes
    def __init__(self, phase: _Optional[_Union[Phase, str]] = ..., part: _Optional[int] = ..., mac_key: _Optional[bytes] = ..., max_bytes: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class BulkHeader(_message.Message):
    __slots__ = ("key", "group_digest", "phase", "part", "sender", "tag", "length", "ticket")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GROUP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    key: str
    group_digest: str
    phase: Phase
    part: int
    sender: int
    tag: bytes
    length: int
    ticket: bytes
    def __init__(self, key: _Optional[str] = ..., group_digest: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., part: _Optional[int] = ..., sender: _Optional[int] = ..., tag: _Optional[bytes] = ..., length: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ChunkAck(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("round", "offset", "length", "credential", "bulk_address", "bulk_key", "bulk_part", "bulk_ticket", "bulk_mac_key")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    BULK_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BULK_KEY_FIELD_NUMBER: _ClassVar[int]
    BULK_PART_FIELD_NUMBER: _ClassVar[int]
    BULK_TICKET_FIELD_NUMBER: _ClassVar[int]
    BULK_MAC_KEY_FIELD_NUMBER: _ClassVar[int]
    round: int
    offset: int
    length: int
    credential: bytes
    bulk_address: str
    bulk_key: str
    bulk_part: int
    bulk_ticket: bytes
    bulk_mac_key: bytes
    def __init__(self, round: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., credential: _Optional[bytes] = ..., bulk_address: _Optional[str] = ..., bulk_key: _Optional[str] = ..., bulk_part: _Optional[int] = ..., bulk_ticket: _Optional[bytes] = ..., bulk_mac_key: _Optional[bytes] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("round", "state_hash", "total_bytes", "offset", "data", "error", "bulk")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    round: int
    state_hash: str
    total_bytes: int
    offset: int
    data: bytes
    error: str
    bulk: bool
    def __init__(self, round: _Optional[int] = ..., state_hash: _Optional[str] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., error: _Optional[str] = ..., bulk: _Optional[bool] = ...) -> None: ...
