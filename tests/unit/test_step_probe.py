"""The step-time probe a peer runs at its start (swarm/train/step_probe.py): its first round gets a time budget,
and nothing it does changes what the peer trains."""

from __future__ import annotations

import time

import pytest
import torch

from swarm.config import DataConfig, ModelConfig, RunConfig
from swarm.train.step_probe import probe_step_time
from swarm.train.trainer import LocalTrainer

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

RUN = RunConfig(
    model=ModelConfig(preset="bench"), data=DataConfig(max_bytes=200_000, batch_size=2, seq_len=16)
).validate()


def test_a_probed_trainer_trains_the_same_bits_from_the_same_batches() -> None:
    probed, plain = LocalTrainer(RUN, peer_index=1), LocalTrainer(RUN, peer_index=1)
    torch.manual_seed(7)
    step_s = probe_step_time(probed)
    after_probe = torch.random.get_rng_state()
    torch.manual_seed(7)
    assert torch.equal(after_probe, torch.random.get_rng_state())  # the random stream is given back
    assert step_s is not None and 0 < step_s < 10
    assert probed.sampler.batches_drawn == 0 and not probed.optimizer.state  # no batch taken, no update made
    assert all(p.grad is None for p in probed.model.parameters())
    probed.train(3)
    plain.train(3)
    assert all(torch.equal(a, b) for a, b in zip(probed.model.parameters(), plain.model.parameters()))


def test_a_slow_device_is_slow_at_the_probe_too() -> None:
    trainer = LocalTrainer(RUN, peer_index=0)
    given = []

    def throttle(compute_s: float) -> None:  # what peer.faults' slow@R does: wait after each step
        given.append(compute_s)
        time.sleep(0.05)

    trainer.throttle = throttle
    step_s = probe_step_time(trainer)
    assert step_s >= 0.05 and len(given) == 4  # the warm-up pass and three timed ones, each throttled
    assert step_s >= min(given) + 0.05


def test_the_update_is_timed_on_a_sample_of_the_parameters_and_scaled_to_all(monkeypatch) -> None:
    trainer = LocalTrainer(RUN, peer_index=0)
    monkeypatch.setattr("swarm.train.step_probe.UPDATE_SAMPLE", 1000)  # a cut through the first tensors
    before = [p.detach().clone() for p in trainer.model.parameters()]
    assert probe_step_time(trainer) > 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_a_peer_waiting_for_its_first_round_probes_again_and_keeps_the_fastest(monkeypatch) -> None:
    from swarm.train import step_probe

    trainer = LocalTrainer(RUN, peer_index=0)
    probe = step_probe.StepProbe(trainer)
    slow = [0.2]
    trainer.throttle = lambda compute_s: time.sleep(slow[0])  # a busy start: the first probe is slow
    first = probe.run()
    assert first >= 0.2 and probe.again() is None  # not due yet
    monkeypatch.setattr(step_probe, "PROBE_EVERY_S", 0.0)
    probe._next = 0.0
    slow[0] = 0.0  # the machine calmed down (how much, the machine's load says: the rule is to keep the fastest)
    assert probe.again() == probe.best <= first and probe.probes == 2  # probed again, and a slower pass is not kept
    trainer.train(1)
    assert probe.again() is None  # it trained: its rounds measure it from now on


def test_a_restarted_peer_reuses_the_step_time_it_measured_instead_of_probing() -> None:
    from swarm.train.step_probe import StepProbe

    trainer = LocalTrainer(RUN, peer_index=0)
    reported: list[float] = []
    probe = StepProbe(trainer, report=reported.append)
    assert probe.reuse(0.25) == 0.25 and probe.best == 0.25 and reported == [0.25]
    assert probe.probes == 0  # no pass was timed
    assert probe.reuse(None) is not None and probe.probes == 1  # nothing recorded: it probes
