"""The global state's one format (safetensors round trip, strict parsing) and its download between two
real transports."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from hivemind.p2p import PeerID

from swarm.core.credential import Member, PeerKey
from swarm.core.state import GlobalState, decode_state, encode_state, encoded_size_bound
from swarm.net.state_transfer import StateServer, StateUnavailable, download_state
from swarm.net.transport import CHUNK_BYTES, Transport
from swarm.v1 import exchange_pb2
from tests.unit.run_members import make_member

pytestmark = pytest.mark.timeout(90)

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


def test_a_published_state_downloads_intact(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-intact", member=member_of(holder, "run-intact"))
    state = make_state(5, seed=5)
    server.publish(state)
    blob_size = len(encode_state(state))
    assert blob_size > 2 * CHUNK_BYTES

    fetched, nbytes = download_state(fetcher, member=member_of(fetcher, "run-intact"), run_id="run-intact", holders=[holder.peer_id], round_no=5,
                                     expected_hash=state.state_hash, like=LIKE, timeout_s=30)

    assert_same_state(fetched, state)
    assert nbytes == blob_size


def test_the_first_holder_with_the_right_state_wins(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-skip", member=member_of(holder, "run-skip"))
    state = make_state(2, seed=6)
    server.publish(state)
    # the fetcher's own id is skipped, not asked
    fetched, _ = download_state(fetcher, member=member_of(fetcher, "run-skip"), run_id="run-skip", holders=[fetcher.peer_id, holder.peer_id], round_no=2,
                                expected_hash=state.state_hash, like=LIKE, timeout_s=30)
    assert_same_state(fetched, state)


def test_a_holder_of_another_round_is_refused(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-other-round", member=member_of(holder, "run-other-round"))
    state = make_state(3, seed=7)
    server.publish(state)

    with pytest.raises(StateUnavailable) as failure:
        download_state(fetcher, member=member_of(fetcher, "run-other-round"), run_id="run-other-round", holders=[holder.peer_id], round_no=4,
                       expected_hash=state.state_hash, like=LIKE, timeout_s=30)
    message = str(failure.value)
    assert "round 4" in message and "holds round 3" in message


def test_a_state_with_another_hash_is_refused(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-other-hash", member=member_of(holder, "run-other-hash"))
    state = make_state(3, seed=8)
    server.publish(state)
    committed = make_state(3, seed=9).state_hash  # the round committed a different state than the holder has

    with pytest.raises(StateUnavailable) as failure:
        download_state(fetcher, member=member_of(fetcher, "run-other-hash"), run_id="run-other-hash", holders=[holder.peer_id], round_no=3,
                       expected_hash=committed, like=LIKE, timeout_s=30)
    message = str(failure.value)
    assert f"served hash {state.state_hash}" in message and f"committed is {committed}" in message


def test_no_holders_is_unavailable(transports: tuple[Transport, Transport]) -> None:
    _, fetcher = transports
    with pytest.raises(StateUnavailable, match="no holders"):
        download_state(fetcher, member=member_of(fetcher, "run-none"), run_id="run-none", holders=[fetcher.peer_id], round_no=1,
                       expected_hash="0" * 16, like=LIKE, timeout_s=5)


def test_download_spreads_over_holders_and_survives_a_bad_one(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    third = Transport(initial_peers=holder.visible_maddrs)
    try:
        good = StateServer(holder, run_id="run-striped", member=member_of(holder, "run-striped"))
        liar = LyingStateServer(third, run_id="run-striped", member=member_of(third, "run-striped"))
        state = make_state(5, seed=4, shapes=[torch.Size([3 * CHUNK_BYTES // 8 + 5])])  # ~3 MiB, several chunks
        params = state.params
        good.publish(state)
        # The liar claims the committed hash but serves other numbers: striping fails the hash check,
        # then each holder alone is tried and the honest one wins.
        liar.publish_as(GlobalState(5, [params[0] + 1], state.outer_state), claimed_hash=state.state_hash)
        loaded, nbytes = download_state(fetcher, member=member_of(fetcher, "run-striped"), run_id="run-striped", holders=[third.peer_id, holder.peer_id],
                                        round_no=5, expected_hash=state.state_hash, like=state, timeout_s=60)
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
    """Announces a state of 2^62 bytes."""

    async def _on_request(self, request, context):
        chunk = await super()._on_request(request, context)
        chunk.total_bytes = 1 << 62
        return chunk


def test_a_holder_announcing_a_huge_state_is_refused_before_anything_is_allocated(
        transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    state = make_state(6, seed=12)
    HugeStateServer(holder, run_id="run-huge", member=member_of(holder, "run-huge")).publish(state)
    with pytest.raises(StateUnavailable, match="announced a state of"):
        download_state(fetcher, member=member_of(fetcher, "run-huge"), run_id="run-huge", holders=[holder.peer_id], round_no=6,
                       expected_hash=state.state_hash, like=LIKE, timeout_s=30)


class DyingStateServer(StateServer):
    """Serves two chunks, then fails every request: a holder that dies in the middle of a download."""

    served = 0

    async def _on_request(self, request, context):
        self.served += 1
        if self.served > 2:
            raise ConnectionError("holder died")
        return await super()._on_request(request, context)


def test_download_resumes_on_another_holder_when_its_source_dies_mid_way(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    second = Transport(initial_peers=holder.visible_maddrs)
    try:
        dying = DyingStateServer(holder, run_id="run-resume", member=member_of(holder, "run-resume"))
        healthy = StateServer(second, run_id="run-resume", member=member_of(second, "run-resume"))
        state = make_state(2, seed=11, shapes=[torch.Size([4 * CHUNK_BYTES // 8])])  # params + outer: 8 chunks
        dying.publish(state)
        healthy.publish(state)
        loaded, _ = download_state(fetcher, member=member_of(fetcher, "run-resume"), run_id="run-resume", holders=[holder.peer_id, second.peer_id], round_no=2,
                                   expected_hash=state.state_hash, like=state, timeout_s=60)
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
        return chunk


@pytest.mark.parametrize("lie", ["longer", "offset"])
def test_a_holder_serving_chunks_of_another_size_or_offset_is_refused(transports: tuple[Transport, Transport],
                                                                      lie: str) -> None:
    holder, fetcher = transports
    run_id = f"run-misplaced-{lie}"
    state = make_state(8, seed=13)
    MisplacingStateServer(holder, run_id=run_id, member=member_of(holder, run_id), lie=lie).publish(state)
    with pytest.raises(StateUnavailable, match="asked for .* bytes at 0, it sent"):
        download_state(fetcher, member=member_of(fetcher, run_id), run_id=run_id, holders=[holder.peer_id],
                       round_no=8, expected_hash=state.state_hash, like=LIKE, timeout_s=30)


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
def test_a_state_request_without_a_valid_credential_gets_no_bytes(transports: tuple[Transport, Transport],
                                                                 requester) -> None:
    holder, fetcher = transports
    run_id = f"run-members-only{requester.__name__}"
    server = StateServer(holder, run_id=run_id, member=member_of(holder, run_id))
    state = make_state(9, seed=14)
    server.publish(state)
    stranger = requester(fetcher, holder, run_id)

    answer = fetcher.run(fetcher.p2p.call_protobuf_handler(
        PeerID.from_base58(holder.peer_id), server.handler_name,
        exchange_pb2.StateRequest(round=9, offset=0, length=CHUNK_BYTES, credential=stranger.credential),
        exchange_pb2.StateChunk), timeout_s=10)
    assert answer.error.startswith("refused:") and not answer.data and not answer.total_bytes and not answer.state_hash
    with pytest.raises(StateUnavailable, match="refused: "):
        download_state(fetcher, member=stranger, run_id=run_id, holders=[holder.peer_id], round_no=9,
                       expected_hash=state.state_hash, like=LIKE, timeout_s=30)
