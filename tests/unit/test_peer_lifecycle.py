"""The peer daemon's lifecycle, in one process: real trainers and the real coordinator engine, fake
network parts (tests/unit/fake_swarm.py). Each test is a whole small run: peers end with identical
state, through a coordinator outage, a late join, a groupmate that leaves mid-run, a peer behind at the
end. The same scenarios with real processes and hivemind are in tests/integration."""

import dataclasses
import logging
import re

import pytest

from coordinator.rounds import controller
from peer.daemon import PeerState
from swarm.config import DataConfig, ModelConfig, RoundConfig, RunConfig
from tests.unit.fake_swarm import FakeCoordinator, FakeNet, FakeParts, PeerThread, engine_join, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

RUN = RunConfig(
    seed=0,
    model=ModelConfig(preset="bench"),
    data=DataConfig(max_bytes=200_000, num_shards=3, batch_size=2, seq_len=16, eval_batches=1),
    rounds=RoundConfig(inner_steps=2, max_rounds=4, min_peers=2, eval_every_rounds=100),
).validate()


def swarm(run=RUN):
    coordinator = FakeCoordinator(run)
    return coordinator, FakeParts(coordinator, FakeNet(run))


def start(parts, tmp_path, name, **options):
    peer = PeerThread(parts, tmp_path / name, name=name, **options)
    peer.start()
    return peer


def finish(*peers, timeout_s=90):
    for p in peers:
        p.join(timeout_s)
        assert not p.is_alive(), f"{p.name} did not finish"
    return [p.code for p in peers]


def committed(coordinator) -> int:
    return coordinator.status().run.committed_round


def committed_hash(coordinator, round_no: int) -> str:
    """The hash the coordinator committed for round_no, asked as a member (the peers may have left)."""
    observer, _ = engine_join(coordinator.engine, name="observer")
    return coordinator.engine.round_info(observer.peer_id, round_no).committed_hash


def test_two_peers_run_to_the_end_with_identical_state(tmp_path):
    coordinator, parts = swarm()
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    assert finish(a, b) == [0, 0]
    assert a.trainer.round_no == b.trainer.round_no == 4
    assert a.trainer.state.state_hash == b.trainer.state.state_hash
    assert (tmp_path / "a" / "final" / "model.safetensors").exists()
    run = coordinator.status().run
    assert (run.rounds_committed, run.rounds_voided) == (4, 0)
    round_trip = [PeerState.TRAINING, PeerState.EXCHANGING, PeerState.DECIDING, PeerState.READY]
    first = a.states.index(PeerState.TRAINING)  # READY before it, while round 1 waits for min_peers
    assert a.states[first : first + 4] == round_trip and a.states[-1] is PeerState.FINISHING, a.states


def test_a_coordinator_outage_is_bridged_by_group_decisions_that_it_confirms_afterwards(tmp_path):
    coordinator, parts = swarm()
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    wait_until(lambda: committed(coordinator) >= 1, what="round 1")
    coordinator.down.set()
    # the group goes on alone: rounds decided from the DHT votes pile up in each peer's backlog
    wait_until(
        lambda: all(p.daemon_.link.backlog and PeerState.OFFLINE_DECIDING in p.states for p in (a, b)),
        what="a round run and decided by the group alone",
    )
    # each report of such a round carries the group's signed votes (coordinator/rounds/offline_votes.py checks them)
    entry = a.daemon_.link.backlog[0]
    assert {v.peer_id for v in entry.request.group_votes} == {a.daemon_.peer_id, b.daemon_.peer_id}
    decided_alone = {e.request.round: e.committed_hash or "" for e in a.daemon_.link.backlog}
    coordinator.down.clear()
    assert finish(a, b) == [0, 0]
    # every round the group decided alone is decided alike by the coordinator, once back (a round after the
    # outage may still be voided on a loaded machine, when one peer reaches it after the other's group formed)
    for round_no, group_hash in decided_alone.items():
        assert committed_hash(coordinator, round_no) == group_hash, round_no
    assert a.trainer.state.state_hash == b.trainer.state.state_hash and a.trainer.round_no == b.trainer.round_no
    run = coordinator.status().run
    assert run.rounds_committed == 4 and run.committed_round == a.trainer.round_no
    assert committed_hash(coordinator, a.trainer.round_no) == a.trainer.state.state_hash


