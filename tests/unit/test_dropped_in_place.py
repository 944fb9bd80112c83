"""Error feedback's residual is made by the exchange from the bytes it sends, in the sent vector's own memory, and
installed at the commit: the same bits as encoding the vector again at the commit, without that second encode."""

import dataclasses

import pytest
import torch

from swarm.config import DataConfig, RunConfig
from swarm.core.average import butterfly_bounds
from swarm.core.codecs.codec import get_codec
from swarm.net.exchange.contributions import encode_own as _encode
from swarm.train import sent_feedback
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _run(codec: str) -> RunConfig:
    run = RunConfig(data=DataConfig(max_bytes=200_000, batch_size=2, seq_len=16))
    return run.replace(rounds=dataclasses.replace(run.rounds, inner_steps=2, codec=codec))


def _trained(codec: str) -> LocalTrainer:
    trainer = LocalTrainer(_run(codec), peer_index=0)
    trainer.train(2)
    return trainer


@pytest.mark.parametrize("codec", ["int4", "int8", "sign", "ternary"])
def test_the_residual_the_exchange_leaves_is_the_one_a_second_encode_makes(codec, monkeypatch):
    exchanged, recomputed = _trained(codec), _trained(codec)
    for round_no in (1, 2):  # the second round sends Δ + the first round's residual
        sent, again = exchanged.take_contribution(0), recomputed.take_contribution(0)
        assert torch.equal(sent.delta, again.delta)
        flat = sent.delta.reshape(-1)  # the exchange sends a view of it
        k, stripes = 3, 2
        for start, end in butterfly_bounds(flat.numel(), k, get_codec(codec).block, stripes):
            _encode(get_codec(codec), flat, start, end, "key")  # each slice once, as the butterfly does
        recomputed.record_sent(again, codec, parts=k)
        with monkeypatch.context() as m:
            m.setattr(sent_feedback, "codec_round_trip", lambda *a: pytest.fail("the vector was encoded again"))
            exchanged.record_sent(sent, codec, parts=k)
        assert torch.equal(exchanged.error_feedback[0].residual, recomputed.error_feedback[0].residual)
        assert exchanged.error_feedback[0].residual.any()
        step = again.delta * 0.5
        exchanged.commit(exchanged.apply(step, 0, round_no), fragment=0)
        recomputed.commit(recomputed.apply(step, 0, round_no), fragment=0)
        exchanged.train(2)
        recomputed.train(2)
    assert exchanged.state.state_hash == recomputed.state.state_hash


def test_a_vector_the_exchange_did_not_encode_whole_is_encoded_again_at_the_commit():
    trainer, twin = _trained("int4"), _trained("int4")
    sent, again = trainer.take_contribution(0), twin.take_contribution(0)
    twin.record_sent(again, "int4")
    trainer.record_sent(sent, "fp16")  # sent with another codec than the run's (a controller's choice): recomputed
    assert not torch.equal(trainer.error_feedback[0].residual, twin.error_feedback[0].residual)
    voided = trainer.take_contribution(0)
    _encode(get_codec("int4"), voided.delta, 0, 64, "key")
    trainer.return_contribution(voided)  # a voided round: error feedback keeps the residual it had
    assert trainer.error_feedback[0].residual.any()


@pytest.mark.slow
def test_a_real_int4_butterfly_leaves_each_members_residual_in_its_sent_vector():
    from swarm.core.average import butterfly_reference, part_bounds
    from swarm.core.codecs.codec import codec_round_trip
    from swarm.core.codecs.error_feedback import DroppedInPlace
    from swarm.net.exchange.rendezvous import group_key
    from tests.unit.test_exchange import RUN_ID, concurrently, deltas, results_of, three_peers

    for peers in three_peers():
        weights = [3.0, 1.0, 2.0]
        members = [p.member(weight=w, codec="int4") for p, w in zip(peers, weights)]
        inputs = deltas(41, 3)
        originals = [d.clone() for d in inputs]
        expected = butterfly_reference(originals, weights, "int4")
        entries = [DroppedInPlace.expect(d) for d in inputs]
        results = results_of(
            concurrently(
                [
                    lambda p=p, m=m, d=d: p.average(group_key(RUN_ID, 41), m, {q.name for q in peers}, d)
                    for p, m, d in zip(peers, members, inputs)
                ],
                timeout_s=60,
            )
        )
        assert all(torch.equal(result.average, expected) for _, result in results)  # the average is untouched
        codec = get_codec("int4")
        for entry, sent, original in zip(entries, inputs, originals):
            assert entry.residual(codec) is sent
            again = original - codec_round_trip(original, codec, part_bounds(original.numel(), 3, codec.block))
            assert torch.equal(sent, again)
