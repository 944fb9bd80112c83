"""A real ``swarm peer --nproc 2`` (rank 0 plus a gloo worker rank) joins a run and commits its rounds."""

from __future__ import annotations

import psutil
import pytest
from safetensors.torch import load_file

from tests.integration.harness import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_a_two_rank_peer_joins_a_run_and_commits_rounds(tmp_path):
    swarm = Swarm(workdir=tmp_path)
    try:
        swarm.start_coordinator("--max-rounds", "2", "--min-peers", "1", "--inner-steps", "4", "--preset", "tiny",
                                "--exit-grace-s", "0")
        swarm.start_peer("peer-0", "--nproc", "2")
        assert swarm.wait_peers(timeout_s=200) == {"peer-0": 0}, swarm.log("peer-0")[-3000:]
        assert "started 1 worker ranks for a 2-rank peer" in swarm.log("peer-0")
        assert "run finished at round 2" in swarm.log("peer-0")
        final = load_file(str(swarm.final_model("peer-0")))
        assert final and all(t.isfinite().all() for t in final.values())
        # the worker rank ended with its peer (orphans re-parent to this test process: tests/conftest.py)
        workers = [c for c in psutil.Process().children(recursive=True)
                   if c.status() != psutil.STATUS_ZOMBIE and "multiprocessing" in " ".join(c.cmdline())]
        assert not workers
    finally:
        swarm.close()
