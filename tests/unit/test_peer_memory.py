"""What a peer holds in memory at a real model size (docs/TRAINING.md, "What a peer holds in memory"): the
vectors a round, a restart and a joiner's download make, asserted by which buffers exist and whose memory a result
takes, not by a peak (a high-water mark on a small model says nothing)."""

from __future__ import annotations

import pytest
import torch

from swarm.config import RoundConfig
from swarm.core.codecs.error_feedback import PIECE, ErrorFeedback
from swarm.train.sent_feedback import SentFeedback

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_error_feedback_compensates_in_the_pseudo_gradients_memory_with_the_same_bits(decay):
    n = PIECE + 4099  # more than one piece
    g = torch.Generator().manual_seed(3)
    delta, residual = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    feedback = ErrorFeedback(n, decay)
    feedback.install(residual.clone())
    expected = feedback.compensate(delta)  # a new vector
    assert expected.data_ptr() != delta.data_ptr()
    sent = feedback.compensate(delta, in_place=True)
    assert sent.data_ptr() == delta.data_ptr()  # no vector beside Δ and the residual
    assert torch.equal(sent.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(feedback.residual, residual)  # kept: a voided round sends it again


def test_a_rounds_contribution_is_compensated_in_place():
    rounds = RoundConfig(codec="int4", error_feedback=True)
    feedback = SentFeedback(rounds, seed=0, numels=[1000])
    feedback.error_feedback[0].install(torch.full((1000,), 0.25))
    delta = torch.ones(1000)
    sent = feedback.compensate(0, delta)
    assert sent is delta and torch.equal(sent, torch.full((1000,), 1.25))


# ---- error feedback's residual kept in a file -------------------------------------------------------------------
def _int4_trainer():
    import dataclasses

    from swarm.config import DataConfig, RunConfig
    from swarm.train.trainer import LocalTrainer

    run = RunConfig(data=DataConfig(max_bytes=200_000, batch_size=2, seq_len=16))
    trainer = LocalTrainer(
        run.replace(rounds=dataclasses.replace(run.rounds, inner_steps=2, codec="int4")), peer_index=0
    )
    trainer.train(2)
    return trainer


def _encode_as_the_butterfly(flat: torch.Tensor, k: int = 3, stripes: int = 2) -> None:
    from swarm.core.average import butterfly_bounds
    from swarm.core.codecs.codec import get_codec
    from swarm.net.exchange.contributions import encode_own

    for start, end in butterfly_bounds(flat.numel(), k, get_codec("int4").block, stripes):
        encode_own(get_codec("int4"), flat, start, end, "key")  # each slice once, as the butterfly does


def test_a_residual_kept_in_a_file_has_the_bits_of_one_kept_in_memory_and_frees_the_sent_vector(tmp_path):
    from swarm.core.codecs.codec import get_codec
    from swarm.core.codecs.error_feedback import DroppedInPlace, SpilledResidual

    in_file, in_memory = _int4_trainer(), _int4_trainer()
    in_file.feedback.spill_to(tmp_path)
    for round_no in (1, 2):  # round 2 sends Δ + the residual, read back from its file
        sent, again = in_file.take_contribution(0), in_memory.take_contribution(0)
        assert torch.equal(sent.delta.view(torch.int32), again.delta.view(torch.int32))
        before = sent.delta.clone()
        assert DroppedInPlace.spills(sent.delta, get_codec("int4"))  # the exchange may write Δ̄ into its memory
        _encode_as_the_butterfly(sent.delta)
        _encode_as_the_butterfly(again.delta)
        assert torch.equal(sent.delta, before)  # encoding left its values: the residual went to the file
        in_file.record_sent(sent, "int4", parts=3)
        in_memory.record_sent(again, "int4", parts=3)
        kept = in_file.error_feedback[0]._residual
        assert isinstance(kept, SpilledResidual)  # no model-sized vector held between rounds
        assert torch.equal(
            in_file.error_feedback[0].residual.view(torch.int32), in_memory.error_feedback[0].residual.view(torch.int32)
        )
        assert [p.name for p in tmp_path.iterdir()] == [kept.path.name]  # the round before's file is gone
        step = before * 0.5
        in_file.commit(in_file.apply(step, 0, round_no), fragment=0)
        in_memory.commit(in_memory.apply(step, 0, round_no), fragment=0)
        in_file.train(2)
        in_memory.train(2)
    assert in_file.state.state_hash == in_memory.state.state_hash


def test_a_voided_round_keeps_the_residual_file_it_had_and_deletes_the_new_one(tmp_path):
    trainer = _int4_trainer()
    trainer.feedback.spill_to(tmp_path)
    sent = trainer.take_contribution(0)
    _encode_as_the_butterfly(sent.delta)
    trainer.record_sent(sent, "int4", parts=3)
    kept = trainer.error_feedback[0].residual
    voided = trainer.take_contribution(0)
    _encode_as_the_butterfly(voided.delta)
    assert len(list(tmp_path.iterdir())) == 2  # the residual and the voided round's new one
    trainer.return_contribution(voided)
    assert len(list(tmp_path.iterdir())) == 1
    assert torch.equal(trainer.error_feedback[0].residual, kept)


@pytest.mark.slow
def test_a_real_int4_butterfly_writes_the_average_into_the_sent_vector_when_the_residual_goes_to_a_file(tmp_path):
    from swarm.core.average import butterfly_reference, part_bounds
    from swarm.core.codecs.codec import codec_round_trip, get_codec
    from swarm.core.codecs.error_feedback import DroppedInPlace, ResidualFiles
    from swarm.net.exchange.rendezvous import group_key
    from tests.unit.test_exchange import RUN_ID, concurrently, deltas, results_of, three_peers

    files = ResidualFiles(tmp_path)
    for peers in three_peers():
        weights = [3.0, 1.0, 2.0]
        members = [p.member(weight=w, codec="int4") for p, w in zip(peers, weights)]
        inputs = deltas(43, 3)
        originals = [d.clone() for d in inputs]
        expected = butterfly_reference(originals, weights, "int4")
        spills = [files.new(0, d.numel()) for d in inputs]
        entries = [DroppedInPlace.expect(d, s) for d, s in zip(inputs, spills)]
        key = group_key(RUN_ID, 43)

        def average(p, m, d):
            group = p.group(key, m, {q.name for q in peers}, window_s=20.0)
            return p.exchange.average(key=key, group=group, me=m, delta=d, timeout_s=30.0, into_delta=True)

        results = results_of(
            concurrently(
                [lambda p=p, m=m, d=d: average(p, m, d) for p, m, d in zip(peers, members, inputs)], timeout_s=60
            )
        )
        codec = get_codec("int4")
        for result, sent, entry, spill, original in zip(results, inputs, entries, spills, originals):
            assert result.average.data_ptr() == sent.data_ptr()  # Δ̄ in Δ's memory: no vector of its own
            assert torch.equal(result.average, expected)
            assert entry.residual(codec) is spill
            again = original - codec_round_trip(original, codec, part_bounds(original.numel(), 3, codec.block))
            assert torch.equal(spill.tensor(), again)
