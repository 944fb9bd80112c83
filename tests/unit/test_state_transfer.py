"""The global state's one format (safetensors round trip, strict parsing) and its download between two
real transports, over the downloader's bulk channel and over libp2p alone."""

from __future__ import annotations

import json
import struct
from typing import Iterator

import numpy as np
import pytest
import torch
from hivemind.p2p import PeerID
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from testbed.members import make_member

from swarm.core.safetensors_io import tensors_from_buffer
from swarm.core.state import (
    EncodedState,
    GlobalState,
    decode_state,
    encode_state,
    encoded_size_bound,
    state_tensors,
)
from swarm.core.trust.credential import Member, PeerKey
from swarm.net.bulk import state_transfer
from swarm.net.bulk.state_server import StateServer
from swarm.net.bulk.state_transfer import StateUnavailable, download_state
from swarm.net.bulk.transport import CHUNK_BYTES, Transport
from swarm.v1 import exchange_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

SHAPES = [torch.Size([400, 700]), torch.Size([700]), torch.Size([3, 4, 5])]  # over 1 MiB: several chunks


def make_state(round_no: int, seed: int, shapes: list[torch.Size] = SHAPES) -> GlobalState:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in shapes]
    outer = [torch.randn(s, generator=generator) for s in shapes]
    return GlobalState(round_no, params, outer)


LIKE = make_state(0, seed=0)
COORDINATOR = PeerKey.generate()


def member_of(transport: Transport, run_id: str, **options) -> Member:
    """A member of ``run_id`` on ``transport`` (its credential names that transport's libp2p id)."""
    return make_member(COORDINATOR, run_id, transport.peer_id, **options)


def assert_same_state(actual: GlobalState, expected: GlobalState) -> None:
    assert actual.round_no == expected.round_no
    assert actual.state_hash == expected.state_hash
    assert len(actual.params) == len(expected.params) and len(actual.outer_state) == len(expected.outer_state)
    for a, e in zip(actual.params + actual.outer_state, expected.params + expected.outer_state):
        assert torch.equal(a, e)


def test_encode_then_decode_gives_the_same_tensors_and_hash() -> None:
    state = make_state(7, seed=1)
    assert_same_state(decode_state(encode_state(state), 7, like=LIKE), state)
    assert len(encode_state(state)) <= encoded_size_bound(LIKE)


def test_the_hash_is_computed_from_the_data_never_taken_from_the_metadata() -> None:
    from safetensors.torch import save

    from swarm.core.state import state_tensors

    state = make_state(7, seed=1)
    lying = save(state_tensors(state), metadata={"round_no": "7", "state_hash": "0" * 16})
    assert decode_state(lying, 7, like=LIKE).state_hash == state.state_hash


def test_decode_rejects_other_shapes() -> None:
    blob = encode_state(make_state(1, seed=2))
    like = make_state(0, seed=0, shapes=[SHAPES[0], torch.Size([701]), SHAPES[2]])
    with pytest.raises(ValueError, match="another model"):
        decode_state(blob, 1, like=like)


def test_decode_rejects_a_state_with_tensors_missing_or_extra() -> None:
    blob = encode_state(make_state(1, seed=2, shapes=SHAPES[:2]))
    with pytest.raises(ValueError, match="different set of tensors"):
        decode_state(blob, 1, like=LIKE)
    with pytest.raises(ValueError, match="different set of tensors"):
        decode_state(blob, 1, like=make_state(0, seed=0, shapes=SHAPES[:1]))


def test_decode_rejects_other_dtypes_and_values_that_are_not_finite() -> None:
    state = make_state(1, seed=3)
    doubles = GlobalState(1, [p.double() for p in state.params], state.outer_state)
    with pytest.raises(ValueError, match="another model"):
        decode_state(encode_state(doubles), 1, like=LIKE)
    state.params[1][3] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        decode_state(encode_state(GlobalState(1, state.params, state.outer_state)), 1, like=LIKE)


@pytest.mark.parametrize("blob", [b"", b"not a snapshot", b"\xff" * 64])
def test_decode_rejects_garbage_bytes(blob: bytes) -> None:
    with pytest.raises(ValueError, match="not valid safetensors"):
        decode_state(blob, 1, like=LIKE)


