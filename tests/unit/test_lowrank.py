"""Low-rank pseudo-gradients (``lowrank<r>-<values>``, swarm.core.codecs.lowrank): the name in the run config,
the exchange's average (a projection of the weighted mean onto an orthonormal basis every peer computes
alike), the error-feedback residual, and a simulated run whose peers end on the same θg bits as the
same rounds done by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from swarm.config import ConfigError, OuterOptConfig, RunConfig
from swarm.core.average import butterfly_bytes_sent, butterfly_reference, weighted_average
from swarm.core.codecs import lowrank
from swarm.core.codecs.codec import get_codec
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer
from tests.unit.test_trainer_sim import RUN

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

SHAPES = [(48, 32), (32,), (40, 24)]  # two matrices and a 1-D tensor sent dense


def _low_rank_deltas(count: int, rank: int, seed: int) -> list[torch.Tensor]:
    """Flat vectors whose matrices all lie in one shared rank-``rank`` column space (and random 1-D parts)."""
    g = torch.Generator().manual_seed(seed)
    bases = [torch.randn(m, rank, generator=g) for m, *_ in (s for s in SHAPES if len(s) == 2)]
    out = []
    for _ in range(count):
        parts, b = [], iter(bases)
        for shape in SHAPES:
            if len(shape) == 2:
                parts.append((next(b) @ torch.randn(rank, shape[1], generator=g)).reshape(-1))
            else:
                parts.append(torch.randn(shape[0], generator=g))
        out.append(torch.cat(parts))
    return out


def test_the_codec_is_named_in_the_run_config_and_bad_names_are_refused():
    run = RunConfig.from_json('{"rounds": {"codec": "lowrank8-int4"}}')
    codec = get_codec(run.rounds.codec)
    assert codec.lowrank and codec.rank == 8 and codec.values is get_codec("int4")
    for bad in ("lowrank0-fp16", "lowrank65-fp16", "lowrank4-sign", "lowrank4-topk-int4", "lowrankx-fp16"):
        with pytest.raises(ConfigError, match="low-rank codec is lowrank<rank>-<values>"):
            RunConfig.from_json(f'{{"rounds": {{"codec": "{bad}"}}}}')
    with pytest.raises(ConfigError, match="averages its factors linearly"):
        RunConfig.from_json('{"rounds": {"codec": "lowrank4-fp16", "aggregation": "trimmed_mean"}}')


def test_the_average_is_the_weighted_mean_when_it_fits_the_rank_and_every_peer_decodes_it_alike():
    lay = lowrank.layout(SHAPES, rank=4)
    assert [m[1:] for m in lay.matrices] == [(48, 32), (40, 24)] and lay.dense == ((48 * 32, 32),)
    deltas, weights = _low_rank_deltas(3, rank=4, seed=1), [1.0, 2.0, 3.0]
    qs = [lowrank.initial_q(lay, seed=7) for _ in deltas]
    done = lowrank.lowrank_reference(deltas, weights, get_codec("lowrank4-fp32"), lay, qs)
    # rank 4 holds the shared rank-4 column space whole: the projection is the weighted mean
    assert torch.allclose(done.average, weighted_average(deltas, weights), atol=1e-4)
    # a peer that joined late and starts from another Q still decodes the same bytes to the same average
    other = lowrank.lowrank_reference(
        deltas, weights, get_codec("lowrank4-fp32"), lay, [lowrank.initial_q(lay, seed=8)] + qs[1:]
    )
    assert torch.allclose(other.average, done.average, atol=1e-4)


def test_the_residual_is_what_the_projection_left_out():
    lay = lowrank.layout(SHAPES, rank=2)
    deltas = _low_rank_deltas(2, rank=6, seed=2)  # rank 6 does not fit in 2: the projection drops some
    done = lowrank.lowrank_reference(
        deltas, [1.0, 1.0], get_codec("lowrank2-fp32"), lay, [lowrank.initial_q(lay, 0)] * 2
    )
    hats = lowrank.p_hats(
        butterfly_reference([lowrank.p_vector(d, lay, lowrank.initial_q(lay, 0)) for d in deltas], [1.0, 1.0], "fp32"),
        lay,
    )
    for delta, delivered in zip(deltas, done.delivered):
        residual = delta - delivered
        assert residual.norm() > 0.1 * delta.norm()  # the projection does drop a part
        for (offset, m, n), hat in zip(lay.matrices, hats):
            assert torch.allclose(hat.t() @ hat, torch.eye(2), atol=1e-5)  # orthonormal
            # the residual has nothing left along P̂: the next round sends what this one dropped
            assert (hat.t() @ residual[offset : offset + m * n].view(m, n)).abs().max() < 1e-4
        assert torch.equal(residual[48 * 32 : 48 * 32 + 32], torch.zeros(32))  # fp32 dense parts: nothing lost


def test_bytes_are_two_small_butterflies():
    lay = lowrank.layout(SHAPES, rank=4)
    assert lay.p_numel == 4 * (48 + 40) + 32 and lay.q_numel == 4 * (32 + 24)
    int4 = get_codec("int4")
    expect = butterfly_bytes_sent(lay.p_numel, 3, int4)[0] + butterfly_bytes_sent(lay.q_numel, 3, int4)[0]
    assert expect < butterfly_bytes_sent(lay.numel, 3, int4)[0] / 2


def _run(codec: str) -> RunConfig:
    rounds = dataclasses.replace(RUN.rounds, inner_steps=3, codec=codec)
    return RUN.replace(rounds=rounds, outer=OuterOptConfig(lr=1.0, momentum=0.0)).validate()


def test_the_simulated_peers_and_the_rounds_done_by_hand_end_on_the_same_bits():
    run, rounds = _run("lowrank4-int8"), 3
    sim = simulate(run, peers=2, rounds=rounds)
    assert sim.consistent and sim.error_feedback
    # The same rounds by hand, as two peers run them: P, P̂, Q, the update P̂ Q̂ᵀ, one outer step.
    trainers = [LocalTrainer(run, peer_index=i) for i in range(2)]
    lay = lowrank.layout(trainers[0].fragment_shapes(None), 4)
    for round_no in range(1, rounds + 1):
        for t in trainers:
            t.train(run.rounds.inner_steps)
        contributions = [t.take_contribution() for t in trainers]
        done = lowrank.lowrank_reference(
            [c.delta for c in contributions],
            [float(c.samples) for c in contributions],
            get_codec(run.rounds.codec),
            lay,
            [c.lowrank.q_for(lay) for c in contributions],
        )
        states = [t.apply(done.average, None, round_no) for t in trainers]
        assert states[0].state_hash == states[1].state_hash
        for i, (t, c, s) in enumerate(zip(trainers, contributions, states)):
            c.lowrank.stage(done.q_next, done.delivered[i])
            t.record_sent(c, run.rounds.codec)
            t.commit(s)
    assert trainers[0].state.state_hash == trainers[1].state.state_hash == sim.final_hash
    assert trainers[0].lowrank[0].q is not None and trainers[0].error_feedback[0].residual.any()
    per_round = sum(butterfly_bytes_sent(n, 2, "int8")[0] for n in (lay.p_numel, lay.q_numel))
    assert sim.bytes_sent_per_peer == [rounds * per_round] * 2
