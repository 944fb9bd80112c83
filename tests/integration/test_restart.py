"""Peers killed at the worst moment, and a whole swarm stopped and started again, continue the same run."""

from __future__ import annotations

import re
import signal

import pytest

from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import Swarm, poll

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(360)]

PEERS = ("peer-0", "peer-1")


def test_killed_voters_resume_from_their_votes_and_a_stopped_swarm_resumes_from_checkpoints(tmp_path):
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--max-rounds", "5", "--min-peers", "2", "--inner-steps", "10", "--exit-grace-s", "60")
        join = swarm.join
        # 1. Both peers report round 2, then are killed (kill -9) before they hear it was committed.
        for name in PEERS:
            swarm.start_peer(name, "--checkpoint-every", "1", "--faults", "crash@2:reported")
        assert swarm.wait_peers(timeout_s=180) == {name: 137 for name in PEERS}
        run = swarm.wait_status(lambda s: s["run"]["committed_round"] == 2, timeout_s=30, what="round 2 committed")[
            "run"
        ]
        round_two = run["committed_hash"]

        # No live peer holds round 2 any more, only their disks: restarted, they resume from their votes.
        for name in PEERS:
            swarm.start_peer(name, "--checkpoint-every", "1")
        swarm.wait_status(lambda s: s["run"]["rounds_committed"] >= 3, timeout_s=120, what="a round after the kill")
        # The first back can only resume from its vote. The other resumes from its own too, unless the
        # first has committed a newer round alone by then (a loaded machine): then it downloads that.
        resumed = f"resumed from own vote for round 2, which was committed (hash {round_two})"
        poll(
            lambda: all(resumed in swarm.log(name) or "synced to round" in swarm.log(name) for name in PEERS),
            timeout_s=120,
            what="both restarted peers to take up the run",
        )
        assert any(resumed in swarm.log(name) for name in PEERS), swarm.log("peer-0")[-2000:]

        # 2. Stop everything (SIGTERM: peers checkpoint and leave, the coordinator exits) and start again.
        for proc in swarm.peers.values():
            proc.send_signal(signal.SIGTERM)
        assert all(code == 0 for code in swarm.wait_peers(timeout_s=60).values())
        swarm.coordinator.send_signal(signal.SIGTERM)
        assert swarm.coordinator.wait(timeout=60) == 0
        swarm.peers.clear()
        swarm.close()
        assert swarm.start_coordinator("--exit-grace-s", "60") == join, "a restart must keep the join string"
        for name in PEERS:
            swarm.start_peer(name, "--checkpoint-every", "1")
        codes = swarm.wait_peers(timeout_s=180)
        assert codes == {name: 0 for name in PEERS}, swarm.log("peer-0")[-3000:]
        # Nobody else holds the state after a full stop: the run continues only because a peer resumed
        # from its own checkpoint (the other may instead download it, if it left one round behind).
        assert any("resumed from own checkpoint" in swarm.log(name) for name in PEERS), "no peer resumed"
        for name in PEERS:  # every restart got the peer's index (its data shard) back
            indices = re.findall(r"as peer index (\d+)", swarm.log(name))
            assert len(indices) == 3 and len(set(indices)) == 1, f"{name} rejoined with another data shard"

        final = swarm.status()["run"]
        assert final["rounds_committed"] == 5
        # no committed round lost: every round number was committed or voided exactly once
        assert final["committed_round"] == final["rounds_committed"] + final["rounds_voided"]
        assert tensors_digest(swarm.final_model("peer-0")) == tensors_digest(swarm.final_model("peer-1"))
    finally:
        swarm.close()


def test_a_peer_that_dies_is_restarted_at_once_without_its_imports_and_ends_on_the_run_s_model(tmp_path):
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--max-rounds", "3", "--min-peers", "2", "--inner-steps", "10", "--exit-grace-s", "60")
        swarm.start_peer("steady")
        # kill -9 of its own process right after it reported round 2 (peer/faults.py): an out-of-memory kill;
        # cold: a fresh interpreter, as from a shell: its first start pays the imports
        swarm.start_peer(
            "phoenix", "--checkpoint-every", "1", "--faults", "crash@2:reported", "--max-restarts", "2", cold=True
        )
        assert swarm.wait_peers(timeout_s=240) == {"steady": 0, "phoenix": 0}, swarm.log("phoenix")[-3000:]
        log = swarm.log("phoenix")
        assert "fault injection: crashing at round 2" in log
        assert re.search(
            r"the peer process crashed \(exit 137\) after [\d.]+s; starting it again at once from its "
            r"state dir \(restart 1 of 2\)",
            log,
        )
        starts = [float(s) for s in re.findall(r"first round: training [\d.]+s after launch \(imports ([\d.]+)s", log)]
        assert len(starts) == 2, log[-3000:]
        assert starts[1] < starts[0], f"the restart paid the imports again: {starts}"  # forked with them loaded
        status = swarm.status()
        assert status["run"]["rounds_committed"] == 3
        assert {p["name"]: p["restarts"] for p in status["peers"]} == {"steady": 0, "phoenix": 1}  # swarm status
        assert tensors_digest(swarm.final_model("steady")) == tensors_digest(swarm.final_model("phoenix"))
    finally:
        swarm.close()