def test_decode_rejects_a_truncated_state() -> None:
    blob = encode_state(make_state(1, seed=4))
    with pytest.raises(ValueError):
        decode_state(blob[: len(blob) // 2], 1, like=LIKE)


def _split(blob: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def test_the_served_bytes_are_encode_states_and_safetensors_own_layout() -> None:
    state = make_state(7, seed=1)
    served = EncodedState(state)
    blob = encode_state(state)
    assert served.size == len(blob) <= encoded_size_bound(LIKE)
    for step in (1 << 20, 999_999, 4096):  # chunks across the header's end and the tensors' boundaries
        assert b"".join(served.read(offset, step) for offset in range(0, served.size, step)) == blob
        assert b"".join(bytes(served.view(offset, step)) for offset in range(0, served.size, step)) == blob
    # safetensors' own encoding of the state: the same header (its metadata order is random) and the same bytes
    reference = save_safetensors(state_tensors(state), metadata={"round_no": "7", "state_hash": state.state_hash})
    assert len(reference) == len(blob)
    assert _split(reference) == _split(blob)
    loaded = load_safetensors(blob)
    assert all(torch.equal(loaded[name], t) for name, t in state_tensors(state).items())


def test_a_decoded_state_views_a_writable_buffer_and_copies_a_read_only_one() -> None:
    state = make_state(7, seed=1)
    buffer = np.frombuffer(bytearray(encode_state(state)), dtype=np.uint8)
    decoded = decode_state(buffer, 7, like=LIKE)
    address = buffer.ctypes.data
    assert all(address <= t.data_ptr() < address + buffer.nbytes for t in decoded.params + decoded.outer_state)
    del buffer  # the tensors keep it alive
    assert_same_state(decoded, state)
    copied = decode_state(encode_state(state), 7, like=LIKE)
    assert_same_state(copied, state)
    copied.params[0][0, 0] = 1.0  # its own memory: writable


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@pytest.mark.parametrize(
    "header, data, why",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            bytes(12),
            "overlap",
        ),
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
            },
            bytes(16),
            "gap",
        ),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "takes 12 bytes"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12), "holds 12"),
        ({"a": {"dtype": "X9", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), "dtype"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), "shape"),
        ({"__metadata__": {"round_no": 3}}, b"", "metadata"),
    ],
)
def test_a_header_that_does_not_describe_its_bytes_exactly_is_refused(header: dict, data: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        tensors_from_buffer(_with_header(header, data))
    # the same layout, well formed, reads
    assert (
        len(load_safetensors(_with_header({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))))
        == 1
    )


def test_a_header_longer_than_its_buffer_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        tensors_from_buffer(struct.pack("<Q", 1 << 40) + b"{}")


@pytest.fixture(scope="module")
def transports() -> Iterator[tuple[Transport, Transport]]:
    started: list[Transport] = []
    try:
        started.append(Transport(initial_peers=[]))
        started.append(Transport(initial_peers=started[0].visible_maddrs))
        yield started[0], started[1]
    finally:
        for t in reversed(started):
            t.shutdown()


@pytest.fixture(params=["bulk", "libp2p"])
def path(request, monkeypatch) -> str:
    """Download over the downloader's bulk channel (frames of 1 MiB: several per test state), or libp2p alone."""
    monkeypatch.setattr(state_transfer, "USE_BULK", request.param == "bulk")
    monkeypatch.setattr(state_transfer, "BULK_FRAME_BYTES", CHUNK_BYTES)
    return request.param


def frames_taken(transport: Transport) -> int:
    return transport.bulk.frames_taken if transport.bulk is not None else 0


def test_a_published_state_downloads_intact(transports: tuple[Transport, Transport], path: str) -> None:
    holder, fetcher = transports
    taken = frames_taken(fetcher)
    server = StateServer(holder, run_id=f"run-intact-{path}", member=member_of(holder, f"run-intact-{path}"))
    state = make_state(5, seed=5)
    server.publish(state)
    blob_size = len(encode_state(state))
    assert blob_size > 2 * CHUNK_BYTES

    fetched, nbytes = download_state(
        fetcher,
        member=member_of(fetcher, f"run-intact-{path}"),
        run_id=f"run-intact-{path}",
        holders=[holder.peer_id],
        round_no=5,
        expected_hash=state.state_hash,
        like=LIKE,
        timeout_s=30,
    )

    assert_same_state(fetched, state)
    assert nbytes == blob_size
    assert (frames_taken(fetcher) - taken >= 2) == (path == "bulk"), "the bytes did not come the way asked"


def test_the_first_holder_with_the_right_state_wins(transports: tuple[Transport, Transport], path: str) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id=f"run-skip-{path}", member=member_of(holder, f"run-skip-{path}"))
    state = make_state(2, seed=6)
    server.publish(state)
    # the fetcher's own id is skipped, not asked
    fetched, _ = download_state(
        fetcher,
        member=member_of(fetcher, f"run-skip-{path}"),
        run_id=f"run-skip-{path}",
        holders=[fetcher.peer_id, holder.peer_id],
        round_no=2,
        expected_hash=state.state_hash,
        like=LIKE,
        timeout_s=30,
    )
    assert_same_state(fetched, state)