def test_back_after_an_outage_the_coordinator_hears_the_groups_rounds_before_the_one_its_votes_could_not_decide(
    tmp_path,
):
    """The group decides rounds by its votes while the coordinator is down; then a round's votes are lost, so
    the members must wait for the coordinator, which comes back behind them. They report the rounds the group
    decided first (``report_backlog_first``): the coordinator confirms those, then decides the waiting round —
    nothing voided, nobody resyncs. Reporting only the waiting round would leave the coordinator waiting for
    the older rounds' reports, which the members send only after (a chaos soak's deadlock: it voided them)."""
    coordinator, parts = swarm(RUN.replace(rounds=RoundConfig(inner_steps=2, max_rounds=8, min_peers=2)))
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    wait_until(lambda: committed(coordinator) >= 1, what="round 1")
    coordinator.down.set()
    lost = committed(coordinator) + 3  # two rounds decided by the group, then one whose votes are lost
    parts.net.drop_votes_from = lost
    wait_until(
        lambda: parts.net.dropped.get(lost) == {a.daemon_.peer_id, b.daemon_.peer_id},
        what=f"both votes of round {lost} lost",
    )
    # the group's rounds, not yet heard (a member that missed round 1's decision holds that one too)
    assert all(p.daemon_.link.backlog[-1].request.round == lost - 1 for p in (a, b))
    coordinator.down.clear()
    assert finish(a, b) == [0, 0]
    assert a.trainer.state.state_hash == b.trainer.state.state_hash and a.trainer.round_no == 8
    run = coordinator.status().run
    assert (run.rounds_committed, run.rounds_voided) == (8, 0)
    assert not any(PeerState.SYNCING in p.states for p in (a, b))  # no decision contradicted the group's


def test_a_late_joiner_downloads_the_committed_state_and_takes_part(tmp_path):
    # 30 rounds of 2 steps: enough that the late peer's sync (and its 1 s back-off) lands before the run ends,
    # also on a loaded machine (with 12 it sometimes did not, and the peer never took part)
    coordinator, parts = swarm(RUN.replace(rounds=RoundConfig(inner_steps=2, max_rounds=30, min_peers=2)))
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    wait_until(lambda: committed(coordinator) >= 2, what="round 2")
    late = start(parts, tmp_path, "late")
    assert finish(a, b, late) == [0, 0, 0]
    assert len({p.trainer.state.state_hash for p in (a, b, late)}) == 1
    status = coordinator.status()
    joined = next(p for p in status.peers if p.name == "late")
    assert joined.rounds_joined >= 1  # it contributed after syncing
    assert late.states[0] is PeerState.SYNCING and PeerState.TRAINING in late.states


def test_a_peer_that_leaves_mid_run_does_not_stop_the_others(tmp_path):
    coordinator, parts = swarm(RUN.replace(rounds=RoundConfig(inner_steps=2, max_rounds=5, min_peers=1)))
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    wait_until(lambda: committed(coordinator) >= 2, what="round 2")
    b.daemon_.stop.set()  # SIGTERM: it leaves cleanly, holding a committed state
    assert finish(a, b) == [0, 0]
    assert a.trainer.round_no == 5
    assert b.trainer.round_no < 5
    assert b.trainer.state.state_hash == committed_hash(coordinator, b.trainer.round_no)


