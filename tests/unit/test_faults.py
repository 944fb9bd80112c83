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


@pytest.mark.parametrize("spec, words", [
    ("crash@x:sending", "malformed"),
    ("crash@2:dancing", "'dancing' is not one of trained"),
    ("drop@2:sending", "is not one of report, heartbeat"),
    ("delay@2:reported", "a delay needs seconds"),
])
def test_a_malformed_plan_is_named(spec, words):
    with pytest.raises(FaultSpecError, match=words):
        FaultPlan.parse(spec)


def test_a_crash_exits_at_once_with_137():
    code = "from peer.faults import FaultPlan; p = FaultPlan.parse('crash@4:averaged'); p.at(4, 'sending'); " \
           "print('alive', flush=True); p.at(4, 'averaged'); print('not reached')"
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
