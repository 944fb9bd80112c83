"""One peer's LocalTrainer and the in-process simulator: learning, consistency and determinism."""

import dataclasses
import json

import pytest
import torch

from swarm.config import DataConfig, InnerOptConfig, ModelConfig, OuterOptConfig, RoundConfig, RunConfig
from swarm.data import eval_loss
from swarm.sim import main as sim_main
from swarm.sim import simulate
from swarm.trainer import LocalTrainer

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Two intra-op threads on a 2-core machine shared with other test runs spin-wait and can run
    # 20x slower; one thread keeps these tests fast whatever else is running.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="tiny"),
    data=DataConfig(max_bytes=1_000_000, num_shards=4, batch_size=8, seq_len=64, eval_batches=2),
    inner=InnerOptConfig(warmup_steps=5),
    rounds=RoundConfig(inner_steps=10),
).validate()


def test_the_trainer_learns():
    trainer = LocalTrainer(RUN, peer_index=0)
    d = RUN.data
    before = trainer.eval_loss()
    stats = trainer.train(60)
    after_local = eval_loss(trainer.model, trainer.corpus, batch_size=d.batch_size, seq_len=d.seq_len,
                            num_batches=d.eval_batches)
    assert (stats.steps, stats.samples, stats.tokens) == (60, 480, 480 * 64)
    assert before > 4.5 and after_local < before - 1.5, (before, after_local)
    assert stats.mean_loss < before
    assert trainer.local_step_time_s is not None and trainer.tokens_per_second > 0
    assert trainer.eval_loss() == before  # θg has not moved: only a commit moves it


def test_apply_is_tentative_and_commit_installs_the_state():
    trainer = LocalTrainer(RUN, peer_index=1)
    trainer.train(3)
    local = [p.detach().clone() for p in trainer.model.parameters()]
    start_hash = trainer.state_hash()
    delta = trainer.pseudo_gradient()
    assert delta.dim() == 1 and delta.numel() == trainer.param_count and delta.abs().sum() > 0
    params, momentum = trainer.apply(delta)
    assert trainer.state_hash() == start_hash and trainer.round == 0
    trainer.commit(params, momentum, round=1)
    assert trainer.state_hash() != start_hash and trainer.round == 1
    trainer.eval_loss()  # evaluates θg, then puts θl back
    assert all(torch.equal(a, b) for a, b in zip(local, trainer.model.parameters()))


def test_one_peer_with_plain_outer_sgd_lands_on_its_local_parameters():
    # Outer lr 1, no momentum: θg − (θg − θl) = θl.  A sign error in Δ would land far away.
    run = RUN.replace(outer=OuterOptConfig(lr=1.0, momentum=0.0, nesterov=False))
    result = simulate(run, peers=1, rounds=1, steps_per_peer=[5])
    trainer = LocalTrainer(run, peer_index=0)
    trainer.train(5)
    for g, l in zip(result.final_params, trainer.model.parameters()):
        assert torch.allclose(g, l.detach(), atol=1e-6)


def test_simulated_peers_agree_bit_for_bit_and_learn():
    result = simulate(RUN, peers=2, rounds=2)
    assert len(result.rounds) == 2 and result.consistent
    for r in result.rounds:
        assert len(r.peer_hashes) == 2 and len(set(r.peer_hashes)) == 1
    assert result.rounds[0].state_hash != result.initial_hash != result.final_hash
    assert result.rounds[-1].eval_loss < result.initial_eval_loss - 0.5
    assert result.rounds[-1].samples == 2 * 10 * 8
    assert result.bytes_per_peer_per_round == 4 * result.param_count  # 2 (K-1)/K x 4 bytes, K = 2
    json.dumps(result.to_dict())


def test_simulation_is_deterministic():
    run = dataclasses.replace(RUN, rounds=dataclasses.replace(RUN.rounds, inner_steps=5))
    a = simulate(run, peers=2, rounds=2, steps_per_peer=[5, 3])
    b = simulate(run, peers=2, rounds=2, steps_per_peer=[5, 3])
    assert [r.state_hash for r in a.rounds] == [r.state_hash for r in b.rounds]
    assert all(torch.equal(x, y) for x, y in zip(a.final_params + a.final_momentum, b.final_params + b.final_momentum))
    assert [r.eval_loss for r in a.rounds] == [r.eval_loss for r in b.rounds]


def test_fp16_simulation_stays_consistent_and_sends_half_the_bytes():
    result = simulate(RUN, peers=3, rounds=1, steps_per_peer=[2, 2, 2], codec="fp16")
    assert result.consistent and result.codec == "fp16"
    assert result.bytes_per_peer_per_round == pytest.approx(2 * 2 / 3 * 2 * result.param_count)


def test_bad_simulation_arguments_are_refused():
    with pytest.raises(ValueError, match="steps_per_peer"):
        simulate(RUN, peers=2, rounds=1, steps_per_peer=[3])
    with pytest.raises(ValueError, match="unknown"):
        simulate(RUN, peers=1, rounds=1, codec="int3")


def test_seq_len_longer_than_the_context_is_a_clear_error():
    run = RUN.replace(model=ModelConfig(preset="tiny", context=32))
    with pytest.raises(ValueError, match="context"):
        LocalTrainer(run, peer_index=0)


def test_sim_cli_prints_a_json_summary(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[data]\nmax_bytes = 1000000\nseq_len = 32\neval_batches = 1\nnum_shards = 2\n")
    assert sim_main(["--config", str(config), "--peers", "2", "--rounds", "1", "--steps", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["peers"] == 2 and summary["consistent"] and len(summary["rounds"]) == 1