def test_a_holder_of_another_round_is_refused(transports: tuple[Transport, Transport], path: str) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id=f"run-other-round-{path}", member=member_of(holder, f"run-other-round-{path}"))
    state = make_state(3, seed=7)
    server.publish(state)

    with pytest.raises(StateUnavailable) as failure:
        download_state(
            fetcher,
            member=member_of(fetcher, f"run-other-round-{path}"),
            run_id=f"run-other-round-{path}",
            holders=[holder.peer_id],
            round_no=4,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )
    message = str(failure.value)
    assert "round 4" in message and "holds round 3" in message


def test_a_state_with_another_hash_is_refused(transports: tuple[Transport, Transport], path: str) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id=f"run-other-hash-{path}", member=member_of(holder, f"run-other-hash-{path}"))
    state = make_state(3, seed=8)
    server.publish(state)
    committed = make_state(3, seed=9).state_hash  # the round committed a different state than the holder has

    with pytest.raises(StateUnavailable) as failure:
        download_state(
            fetcher,
            member=member_of(fetcher, f"run-other-hash-{path}"),
            run_id=f"run-other-hash-{path}",
            holders=[holder.peer_id],
            round_no=3,
            expected_hash=committed,
            like=LIKE,
            timeout_s=30,
        )
    message = str(failure.value)
    assert f"served hash {state.state_hash}" in message and f"committed is {committed}" in message


def test_no_holders_is_unavailable(transports: tuple[Transport, Transport]) -> None:
    _, fetcher = transports
    with pytest.raises(StateUnavailable, match="no holders"):
        download_state(
            fetcher,
            member=member_of(fetcher, "run-none"),
            run_id="run-none",
            holders=[fetcher.peer_id],
            round_no=1,
            expected_hash="0" * 16,
            like=LIKE,
            timeout_s=5,
        )


