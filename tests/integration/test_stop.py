"""A peer stops within seconds when told to (SIGTERM while training, syncing, or waiting for a coordinator that
is gone), and none is left running at the end of a run: one behind when the run finished either gets the final
model or exits non-zero saying what it holds and where."""

from __future__ import annotations

import re
import signal
import time

import pytest

from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import Swarm, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

STOP_WITHIN_S = 5.0  # SIGTERM → process gone; peer/run.py's hard deadline is 6 s, a clean leave takes ~1 s

# one peer is enough to train; round 2 is made slow (slow@2) so that a test finds it training
SOLO = """
[model]
preset = "tiny"

[rounds]
inner_steps = 30
max_rounds = 50
min_peers = 1
"""


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(workdir=tmp_path)
    yield s
    s.close()


def stop_and_time(swarm: Swarm, name: str) -> tuple[int, float]:
    """SIGTERM ``name``; (its exit code, seconds until it was gone)."""
    proc = swarm.peers[name]
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except Exception:
        raise AssertionError(f"{name} did not exit after SIGTERM:\n{swarm.stacks(name)}") from None
    seconds = time.monotonic() - started
    print(f"{name}: SIGTERM to exit {seconds:.2f}s, code {code}")
    return code, seconds


def test_sigterm_stops_a_training_peer_and_a_syncing_peer_within_seconds(swarm, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(SOLO)
    swarm.start_coordinator("--config", str(config), "--exit-grace-s", "0")
    # round 2: 30 steps of ~0.5 s each (a part of a round's steps is 1/16 of them: here one step)
    swarm.start_peer("trainer", "--faults", "slow@2:compute=10")
    swarm.wait_status(lambda s: s["run"]["committed_round"] >= 1, timeout_s=60, what="round 1 to commit")

    # a joiner whose download of round 1 hangs (the fault holds it 60 s before it asks a holder)
    swarm.start_peer("joiner", "--faults", "delay@1:syncing=60")
    poll(
        lambda: "delaying 60.0s at round 1, phase syncing" in swarm.log("joiner"),
        timeout_s=60,
        what="the joiner to start its download",
    )
    code, seconds = stop_and_time(swarm, "joiner")
    assert code == 0, swarm.log("joiner")[-3000:]
    assert seconds < STOP_WITHIN_S, f"a syncing peer took {seconds:.1f}s to stop:\n{swarm.log('joiner')[-3000:]}"
    assert "SIGTERM while syncing" in swarm.log("joiner")

    swarm.wait_status(
        lambda s: any(
            p["name"] == "trainer" and p["state"] == "training" and p["metrics"]["round"] >= 2 for p in s["peers"]
        ),
        timeout_s=60,
        what="the peer to train round 2",
    )
    code, seconds = stop_and_time(swarm, "trainer")
    assert code == 0, swarm.log("trainer")[-3000:]
    assert seconds < STOP_WITHIN_S, f"a training peer took {seconds:.1f}s to stop:\n{swarm.log('trainer')[-3000:]}"
    assert "SIGTERM while training" in swarm.log("trainer")


def test_a_peer_waiting_for_a_departed_coordinator_stops_on_sigterm_or_gives_up_by_itself(swarm, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(SOLO.replace("min_peers = 1", "min_peers = 3"))  # never opens a round: both peers wait
    swarm.start_coordinator("--config", str(config), "--exit-grace-s", "0")
    swarm.start_peer("waits")
    swarm.start_peer("gives-up", "--join-timeout-s", "4")
    swarm.wait_status(
        lambda s: sum(p["state"] == "ready" for p in s["peers"]) == 2, timeout_s=60, what="both peers to be ready"
    )
    swarm.kill_coordinator()
    poll(lambda: "get round: " in swarm.log("waits"), timeout_s=30, what="the peer to wait for the coordinator")

    code, seconds = stop_and_time(swarm, "waits")
    assert code == 0, swarm.log("waits")[-3000:]
    assert seconds < STOP_WITHIN_S, f"a waiting peer took {seconds:.1f}s to stop:\n{swarm.log('waits')[-3000:]}"

    # the other one waited its --join-timeout-s, then said so in one sentence and exited non-zero
    assert swarm.peers["gives-up"].wait(timeout=40) == 1, swarm.log("gives-up")[-3000:]
    assert re.search(
        r"the coordinator at \S+ has not answered for \d+s \(get round\) and this peer has no round it "
        r"can run without it; exiting",
        swarm.log("gives-up"),
    ), swarm.log("gives-up")[-3000:]


LAST_ROUND_HELD_OPEN = """
[model]
preset = "tiny"

[rounds]
inner_steps = 10
max_rounds = 2
min_peers = 2
exchange_timeout_s = 60.0
round_timeout_s = 90.0
"""


def test_a_peer_behind_when_the_run_finishes_exits_non_zero_saying_what_it_holds_once_no_holder_is_left(
    swarm, tmp_path
):
    """The holders serve the final state 1 s only (--final-serve-s 1), and the late peer's download of it waits 8 s
    first: nobody is left to download it from. The coordinator stays while the peer is behind, tells it there is no
    holder, and the peer exits 1 with one sentence naming its round, its hash and its checkpoint; nothing hangs."""
    config = tmp_path / "run.toml"
    config.write_text(LAST_ROUND_HELD_OPEN)
    swarm.start_coordinator("--config", str(config), "--exit-grace-s", "0")
    swarm.start_peer("peer-0", "--final-serve-s", "1", "--faults", "delay@2:reducing=8")  # the last round, held open
    swarm.start_peer("peer-1", "--final-serve-s", "1")
    poll(
        lambda: "at round 2, phase reducing" in swarm.log("peer-0"),
        timeout_s=60,
        what="the last round's exchange to start",
    )
    swarm.start_peer("late", "--faults", "delay@2:syncing=8")
    status = swarm.wait_status(
        lambda s: any(p["name"] == "late" for p in s["peers"]), timeout_s=60, what="the late peer to join"
    )
    assert status["run"]["committed_round"] == 1, "the run finished before the late peer arrived"

    assert swarm.peers["peer-0"].wait(timeout=60) == 0 and swarm.peers["peer-1"].wait(timeout=30) == 0
    finished = time.monotonic()
    code = swarm.peers["late"].wait(timeout=40)
    late = swarm.log("late")
    if code == 0:  # it got the final state after all (a machine so loaded that the holders outlasted its delay)
        digests = {tensors_digest(swarm.final_model(n)) for n in ("peer-0", "peer-1", "late")}
        assert len(digests) == 1, "the late peer's final model differs from the others'"
    else:
        assert code == 1, late[-3000:]
        assert time.monotonic() - finished < 30
        sentence = re.search(
            r"the run finished at round 2 while this peer held (.*); no holder is left to download "
            r"round 2 from, so it wrote no final model",
            late,
        )
        assert sentence, late[-3000:]
        held = sentence.group(1)
        # it synced round 1 (a joiner during round 2) and checkpointed it; or, slower, it was still at round 0
        assert re.match(r"round 1 \(hash [0-9a-f]{16}\); its state is in .*late/checkpoint$", held) or held.startswith(
            "round 0"
        ), held
        assert not swarm.final_model("late").exists()
    assert swarm.coordinator.wait(timeout=30) == 0
