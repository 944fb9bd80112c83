"""A restarted peer starts from its own disk: the committed state from its checkpoint or vote (θ0 is not built),
the step time it measured before instead of a probe, and no download. In one process, with the real coordinator
engine and fake network parts (tests/unit/fake_swarm.py)."""

import logging

import pytest

from peer.daemon import PeerState
from swarm.config import DataConfig, ModelConfig, RoundConfig, RunConfig
from tests.unit.fake_swarm import FakeCoordinator, FakeNet, FakeParts, PeerThread, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="bench"),
    data=DataConfig(max_bytes=200_000, num_shards=3, batch_size=2, seq_len=16, eval_batches=1),
    rounds=RoundConfig(inner_steps=2, max_rounds=6, min_peers=2, eval_every_rounds=100),
).validate()


def test_a_restarted_peer_resumes_from_its_own_disk_without_a_probe_or_a_download(tmp_path, caplog):
    coordinator = FakeCoordinator(RUN)
    parts = FakeParts(coordinator, FakeNet(RUN))
    a, b = (PeerThread(parts, tmp_path / name, name=name) for name in ("a", "b"))
    a.start()
    b.start()
    wait_until(lambda: coordinator.status().run.committed_round >= 2, what="round 2")
    b.daemon_.stop.set()  # it leaves; the run waits for a second peer meanwhile (min_peers 2)
    b.join(60)
    assert not b.is_alive()
    caplog.clear()
    caplog.set_level(logging.INFO, logger="peer.state.resume")
    again = PeerThread(parts, tmp_path / "b", name="b")
    again.start()
    for peer in (a, again):
        peer.join(90)
        assert not peer.is_alive() and peer.code == 0
    assert "resumed from own" in caplog.text
    assert again.states[0] is not PeerState.SYNCING  # it held the committed state from its start
    assert again.daemon_.probe.probes == 0  # the step time it measured before stood in for a probe
    assert again.daemon_.stats.metrics().bytes_received == 0  # nothing downloaded
    # all 6 rounds committed; a round b left while it was open is voided (its work carries), and the run then ends a
    # round later: whether b's stop comes before round 3 opens is the machine's timing
    run = coordinator.status().run
    assert run.rounds_committed == 6
    assert again.trainer.round_no == a.trainer.round_no == 6 + run.rounds_voided
    assert again.trainer.state.state_hash == a.trainer.state.state_hash
