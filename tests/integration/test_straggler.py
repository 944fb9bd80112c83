"""A really slow peer (``--faults slow@1:compute=4``: each inner step takes 4x its compute) among three: the
coordinator gives it a smaller step budget from its measured speed, so no round waits for it or is voided,
and every peer ends on the same model."""

from __future__ import annotations

import pytest

from coordinator.store.database import STORE_FILE, Store
from coordinator.store.records import COMMITTED
from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(240)]

# ~15 ms per inner step on one core: a full-speed round is 0.3 s of compute, the slow peer's 1.2 s. A peer
# finishing the full steps 0.2 s after the fastest still does them all (noise on a loaded machine).
RUN = """
[model]
preset = "tiny"

[data]
batch_size = 4
seq_len = 32
max_bytes = 300000
num_shards = 4
eval_batches = 2

[rounds]
inner_steps = 20
max_rounds = 4
min_peers = 3
eval_every_rounds = 100
straggler_slack_s = 0.2
matchmaking_window_s = 10.0
exchange_timeout_s = 10.0
round_timeout_s = 60.0
"""


def test_a_peer_four_times_slower_trains_fewer_steps_and_no_round_waits_for_it_or_is_voided(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(RUN)
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--config", str(config), "--exit-grace-s", "5")
        swarm.start_peer("fast-0")
        swarm.start_peer("fast-1")
        swarm.start_peer("slow", "--faults", "slow@1:compute=4")
        assert swarm.wait_peers(timeout_s=180) == {"fast-0": 0, "fast-1": 0, "slow": 0}
        run = swarm.status()["run"] if swarm.status() else None
    finally:
        swarm.close()

    store = Store(tmp_path / "coordinator" / STORE_FILE, read_only=True)
    try:
        names = {p.peer_id: p.name for p in store.peers()}
        rows = [store.get_round(r) for r in range(1, 5)]
        steps = [{names[r.peer_id]: r.inner_steps for r in store.reports(n)} for n in range(1, 5)]
    finally:
        store.close()
    assert [row.outcome for row in rows] == [COMMITTED] * 4, ([row.reason for row in rows], run)
    # round 1: the full steps (the start-up step-time probe cuts steps only from 5x slower:
    # coordinator/budgets.PROBED_SLOWDOWN); the later rounds budgeted by the measured step times
    assert set(steps[0]) == {"fast-0", "fast-1", "slow"}, steps
    for budgeted in steps[1:]:
        assert set(budgeted) == {"fast-0", "fast-1", "slow"}, steps
        assert budgeted["slow"] < min(budgeted["fast-0"], budgeted["fast-1"]), steps
        assert budgeted["slow"] <= 10, steps  # about a quarter of the fast peers' steps, not a rounding off them
    digests = {tensors_digest(swarm.final_model(name)) for name in ("fast-0", "fast-1", "slow")}
    assert len(digests) == 1, "the peers ended on different models"
