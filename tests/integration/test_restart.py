"""Stopping the whole swarm and starting it again continues the same run from checkpoints."""

from __future__ import annotations

import re
import signal

import pytest

from swarm.final_model import tensors_digest
from tests.integration.harness import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_whole_swarm_restarts_from_checkpoints_and_continues_the_run(tmp_path):
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--max-rounds", "4", "--min-peers", "2", "--inner-steps", "10", "--exit-grace-s", "60")
        join = swarm.join
        for name in ("peer-0", "peer-1"):
            swarm.start_peer(name, "--checkpoint-every", "1")
        swarm.wait_status(lambda s: s["run"]["rounds_committed"] >= 2, timeout_s=120, what="two committed rounds")

        for proc in swarm.peers.values():
            proc.send_signal(signal.SIGTERM)
        assert all(code == 0 for code in swarm.wait_peers(timeout_s=60).values())
        swarm.coordinator.send_signal(signal.SIGTERM)
        assert swarm.coordinator.wait(timeout=60) == 0
        swarm.peers.clear()
        swarm.close()
        assert swarm.start_coordinator("--exit-grace-s", "60") == join, "a restart must keep the join string"
        committed_before = swarm.status()["run"]["rounds_committed"]
        assert committed_before >= 2
        for name in ("peer-0", "peer-1"):
            swarm.start_peer(name, "--checkpoint-every", "1")
        codes = swarm.wait_peers(timeout_s=180)
        assert codes == {"peer-0": 0, "peer-1": 0}, swarm.log("peer-0")[-3000:]
        # Nobody else holds the state after a full stop: the run continues only because a peer resumed
        # from its own checkpoint (the other may instead download it, if it left one round behind).
        resumed = [name for name in ("peer-0", "peer-1") if "resumed from own checkpoint" in swarm.log(name)]
        assert resumed, "no peer resumed from its checkpoint"
        for name in ("peer-0", "peer-1"):  # each got its peer index (its data shard) back
            first, second = re.findall(r"as peer index (\d+)", swarm.log(name))
            assert first == second, f"{name} rejoined with another data shard"
        final = swarm.status()
        assert final["run"]["rounds_committed"] == 4
        assert tensors_digest(swarm.final_model("peer-0")) == tensors_digest(swarm.final_model("peer-1"))
    finally:
        swarm.close()


def test_every_voter_killed_before_the_decision_resumes_from_its_vote_and_no_round_is_lost(tmp_path):
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--max-rounds", "4", "--min-peers", "2", "--inner-steps", "10", "--exit-grace-s", "60")
        for name in ("peer-0", "peer-1"):  # both report round 2, then die before they hear it committed
            swarm.start_peer(name, "--checkpoint-every", "1", "--faults", "crash@2:reported")
        assert swarm.wait_peers(timeout_s=180) == {"peer-0": 137, "peer-1": 137}
        run = swarm.wait_status(lambda s: s["run"]["committed_round"] == 2, timeout_s=30, what="round 2 committed")["run"]
        round_two = run["committed_hash"]

        for name in ("peer-0", "peer-1"):  # no live peer holds round 2: only their disks do
            swarm.start_peer(name, "--checkpoint-every", "1")
        codes = swarm.wait_peers(timeout_s=180)
        assert codes == {"peer-0": 0, "peer-1": 0}, swarm.log("peer-0")[-3000:]
        for name in ("peer-0", "peer-1"):
            assert f"resumed from own vote for round 2, which was committed (hash {round_two})" in swarm.log(name)
        final = swarm.status()["run"]
        # round 2 stands; round 3, opened for the two dead peers, is voided; the run ends after 4 commits
        assert final["rounds_committed"] == 4
        assert final["committed_round"] == final["rounds_committed"] + final["rounds_voided"]
        assert tensors_digest(swarm.final_model("peer-0")) == tensors_digest(swarm.final_model("peer-1"))
    finally:
        swarm.close()