def test_download_spreads_over_holders_and_survives_a_bad_one(
    transports: tuple[Transport, Transport], path: str
) -> None:
    holder, fetcher = transports
    third = Transport(initial_peers=holder.visible_maddrs)
    try:
        good = StateServer(holder, run_id=f"run-striped-{path}", member=member_of(holder, f"run-striped-{path}"))
        liar = LyingStateServer(third, run_id=f"run-striped-{path}", member=member_of(third, f"run-striped-{path}"))
        state = make_state(5, seed=4, shapes=[torch.Size([3 * CHUNK_BYTES // 8 + 5])])  # ~3 MiB, several chunks
        params = state.params
        good.publish(state)
        # The liar claims the committed hash but serves other numbers: striping fails the hash check,
        # then each holder alone is tried and the honest one wins.
        liar.publish_as(GlobalState(5, [params[0] + 1], state.outer_state), claimed_hash=state.state_hash)
        loaded, nbytes = download_state(
            fetcher,
            member=member_of(fetcher, f"run-striped-{path}"),
            run_id=f"run-striped-{path}",
            holders=[third.peer_id, holder.peer_id],
            round_no=5,
            expected_hash=state.state_hash,
            like=state,
            timeout_s=60,
        )
        assert loaded.state_hash == state.state_hash and nbytes > 2 * CHUNK_BYTES
        assert torch.equal(loaded.params[0], params[0])
    finally:
        third.shutdown()


class LyingStateServer(StateServer):
    """Announces one hash and serves the bytes of another state."""

    def publish_as(self, state: GlobalState, *, claimed_hash: str) -> None:
        self.publish(state)
        with self._lock:
            self._hash = claimed_hash


class HugeStateServer(StateServer):
    """Announces a state of ``announced`` bytes."""

    def __init__(self, *args, announced: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.announced = announced

    async def _on_request(self, request, context):
        chunk = await super()._on_request(request, context)
        chunk.total_bytes = self.announced
        return chunk


@pytest.mark.parametrize("announced", [1 << 62, encoded_size_bound(LIKE) + 1])
def test_a_holder_announcing_a_huge_state_is_refused_before_anything_is_allocated(
    transports: tuple[Transport, Transport], announced: int, monkeypatch
) -> None:
    holder, fetcher = transports
    run_id = f"run-huge-{announced}"
    state = make_state(6, seed=12)
    allocated: list[int] = []
    real_allocate = state_transfer._allocate

    def allocate(nbytes: int):
        allocated.append(nbytes)
        return real_allocate(nbytes)

    monkeypatch.setattr(state_transfer, "_allocate", allocate)  # what the download allocates its buffer with
    HugeStateServer(holder, run_id=run_id, member=member_of(holder, run_id), announced=announced).publish(state)
    with pytest.raises(StateUnavailable, match=f"announced a state of {announced} bytes"):
        download_state(
            fetcher,
            member=member_of(fetcher, run_id),
            run_id=run_id,
            holders=[holder.peer_id],
            round_no=6,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )
    assert announced not in allocated


class DyingStateServer(StateServer):
    """Serves two chunks, then fails every request: a holder that dies in the middle of a download."""

    served = 0

    async def _on_request(self, request, context):
        self.served += 1
        if self.served > 2:
            raise ConnectionError("holder died")
        return await super()._on_request(request, context)


def test_download_resumes_on_another_holder_when_its_source_dies_mid_way(
    transports: tuple[Transport, Transport], path: str
) -> None:
    holder, fetcher = transports
    second = Transport(initial_peers=holder.visible_maddrs)
    try:
        dying = DyingStateServer(holder, run_id=f"run-resume-{path}", member=member_of(holder, f"run-resume-{path}"))
        healthy = StateServer(second, run_id=f"run-resume-{path}", member=member_of(second, f"run-resume-{path}"))
        state = make_state(2, seed=11, shapes=[torch.Size([4 * CHUNK_BYTES // 8])])  # params + outer: 8 chunks
        dying.publish(state)
        healthy.publish(state)
        loaded, _ = download_state(
            fetcher,
            member=member_of(fetcher, f"run-resume-{path}"),
            run_id=f"run-resume-{path}",
            holders=[holder.peer_id, second.peer_id],
            round_no=2,
            expected_hash=state.state_hash,
            like=state,
            timeout_s=60,
        )
        assert loaded.state_hash == state.state_hash
        assert dying.served >= 3, "the dying holder was never asked for a chunk after it failed"
    finally:
        second.shutdown()


class MisplacingStateServer(StateServer):
    """Serves each chunk with more bytes than asked for, or at another offset than asked."""

    def __init__(self, *args, lie: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lie = lie

    async def _on_request(self, request, context):
        chunk = await super()._on_request(request, context)
        if request.length and self.lie == "longer":
            chunk.data = chunk.data + b"\0" * 1000
        elif request.length and self.lie == "offset":
            chunk.offset += 8
        elif request.length and self.lie == "shorter":  # less than a whole MiB: no progress it could be held to
            chunk.data = chunk.data[:1000]
        return chunk


def test_a_state_stepped_in_place_after_it_was_published_is_no_longer_served(
    transports: tuple[Transport, Transport], path: str
) -> None:
    """The trainer commits a Nesterov round into the committed tensors: the bytes served until the next publish
    would be the next round's under this round's name, so the holder refuses instead."""
    holder, fetcher = transports
    run_id = f"run-stepped-{path}"
    server = StateServer(holder, run_id=run_id, member=member_of(holder, run_id))
    state = make_state(4, seed=16)
    server.publish(state)
    with torch.no_grad():
        state.params[0].add_(1.0)  # what TentativeState.commit_in_place does to the published tensors
    with pytest.raises(StateUnavailable, match="moved on from round 4"):
        download_state(
            fetcher,
            member=member_of(fetcher, run_id),
            run_id=run_id,
            holders=[holder.peer_id],
            round_no=4,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )
    stepped = GlobalState(5, state.params, state.outer_state)
    server.publish(stepped)  # the next round's state, published after its commit: served again
    loaded, _ = download_state(
        fetcher,
        member=member_of(fetcher, run_id),
        run_id=run_id,
        holders=[holder.peer_id],
        round_no=5,
        expected_hash=stepped.state_hash,
        like=LIKE,
        timeout_s=30,
    )
    assert_same_state(loaded, stepped)


class SilentBulkServer(StateServer):
    """Answers every bulk request with "sent over your bulk channel" without sending a byte."""

    async def _send_bulk(self, request, served) -> bool:
        return True


def test_a_holder_that_says_it_sent_over_the_bulk_channel_and_did_not_is_refused(
    transports: tuple[Transport, Transport], path: str
) -> None:
    holder, fetcher = transports
    run_id = f"run-silent-{path}"
    state = make_state(8, seed=13)
    SilentBulkServer(holder, run_id=run_id, member=member_of(holder, run_id)).publish(state)
    if path == "libp2p":  # not asked to use the bulk channel, it serves over libp2p as usual
        loaded, _ = download_state(
            fetcher,
            member=member_of(fetcher, run_id),
            run_id=run_id,
            holders=[holder.peer_id],
            round_no=8,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )
        assert_same_state(loaded, state)
        return
    with pytest.raises(StateUnavailable, match="over the bulk channel, which took none"):
        download_state(
            fetcher,
            member=member_of(fetcher, run_id),
            run_id=run_id,
            holders=[holder.peer_id],
            round_no=8,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )


def test_a_holder_that_cannot_reach_the_bulk_channel_serves_over_libp2p(
    transports: tuple[Transport, Transport], monkeypatch
) -> None:
    holder, fetcher = transports
    monkeypatch.setattr(state_transfer, "BULK_FRAME_BYTES", 3 * CHUNK_BYTES)
    run_id = "run-unreachable"
    state = make_state(8, seed=15)
    server = StateServer(holder, run_id=run_id, member=member_of(holder, run_id))
    server.publish(state)

    async def unreachable(request, served) -> bool:
        return False  # as when the requester's bulk address cannot be dialled

    monkeypatch.setattr(server, "_send_bulk", unreachable)
    loaded, _ = download_state(
        fetcher,
        member=member_of(fetcher, run_id),
        run_id=run_id,
        holders=[holder.peer_id],
        round_no=8,
        expected_hash=state.state_hash,
        like=LIKE,
        timeout_s=30,
    )
    assert_same_state(loaded, state)


@pytest.mark.parametrize("lie", ["longer", "offset", "shorter"])
def test_a_holder_serving_chunks_of_another_size_or_offset_is_refused(
    transports: tuple[Transport, Transport], lie: str, monkeypatch
) -> None:
    monkeypatch.setattr(state_transfer, "USE_BULK", False)
    holder, fetcher = transports
    run_id = f"run-misplaced-{lie}"
    state = make_state(8, seed=13)
    MisplacingStateServer(holder, run_id=run_id, member=member_of(holder, run_id), lie=lie).publish(state)
    with pytest.raises(StateUnavailable, match=r"asked for \d+ bytes at \d+, it sent \d+ at \d+"):
        download_state(
            fetcher,
            member=member_of(fetcher, run_id),
            run_id=run_id,
            holders=[holder.peer_id],
            round_no=8,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )


def _no_credential(fetcher: Transport, holder: Transport, run_id: str) -> Member:
    return Member(key=PeerKey.generate(), credential=b"", coordinator_public_key=COORDINATOR.public_key, run_id=run_id)


def _another_coordinators(fetcher: Transport, holder: Transport, run_id: str) -> Member:
    return make_member(PeerKey.generate(), run_id, fetcher.peer_id)


def _expired(fetcher: Transport, holder: Transport, run_id: str) -> Member:
    return member_of(fetcher, run_id, expires_in_s=-1)


def _another_runs(fetcher: Transport, holder: Transport, run_id: str) -> Member:
    return member_of(fetcher, "another-run")


def _someone_elses(fetcher: Transport, holder: Transport, run_id: str) -> Member:
    return member_of(holder, run_id)  # a real member's credential, shown from another libp2p id


@pytest.mark.parametrize("requester", [_no_credential, _another_coordinators, _expired, _another_runs, _someone_elses])
def test_a_state_request_without_a_valid_credential_gets_no_bytes(
    transports: tuple[Transport, Transport], requester
) -> None:
    holder, fetcher = transports
    run_id = f"run-members-only{requester.__name__}"
    server = StateServer(holder, run_id=run_id, member=member_of(holder, run_id))
    state = make_state(9, seed=14)
    server.publish(state)
    stranger = requester(fetcher, holder, run_id)

    answer = fetcher.run(
        fetcher.p2p.call_protobuf_handler(
            PeerID.from_base58(holder.peer_id),
            server.handler_name,
            exchange_pb2.StateRequest(round=9, offset=0, length=CHUNK_BYTES, credential=stranger.credential),
            exchange_pb2.StateChunk,
        ),
        timeout_s=10,
    )
    assert answer.error.startswith("refused:") and not answer.data and not answer.total_bytes and not answer.state_hash
    with pytest.raises(StateUnavailable, match="refused: "):
        download_state(
            fetcher,
            member=stranger,
            run_id=run_id,
            holders=[holder.peer_id],
            round_no=9,
            expected_hash=state.state_hash,
            like=LIKE,
            timeout_s=30,
        )
