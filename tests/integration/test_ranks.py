"""A real ``swarm peer --nproc 2`` (rank 0 plus a gloo worker rank) joins a run beside a one-process peer and
commits its rounds, its ranks sharding θl with FSDP (``[inner] sharding = "fsdp"``). The ranks' arithmetic, DDP's
and FSDP's, against one process is tests/unit/test_ranks.py's (one run here: each costs a minute on 2 cores)."""

from __future__ import annotations

import psutil
import pytest

from swarm.train.model.final_model import tensors_digest
from tests.integration.harness import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

RUN_FLAGS = ("--max-rounds", "2", "--inner-steps", "4", "--preset", "tiny", "--exit-grace-s", "0")


def _multiprocessing_children() -> set[int]:
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "multiprocessing" in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _assert_no_worker_left(before: set[int], swarm: Swarm) -> None:
    # the worker rank ended with its peer (orphans re-parent to this test process: tests/conftest.py); a
    # forkserver or resource tracker an earlier test of this worker process started lives on, and is not one
    # (a worker exits right after its peer: it may still be on its way out when the peer's exit is seen)
    # (the swarm's own processes are forks of the tests' launcher, a multiprocessing forkserver: not workers)
    ours = {p.pid for p in [swarm.coordinator, *swarm.peers.values()] if p is not None}
    workers = []
    for pid in _multiprocessing_children() - before - ours:
        try:
            workers.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, [" ".join(p.cmdline()) for p in alive if p.is_running()]


def test_a_two_rank_fsdp_peer_trains_with_a_one_process_peer_and_both_end_on_the_same_model(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('[inner]\nsharding = "fsdp"\n')
    swarm, before = Swarm(workdir=tmp_path), _multiprocessing_children()
    try:
        swarm.start_coordinator("--config", str(config), "--min-peers", "2", *RUN_FLAGS)
        swarm.start_peer("sharded", "--nproc", "2")
        swarm.start_peer("single")
        assert swarm.wait_peers(timeout_s=200) == {"sharded": 0, "single": 0}, swarm.log("sharded")[-3000:]
        assert "started 1 worker ranks for a 2-rank peer" in swarm.log("sharded")
        assert "FSDP: this rank holds" in swarm.log("sharded")  # rank 0's half of θl
        assert "FSDP" not in swarm.log("single")  # one process: nothing to shard
        for name in ("sharded", "single"):
            assert "run finished at round 2" in swarm.log(name)
        assert tensors_digest(swarm.final_model("sharded")) == tensors_digest(swarm.final_model("single"))
        _assert_no_worker_left(before, swarm)
    finally:
        swarm.close()
