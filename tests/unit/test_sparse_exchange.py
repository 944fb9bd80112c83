"""Top-k sparse codecs and their all-gather exchange: the codec keeps exactly the k largest values per
chunk, the run config names them, three real hivemind peers end with the simulator's bits, and the
simulator counts the all-gather's bytes."""

from __future__ import annotations

import dataclasses
from typing import Iterator

import pytest
import torch

from swarm.config import ConfigError, RunConfig
from swarm.core.aggregation import Aggregation
from swarm.core.all_gather import gather_reference
from swarm.core.average import part_bounds
from swarm.core.codecs.codec import codec_round_trip, get_codec
from swarm.core.codecs.error_feedback import ErrorFeedback
from swarm.net.exchange.rendezvous import group_key
from swarm.train.simulator.sim import simulate
from tests.unit.test_exchange import Peer, concurrently, deltas, results_of, three_peers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

RUN_ID = "run-test-sparse"
NUMEL = 100_003  # 24 full chunks and a short one


def test_topk_sends_the_largest_values_of_every_chunk_and_nothing_else():
    x = deltas(1, 1, 3 * 4096 + 100)[0]
    codec = get_codec("topk-fp16@0.05")
    y = codec.decode(codec.encode(x), x.numel())
    for start in range(0, x.numel(), 4096):
        chunk, sent = x[start : start + 4096], y[start : start + 4096]
        k = -(-len(chunk) * 5 // 100)
        top = chunk.abs().topk(k).indices
        assert torch.equal(sent.nonzero().reshape(-1).sort().values, top.sort().values)
        assert torch.equal(sent[top], chunk[top].to(torch.float16).to(torch.float32))


@pytest.mark.parametrize("name", ["topk-int4", "topk-int8@0.2", "topk-fp16@0.001"])
def test_chunk_aligned_slices_decode_like_the_whole_vector(name):
    codec = get_codec(name)
    x = deltas(2, 1, NUMEL)[0]
    whole = codec.decode(codec.encode(x), NUMEL)
    assert torch.equal(codec_round_trip(x, codec, part_bounds(NUMEL, 3, codec.block)), whole)
    assert len(codec.encode(x)) == codec.encoded_size(NUMEL)
    # int4 at 1%: ~2.56 bytes per sent value, ~40x less than the dense int4 codec
    if name == "topk-int4":
        assert codec.encoded_size(NUMEL) < 0.027 * NUMEL


def test_malformed_sparse_payloads_are_refused():
    codec = get_codec("topk-int8")
    data = bytearray(codec.encode(deltas(3, 1, 4096)[0]))
    data[0:4] = bytes([5, 0, 5, 0])  # the first two offsets repeat
    with pytest.raises(ValueError, match="offsets"):
        codec.decode(bytes(data), 4096)
    dense = get_codec("topk-int4@0.5")  # positions as a bitmap
    data = bytearray(dense.encode(deltas(4, 1, 4096)[0]))
    data[0] ^= 1
    with pytest.raises(ValueError, match="bitmap"):
        dense.decode(bytes(data), 4096)


def test_what_topk_does_not_send_stays_in_the_residual():
    codec, feedback = get_codec("topk-int4"), ErrorFeedback(NUMEL)
    rounds = deltas(5, 4, NUMEL)
    total_sent = torch.zeros(NUMEL)
    for delta in rounds:
        sent_input = feedback.compensate(delta)
        decoded = codec.decode(codec.encode(sent_input), NUMEL)
        feedback.update(sent_input, decoded)
        total_sent += decoded
    assert (total_sent + feedback.residual - sum(rounds)).abs().max() < 1e-4  # nothing lost for good


def test_the_run_config_names_topk_codecs_with_their_density():
    assert RunConfig.from_json('{"rounds": {"codec": "topk-int4@0.003"}}').rounds.codec == "topk-int4@0.003"
    for bad, why in (
        ("topk-int4@2", "fraction in"),
        ("topk-int3", "unknown"),
        ("int4@0.1", "unknown"),
        ("topk-int4@x", "fraction in"),
    ):
        with pytest.raises(ConfigError, match=why):
            RunConfig.from_json(f'{{"rounds": {{"codec": "{bad}"}}}}')
    with pytest.raises(ConfigError, match="hierarchical = false"):
        RunConfig.from_json('{"rounds": {"codec": "topk-int4", "hierarchical": true}}')
    assert get_codec("topk-int4@0.01").name == "topk-int4"  # the default density keeps the short name


@pytest.fixture(scope="module")
def peers() -> Iterator[list[Peer]]:
    yield from three_peers(RUN_ID)


def _exchange(peers, key, codec, weights, inputs):
    planned = {p.name for p in peers}
    members = [p.member(weight=w, codec=codec) for p, w in zip(peers, weights)]
    return [
        r
        for _, r in results_of(
            concurrently(
                [lambda p=p, m=m, d=d: p.average(key, m, planned, d) for p, m, d in zip(peers, members, inputs)],
                timeout_s=90,
            )
        )
    ]


def test_three_peers_gather_the_simulators_bits_and_send_k_minus_1_encodings(peers):
    weights, inputs = [3.0, 1.0, 2.0], deltas(6, 3)
    results = _exchange(peers, group_key(RUN_ID, 1), "topk-int4@0.02", weights, inputs)
    expected = gather_reference(inputs, weights, "topk-int4@0.02")
    payload = get_codec("topk-int4@0.02").encoded_size(NUMEL)
    for result in results:
        assert torch.equal(result.average, expected)
        assert 2 * payload <= result.bytes_sent <= 2 * payload * 1.02, result.bytes_sent
    # the average of three sparse vectors is denser than each: nothing of it was re-sparsified
    assert (expected != 0).sum() > 2.5 * (gather_reference(inputs[:1], [1.0], "topk-int4@0.02") != 0).sum()


def test_every_peer_leaves_out_the_same_outlier(peers):
    inputs = deltas(7, 3)
    inputs[1] = inputs[1] * 1e6  # past the default reject_factor (100 x the median norm)
    results = _exchange(peers, group_key(RUN_ID, 2), "topk-int8", [1.0, 1.0, 1.0], inputs)
    reduce = lambda d, w: Aggregation().reduce(d, w).average  # noqa: E731
    expected = gather_reference(inputs, [1.0] * 3, "topk-int8", reduce=reduce)
    for result in results:
        assert torch.equal(result.average, expected)
        assert list(result.rejected) == [peers[1].name]
    assert expected.abs().max() < 10  # the outlier moved nothing


def test_the_simulator_counts_the_all_gathers_bytes_and_trains():
    from tests.unit.test_trainer_sim import RUN

    run = RUN.replace(rounds=dataclasses.replace(RUN.rounds, inner_steps=3, codec="topk-int4@0.05"))
    result = simulate(run, peers=3, rounds=2)
    assert result.consistent and result.error_feedback and result.codec == "topk-int4@0.05"
    numel = result.param_count
    assert [r.bytes_sent for r in result.rounds] == [[2 * get_codec("topk-int4@0.05").encoded_size(numel)] * 3] * 2
    assert result.rounds[-1].eval_loss < result.initial_eval_loss


def test_swarm_status_shows_the_topk_codec_with_its_density():
    import io

    from rich.console import Console

    from coordinator.engine import CoordinatorEngine
    from coordinator.store.database import Store
    from swarm.app.status import render_status, status_to_dict

    engine = CoordinatorEngine(
        Store(":memory:"), config=RunConfig.from_json('{"rounds": {"codec": "topk-int4@0.003"}}')
    )
    out = io.StringIO()
    render_status(status_to_dict(engine.status(engine.run.token)), Console(file=out, width=300, color_system=None))
    assert "codec topk-int4@0.003 (0.3% of values) with error feedback" in out.getvalue()
