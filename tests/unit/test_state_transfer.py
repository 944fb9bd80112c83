"""Committed-state snapshots: safetensors round trip, strict parsing, and download between two real transports."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from swarm.core.state import state_hash
from swarm.net.state_transfer import (
    CHUNK_BYTES,
    GlobalState,
    StateServer,
    StateUnavailable,
    deserialize_state,
    download_state,
    serialize_state,
)
from swarm.net.transport import Transport

pytestmark = pytest.mark.timeout(90)

SHAPES = [torch.Size([400, 700]), torch.Size([700]), torch.Size([3, 4, 5])]  # over 1 MiB: several chunks


def make_state(round_: int, seed: int, shapes: list[torch.Size] = SHAPES) -> GlobalState:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in shapes]
    momentum = [torch.randn(s, generator=generator) for s in shapes]
    return GlobalState(round=round_, params=params, momentum=momentum, hash=state_hash(params, momentum))


def assert_same_state(actual: GlobalState, expected: GlobalState) -> None:
    assert actual.round == expected.round
    assert actual.hash == expected.hash
    assert len(actual.params) == len(expected.params) and len(actual.momentum) == len(expected.momentum)
    for a, e in zip(actual.params + actual.momentum, expected.params + expected.momentum):
        assert torch.equal(a, e)


def test_serialize_then_deserialize_gives_the_same_tensors_and_hash() -> None:
    state = make_state(7, seed=1)
    assert_same_state(deserialize_state(serialize_state(state), round_=7, shapes=SHAPES), state)


def test_deserialize_computes_the_hash_from_the_data_not_from_the_metadata() -> None:
    state = make_state(7, seed=1)
    lying = GlobalState(round=7, params=state.params, momentum=state.momentum, hash="0" * 16)
    assert deserialize_state(serialize_state(lying), round_=7, shapes=SHAPES).hash == state.hash


def test_deserialize_rejects_other_shapes() -> None:
    blob = serialize_state(make_state(1, seed=2))
    shapes = [SHAPES[0], torch.Size([701]), SHAPES[2]]
    with pytest.raises(ValueError, match="shapes do not match"):
        deserialize_state(blob, round_=1, shapes=shapes)


def test_deserialize_rejects_a_snapshot_with_tensors_missing_or_extra() -> None:
    blob = serialize_state(make_state(1, seed=2, shapes=SHAPES[:2]))
    with pytest.raises(ValueError, match="different set of tensors"):
        deserialize_state(blob, round_=1, shapes=SHAPES)
    with pytest.raises(ValueError, match="different set of tensors"):
        deserialize_state(blob, round_=1, shapes=SHAPES[:1])


def test_deserialize_rejects_other_dtypes() -> None:
    state = make_state(1, seed=3)
    doubles = GlobalState(round=1, params=[p.double() for p in state.params], momentum=state.momentum, hash="")
    with pytest.raises(ValueError, match="not fp32"):
        deserialize_state(serialize_state(doubles), round_=1, shapes=SHAPES)


@pytest.mark.parametrize("blob", [b"", b"not a snapshot", b"\xff" * 64])
def test_deserialize_rejects_garbage_bytes(blob: bytes) -> None:
    with pytest.raises(ValueError, match="not valid safetensors"):
        deserialize_state(blob, round_=1, shapes=SHAPES)


def test_deserialize_rejects_a_truncated_snapshot() -> None:
    blob = serialize_state(make_state(1, seed=4))
    with pytest.raises(ValueError):
        deserialize_state(blob[: len(blob) // 2], round_=1, shapes=SHAPES)


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
    server = StateServer(holder, run_id="run-intact")
    state = make_state(5, seed=5)
    server.publish(state)
    blob_size = len(serialize_state(state))
    assert blob_size > 2 * CHUNK_BYTES

    fetched, nbytes = download_state(fetcher, run_id="run-intact", holders=[holder.peer_id], round_=5,
                                     expected_hash=state.hash, shapes=SHAPES, timeout_s=30)

    assert_same_state(fetched, state)
    assert nbytes == blob_size


def test_the_first_holder_with_the_right_state_wins(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-skip")
    state = make_state(2, seed=6)
    server.publish(state)
    # the fetcher's own id is skipped, not asked
    fetched, _ = download_state(fetcher, run_id="run-skip", holders=[fetcher.peer_id, holder.peer_id], round_=2,
                                expected_hash=state.hash, shapes=SHAPES, timeout_s=30)
    assert_same_state(fetched, state)


def test_a_holder_of_another_round_is_refused(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-other-round")
    state = make_state(3, seed=7)
    server.publish(state)

    with pytest.raises(StateUnavailable) as failure:
        download_state(fetcher, run_id="run-other-round", holders=[holder.peer_id], round_=4,
                       expected_hash=state.hash, shapes=SHAPES, timeout_s=30)
    message = str(failure.value)
    assert "round 4" in message and "holds round 3" in message


def test_a_state_with_another_hash_is_refused(transports: tuple[Transport, Transport]) -> None:
    holder, fetcher = transports
    server = StateServer(holder, run_id="run-other-hash")
    state = make_state(3, seed=8)
    server.publish(state)
    committed = make_state(3, seed=9).hash  # the round committed a different state than the holder has

    with pytest.raises(StateUnavailable) as failure:
        download_state(fetcher, run_id="run-other-hash", holders=[holder.peer_id], round_=3,
                       expected_hash=committed, shapes=SHAPES, timeout_s=30)
    message = str(failure.value)
    assert f"served hash {state.hash}" in message and f"committed is {committed}" in message


def test_no_holders_is_unavailable(transports: tuple[Transport, Transport]) -> None:
    _, fetcher = transports
    with pytest.raises(StateUnavailable, match="no holders"):
        download_state(fetcher, run_id="run-none", holders=[fetcher.peer_id], round_=1,
                       expected_hash="0" * 16, shapes=SHAPES, timeout_s=5)


def test_download_spreads_over_holders_and_survives_a_bad_one(transports: tuple[Transport, Transport]) -> None:
    from swarm.net.state_transfer import CHUNK_BYTES

    holder, fetcher = transports
    third = Transport(initial_peers=holder.visible_maddrs)
    try:
        good = StateServer(holder, run_id="run-striped")
        liar = StateServer(third, run_id="run-striped")
        big_shapes = [torch.Size([3 * CHUNK_BYTES // 8 + 5])]  # params + momentum: ~3 MiB, several chunks
        gen = torch.Generator().manual_seed(4)
        params = [torch.randn(big_shapes[0], generator=gen)]
        momentum = [torch.randn(big_shapes[0], generator=gen)]
        state = GlobalState(round=5, params=params, momentum=momentum, hash=state_hash(params, momentum))
        good.publish(state)
        # The liar claims the committed hash but serves other numbers: striping fails the hash check,
        # then each holder alone is tried and the honest one wins.
        wrong = GlobalState(round=5, params=[params[0] + 1], momentum=momentum, hash=state.hash)
        liar.publish(wrong)
        loaded, nbytes = download_state(fetcher, run_id="run-striped", holders=[third.peer_id, holder.peer_id],
                                        round_=5, expected_hash=state.hash, shapes=big_shapes, timeout_s=60)
        assert loaded.hash == state.hash and nbytes > 2 * CHUNK_BYTES
        assert torch.equal(loaded.params[0], params[0])
    finally:
        third.shutdown()


class DyingStateServer(StateServer):
    """Serves two chunks, then fails every request: a holder that dies in the middle of a download."""

    served = 0

    async def _on_request(self, request, context):
        self.served += 1
        if self.served > 2:
            raise ConnectionError("holder died")
        return await super()._on_request(request, context)


def test_download_resumes_on_another_holder_when_its_source_dies_mid_way(transports: tuple[Transport, Transport]) -> None:
    from swarm.net.state_transfer import CHUNK_BYTES

    holder, fetcher = transports
    second = Transport(initial_peers=holder.visible_maddrs)
    try:
        dying = DyingStateServer(holder, run_id="run-resume")
        healthy = StateServer(second, run_id="run-resume")
        shapes = [torch.Size([4 * CHUNK_BYTES // 8])]  # params + momentum: 8 chunks
        gen = torch.Generator().manual_seed(11)
        params, momentum = [torch.randn(shapes[0], generator=gen)], [torch.randn(shapes[0], generator=gen)]
        state = GlobalState(round=2, params=params, momentum=momentum, hash=state_hash(params, momentum))
        dying.publish(state)
        healthy.publish(state)
        loaded, _ = download_state(fetcher, run_id="run-resume", holders=[holder.peer_id, second.peer_id], round_=2,
                                   expected_hash=state.hash, shapes=shapes, timeout_s=60)
        assert loaded.hash == state.hash
        assert dying.served >= 3, "the dying holder was never asked for a chunk after it failed"
    finally:
        second.shutdown()