def test_a_peer_still_behind_when_the_run_finishes_gets_the_final_state(tmp_path):
    """The last round commits while a peer is still downloading an older one: the holders stay until it
    has the final state, so every peer ends with the final model."""
    coordinator, parts = swarm(RUN.replace(rounds=RoundConfig(inner_steps=2, max_rounds=3, min_peers=2)))
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    wait_until(lambda: committed(coordinator) >= 2, what="round 2")
    late = start(parts, tmp_path, "late", faults=_delay_sync(2, seconds=1.5))
    assert finish(a, b, late) == [0, 0, 0]
    assert len({p.trainer.state.state_hash for p in (a, b, late)}) == 1 and late.trainer.round_no == 3
    assert (tmp_path / "late" / "final" / "model.safetensors").exists()


def test_a_peer_that_finishes_a_second_run_in_the_same_state_dir_keeps_the_first_runs_final_model(tmp_path, caplog):
    """Run 1 ends with its final model in a/final; run 2 (another coordinator) with the same --state-dir warns at
    join and moves run 1's file aside to model.<run 1's id>.safetensors when it writes its own."""
    from swarm.train.model.final_model import tensors_digest

    one = RUN.replace(rounds=RoundConfig(inner_steps=2, max_rounds=1, min_peers=1))
    first, parts = swarm(one)
    assert finish(start(parts, tmp_path, "a")) == [0]
    final = tmp_path / "a" / "final" / "model.safetensors"
    first_id, first_digest = first.engine.run.run_id, tensors_digest(final)
    second, parts = swarm(one.replace(seed=1))
    with caplog.at_level(logging.INFO, logger="peer"):
        assert finish(start(parts, tmp_path, "a")) == [0]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].endswith(
        f"] {final} holds run {first_id}'s final model; it will be replaced"
        " when this run finishes — use another --state-dir to keep it"
    )
    assert tensors_digest(final.with_name(f"model.{first_id}.safetensors")) == first_digest
    assert tensors_digest(final) != first_digest and second.engine.run.run_id != first_id


def test_a_peer_logs_its_progress_within_a_round_that_trains_longer_than_the_interval(tmp_path, caplog, monkeypatch):
    """With the interval (30 s) at 0 every inner step is past it: the peer's round budget and its trainer's clock
    reach the progress line, which names the round and counts its steps."""
    import peer.report.progress

    monkeypatch.setattr(peer.report.progress, "PROGRESS_EVERY_S", 0.0)
    _, parts = swarm(RUN.replace(rounds=RoundConfig(inner_steps=4, max_rounds=1, min_peers=1)))
    with caplog.at_level(logging.INFO, logger="peer.report.progress"):
        assert finish(start(parts, tmp_path, "a")) == [0]
    lines = [
        re.sub(r"^\[p-[0-9a-f]+ ", "[p ", r.getMessage()) for r in caplog.records if r.name == "peer.report.progress"
    ]
    assert [line.split(",")[0] for line in lines] == [f"[p r1] training: step {n} of 4" for n in (1, 2, 3, 4)]


def _plan(spec: str):
    from peer.faults import FaultPlan

    return FaultPlan.parse(spec)


def _delay_sync(round_no: int, *, seconds: float):
    return _plan(f"delay@{round_no}:syncing={seconds}")


def test_with_the_controller_on_a_codec_change_mid_run_keeps_the_peers_identical(tmp_path):
    """Links measured fast, then a thousand times slower from round 3: the coordinator's choice moves from
    fp32 to int4 mid-run, both peers send with it (and keep what it drops as error feedback), every round
    commits and both end on the committed hash."""
    run = RUN.replace(rounds=dataclasses.replace(RUN.rounds, max_rounds=8, controller="auto")).validate()
    coordinator, parts = swarm(run)
    parts.net.links = lambda peer_id, round_no: (1e5, 1e5) if round_no < 3 else (0.1, 0.1)  # Mbit/s
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    assert finish(a, b) == [0, 0]
    codecs = [controller.from_json(coordinator.engine._store.get_round(r).choice).codec for r in range(1, 9)]
    assert codecs[0] == "fp32" and codecs[-1] == "int4", codecs
    run_status = coordinator.status().run
    assert (run_status.rounds_committed, run_status.rounds_voided) == (8, 0)
    assert run_status.controller.codec == "int4" and "uplink" in run_status.controller.reason
    assert a.trainer.state.state_hash == b.trainer.state.state_hash == committed_hash(coordinator, 8)
    assert a.trainer.error_feedback[0].residual.abs().sum() > 0  # int4 dropped something; fp32 would not


