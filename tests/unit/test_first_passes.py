"""A peer's start-up probe makes its first step's forward and backward passes (swarm/train/step_probe.py, keep):
the step uses them instead of making them again, and trains the same bits as a peer that never probed; when θl, the
batch or the random state changed in between, the step makes its own."""

from __future__ import annotations

import pytest
import torch

from swarm.config import DataConfig, ModelConfig, RunConfig
from swarm.train.step_probe import StepProbe
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

# dropout on: the passes draw from the global random stream, as the step would
RUN = RunConfig(
    model=ModelConfig(preset="bench", dropout=0.1), data=DataConfig(max_bytes=200_000, batch_size=2, seq_len=16)
).validate()


def _trained(trainer: LocalTrainer, steps: int, *, between=lambda t: None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """θl after ``steps`` steps from seed 7, ``between`` done before them; and the random state they left."""
    torch.manual_seed(7)
    between(trainer)
    trainer.train(steps)
    return [p.detach().clone() for p in trainer.model.parameters()], torch.random.get_rng_state()


def _probed(keep: bool = True) -> LocalTrainer:
    trainer = LocalTrainer(RUN, peer_index=1)
    torch.manual_seed(7)
    StepProbe(trainer, keep=keep).run()
    return trainer


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_the_first_step_uses_the_probes_passes_and_trains_the_same_bits() -> None:
    plain_params, plain_rng = _trained(LocalTrainer(RUN, peer_index=1), 3)
    probed = _probed()
    assert probed.holds_first_passes() and probed.sampler.batches_drawn == 0 and not probed.optimizer.state
    made = probed.first_passes
    probed.commit(probed.state)  # a peer's start installs θ0 again: θl already holds it, the passes stay good
    assert probed.holds_first_passes()
    made_passes = []
    gradients = probed.inner_step._gradients
    probed.inner_step._gradients = lambda x, y: made_passes.append(1) or gradients(x, y)
    params, rng = _trained(probed, 3)
    assert len(made_passes) == 2  # the first step made none
    assert _same(params, plain_params) and torch.equal(rng, plain_rng)
    assert probed.first_passes is None and probed.inner_steps_done == 3  # used once
    assert probed.local_step_time_s >= made.seconds / 3  # the passes made ahead count in the step time


def test_a_peer_that_syncs_another_state_first_makes_its_own_passes() -> None:
    donor = LocalTrainer(RUN, peer_index=0)
    donor.train(2)
    synced = donor.local_params()  # another θ than θ0: what a download would install

    def sync(trainer: LocalTrainer) -> None:
        with torch.no_grad():
            for p, value in zip(trainer.model.parameters(), synced):
                p.copy_(value)

    plain_params, plain_rng = _trained(LocalTrainer(RUN, peer_index=1), 2, between=sync)
    probed = _probed()
    params, rng = _trained(probed, 2, between=sync)
    assert _same(params, plain_params) and torch.equal(rng, plain_rng)


def test_passes_made_from_another_random_state_or_batch_are_not_used() -> None:
    def draw(trainer: LocalTrainer) -> None:
        torch.rand(1)  # something drew from the stream after the probe: dropout would draw other masks
        assert not trainer.holds_first_passes()

    plain_params, plain_rng = _trained(LocalTrainer(RUN, peer_index=1), 2, between=draw)
    params, rng = _trained(_probed(), 2, between=draw)
    assert _same(params, plain_params) and torch.equal(rng, plain_rng)

    def skip(trainer: LocalTrainer) -> None:
        trainer.sampler.batches_drawn += 1

    plain_params, _ = _trained(LocalTrainer(RUN, peer_index=1), 2, between=skip)
    params, _ = _trained(_probed(), 2, between=skip)
    assert _same(params, plain_params)


def test_a_probe_that_does_not_keep_leaves_no_passes_and_a_second_probe_keeps_none() -> None:
    assert _probed(keep=False).first_passes is None
    trainer = _probed()
    first = trainer.first_passes
    probe = StepProbe(trainer, keep=True)
    probe.probes = 1  # a probe while waiting for the first round: timed only
    probe.run()
    assert trainer.first_passes is first
