"""The fault-injection plan: parsed strictly, each entry fires once, at exactly its round and phase."""

import subprocess
import sys

import pytest

from peer.faults import FaultPlan, FaultSpecError

pytestmark = pytest.mark.timeout(60)


def test_a_delay_fires_once_at_its_round_and_phase():
    plan = FaultPlan.parse("delay@2:reducing=1.5, drop@3:report")
    assert plan.fire(1, "reducing") == 0.0
    assert plan.fire(2, "sending") == 0.0
    assert plan.fire(2, "reducing") == 1.5
    assert plan.fire(2, "reducing") == 0.0  # fired already
    assert not plan.drops(2, "report")
    assert plan.drops(3, "report") and not plan.drops(3, "report")


@pytest.mark.parametrize(
    "spec, words",
    [
        ("crash@x:sending", "malformed"),
        ("crash@2:dancing", "'dancing' is not one of trained"),
        ("drop@2:sending", "is not one of report, heartbeat"),
        ("delay@2:reported", "a delay needs seconds"),
        ("slow@1:compute", "a slow a factor"),
        ("slow@1:memory=4", "'memory' is not one of compute"),
        ("slow@1:compute=0.5", "between 1 and 1000x"),
    ],
)
def test_a_malformed_plan_is_named(spec, words):
    with pytest.raises(FaultSpecError, match=words):
        FaultPlan.parse(spec)


def test_a_crash_exits_at_once_with_137():
    code = (
        "from peer.faults import FaultPlan; p = FaultPlan.parse('crash@4:averaged'); p.at(4, 'sending'); "
        "print('alive', flush=True); p.at(4, 'averaged'); print('not reached')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout) == (137, "alive\n")


def test_a_byzantine_plan_scales_from_its_round_on():
    plan = FaultPlan.parse("scale@3:delta=-100, scale@2:weight=1e6")
    assert plan.scale(2, "delta") == 1.0 and plan.scale(3, "delta") == -100.0 and plan.scale(9, "delta") == -100.0
    assert plan.scale(1, "weight") == 1.0 and plan.scale(2, "weight") == 1e6
    plan.at(3, "sending")  # a scale entry is not a phase fault: nothing fires, nothing sleeps
    for bad in ("scale@3:delta", "scale@3:speed=2", "scale@3:delta=inf"):
        with pytest.raises(FaultSpecError):
            FaultPlan.parse(bad)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_slow_plan_throttles_each_inner_step_from_its_round_on():
    """slow@2:compute=4: a trainer step of round 2 or later takes 4x its compute time, and the step time the
    trainer measures (what the peer reports to the coordinator) is the throttled one."""
    from swarm.config import DataConfig, ModelConfig, RoundConfig, RunConfig
    from swarm.train.trainer import LocalTrainer

    assert FaultPlan.parse("delay@1:trained=1").throttle(lambda: 1) is None  # nothing slowed: no hook at all
    plan = FaultPlan.parse("slow@2:compute=4")
    assert [plan.slowdown(r) for r in (1, 2, 5)] == [1.0, 4.0, 4.0]
    run = RunConfig(
        seed=0,
        model=ModelConfig(preset="bench"),
        data=DataConfig(max_bytes=200_000, num_shards=1, batch_size=2, seq_len=16, eval_batches=1),
        rounds=RoundConfig(inner_steps=2),
    ).validate()
    trainer = LocalTrainer(run, peer_index=0)
    round_now, computed = [1], []
    throttle = plan.throttle(lambda: round_now[0])
    trainer.throttle = lambda compute_s: (computed.append(compute_s), throttle(compute_s))
    full = trainer.train(3).inner_time_s
    assert len(computed) == 3 and full < 1.5 * sum(computed) + 0.5  # round 1: not slowed
    round_now[0], computed[:] = 2, []
    slow = trainer.train(3).inner_time_s
    assert len(computed) == 3 and 3.9 * sum(computed) < slow < 4 * sum(computed) + 1.0, (computed, slow)