class _SlowTrainer:
    """A LocalTrainer whose inner steps take ``STEP_S`` longer each (a throttled device), for peer index 2."""

    STEP_S = 0.3

    def __new__(cls, run, *, peer_index, device, **options):
        from swarm.train.trainer import LocalTrainer

        trainer = LocalTrainer(run, peer_index=peer_index, device=device, **options)
        if peer_index == 2:
            fast = trainer.train
            trainer.trained = []  # (the round it trained for, steps) of each call

            def train(steps: int):
                import dataclasses
                import time

                trainer.trained.append((trainer.round_no + 1, steps))
                start = time.perf_counter()
                stats = fast(steps)
                time.sleep(cls.STEP_S * steps)
                return dataclasses.replace(stats, inner_time_s=time.perf_counter() - start)

            trainer.train = train
        return trainer


def _reported_steps(coordinator, round_no: int) -> dict[str, int]:
    names = {p.id: p.name for p in coordinator.status().peers}
    return {names[r.peer_id]: r.inner_steps for r in coordinator.engine._store.reports(round_no)}


def test_a_slow_peer_gets_a_smaller_time_budget_and_every_peer_ends_identical(tmp_path, monkeypatch):
    """A peer 10x slower than the others trains what fits in their time: no round waits for it or is voided.

    The slack (0.8 s) is below what the slow peer's 4 steps sleep beyond the others' (1.2 s), so it is always cut,
    and above what a busy machine adds to a fast peer's 4 measured steps, so those are never cut."""
    monkeypatch.setattr("peer.round_parts.LocalTrainer", _SlowTrainer)
    run = RUN.replace(
        rounds=RoundConfig(
            inner_steps=4, max_rounds=4, min_peers=3, eval_every_rounds=100, straggler_slack_s=0.8, report_grace_s=10.0
        )
    )
    coordinator, parts = swarm(run)
    a, b, c = (start(parts, tmp_path, name) for name in ("a", "b", "c"))
    assert finish(a, b, c) == [0, 0, 0]
    assert len({p.trainer.state.state_hash for p in (a, b, c)}) == 1
    status = coordinator.status()
    assert (status.run.rounds_committed, status.run.rounds_voided) == (4, 0)
    slow = next(p.daemon_.options.name for p in (a, b, c) if p.trainer.peer_index == 2)
    fast = next(p.daemon_.options.name for p in (a, b, c) if p.trainer.peer_index != 2)
    # round 1 counts every peer: the start-up probes do not see this fake's slowness (only train() sleeps), so
    # each peer does the full steps, or fewer where a busy machine made its probe read 5x slower than another's
    first = _reported_steps(coordinator, 1)
    assert set(first) == {"a", "b", "c"}, first
    later = [_reported_steps(coordinator, r) for r in (2, 3, 4)]
    # 1 step at these speeds; 2 when a loaded machine made a fast peer's measured step time 2x longer
    assert all(steps[fast] == 4 and steps.get(slow, 1) <= 2 for steps in later), later


def test_a_peer_left_out_while_it_trains_stops_training_that_round(tmp_path, monkeypatch):
    """A peer far slower than its start-up probe said (this fake sleeps only in train()) is left out of round 1
    at the deadline plus the grace (or cut to a budget first, under load); its heartbeat hears so and it stops
    training that round after a part of its steps (it used to train all 16, ~5 s here, for a round already lost),
    resyncs and ends identical."""
    monkeypatch.setattr("peer.round_parts.LocalTrainer", _SlowTrainer)
    run = RUN.replace(
        rounds=RoundConfig(
            inner_steps=16, max_rounds=2, min_peers=3, eval_every_rounds=100, straggler_slack_s=0.2, report_grace_s=1.0
        )
    )
    coordinator, parts = swarm(run)
    peers = [start(parts, tmp_path, name) for name in ("a", "b", "c")]
    assert finish(*peers) == [0, 0, 0]
    assert len({p.trainer.state.state_hash for p in peers}) == 1
    status = coordinator.status()
    assert (status.run.rounds_committed, status.run.rounds_voided) == (2, 0)
    slow = next(p for p in peers if p.trainer.peer_index == 2)
    # left out of round 1, or, when the heartbeat's budget reached it first (under load), cut to the steps that fit
    # the fastest's time and counted with those: either way not the 16 of a full round
    assert _reported_steps(coordinator, 1).get(slow.daemon_.options.name, 0) < 16
    trained_in_round_1 = sum(steps for round_no, steps in slow.trainer.trained if round_no == 1)
    assert trained_in_round_1 < 16, slow.trainer.trained


def test_a_stalled_peer_is_left_out_and_the_others_commit_without_it(tmp_path):
    """A peer that stalls after its inner steps is left out of that round at the deadline plus the grace: the
    others commit without it, it is told, resyncs and ends with the same state."""
    run = RUN.replace(
        rounds=RoundConfig(
            inner_steps=2, max_rounds=4, min_peers=3, eval_every_rounds=100, straggler_slack_s=0.5, report_grace_s=3.0
        )
    )
    coordinator, parts = swarm(run)
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    c = start(parts, tmp_path, "c", faults=_plan("delay@2:trained=8"))
    assert finish(a, b, c) == [0, 0, 0]
    assert len({p.trainer.state.state_hash for p in (a, b, c)}) == 1
    status = coordinator.status()
    assert (status.run.rounds_committed, status.run.rounds_voided) == (4, 0)
    assert set(_reported_steps(coordinator, 2)) == {"a", "b"}
    missed = {p.name: p.rounds_missed for p in status.peers}
    assert missed["a"] == missed["b"] == 0 and missed["c"] >= 1
    assert PeerState.SYNCING in c.states[c.states.index(PeerState.TRAINING) :]


def test_a_far_slower_device_gets_a_smaller_budget_already_in_its_first_round(tmp_path):
    """Its start-up step-time probe (swarm/train/step_probe.py, throttled like its steps) says it is ~10x slower:
    round 1 budgets it too (before the probe it trained the full H there, missed its group and resynced)."""
    run = RUN.replace(
        rounds=RoundConfig(
            inner_steps=8, max_rounds=2, min_peers=3, eval_every_rounds=100, straggler_slack_s=0.0, report_grace_s=5.0
        )
    )
    coordinator, parts = swarm(run)
    a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
    c = start(parts, tmp_path, "c", faults=_plan("slow@1:compute=20"))
    assert finish(a, b, c) == [0, 0, 0]
    assert len({p.trainer.state.state_hash for p in (a, b, c)}) == 1
    first = _reported_steps(coordinator, 1)
    assert first["a"] == first["b"] == 8 and first["c"] < 8, first


def test_a_peer_of_another_wire_protocol_than_its_coordinators_leaves_at_once_and_says_why(
    tmp_path, monkeypatch, caplog
):
    """A coordinator of another release admits the peer (an older one does not check); the peer cannot average
    with that run's peers, so it says so and leaves instead of voiding their rounds."""
    import peer.link.coordinator_link

    coordinator, parts = swarm()
    monkeypatch.setattr(peer.link.coordinator_link, "PROTOCOL", peer.link.coordinator_link.PROTOCOL + 1)
    newer = start(parts, tmp_path, "newer")
    assert finish(newer) == [2]
    assert "ask the run's operator which Swarm release the coordinator runs, install it here" in caplog.text
    assert PeerState.TRAINING not in newer.states
    assert [p.state for p in coordinator.status().peers if p.name == "newer"] == ["left"]
