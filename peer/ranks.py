"""Starts the ranks of a multi-GPU peer (``swarm peer --nproc K``, or one process per rank under
``torchrun --nproc_per_node K -m swarm.app.cli peer ...``).

Rank 0 is the peer daemon; ranks 1..K-1 are worker processes that build the same trainer and then only
train in lockstep with it (``swarm.train.multi_gpu.ranks``). They hold nothing of their own worth keeping: rank 0
ends them when it leaves, and a worker whose rank 0 is gone exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from swarm.config import RunConfig
from swarm.train.multi_gpu.ranks import Ranks, join_ranks
from swarm.train.trainer import LocalTrainer

log = logging.getLogger(__name__)


@dataclass
class PeerRanks:
    """Rank 0's handle on the peer's ranks: its own place in the group and the workers it started."""

    ranks: Ranks
    workers: list[multiprocessing.process.BaseProcess] = field(default_factory=list)
    store_dir: Optional[str] = None

    def close(self) -> None:
        """End the workers (or, under torchrun, tell them to stop) and leave the process group."""
        if self.workers:
            for worker in self.workers:
                worker.terminate()
            for worker in self.workers:
                worker.join(timeout=10)
        else:
            self.ranks.send(None)  # a worker waits for its setup or its next order: None ends it
        self.ranks.close()
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)


def torchrun_rank() -> Optional[tuple[int, int]]:
    """(rank, world size) when torchrun started this process as one of several ranks, else None."""
    if "LOCAL_RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def start_ranks(nproc: int, *, device: str, threads: Optional[int]) -> PeerRanks:
    """Rank 0 (this process) and ``nproc - 1`` spawned workers, in one process group met through a file."""
    store_dir = tempfile.mkdtemp(prefix="swarm-ranks-")
    store_path = os.path.join(store_dir, "store")
    context = multiprocessing.get_context("spawn")  # no fork: this process may already run threads
    workers = [
        context.Process(
            target=worker_main, name=f"swarm-rank-{rank}", args=(rank, nproc, device, store_path, threads, os.getpid())
        )
        for rank in range(1, nproc)
    ]
    for worker in workers:
        worker.start()
    log.info("started %d worker ranks for a %d-rank peer on %s", nproc - 1, nproc, device)
    return PeerRanks(join_ranks(rank=0, world_size=nproc, device=device, store_path=store_path), workers, store_dir)


def worker_main(
    rank: int,
    world_size: int,
    device: str,
    store_path: Optional[str],
    threads: Optional[int],
    parent_pid: Optional[int],
) -> None:
    """A worker rank's process: join the group, build the trainer rank 0 describes, follow its orders."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group; rank 0 decides
    if parent_pid is not None:
        threading.Thread(target=_exit_without_parent, args=(parent_pid,), daemon=True).start()
    if threads:
        import torch

        torch.set_num_threads(threads)
    follow(join_ranks(rank=rank, world_size=world_size, device=device, store_path=store_path))


def follow(ranks: Ranks) -> None:
    """Train in lockstep with rank 0 until it says stop (None)."""
    setup = ranks.send(None)
    if setup is None:
        ranks.close()
        return
    run_json, peer_index = setup
    trainer = LocalTrainer(RunConfig.from_json(run_json), peer_index=peer_index, ranks=ranks)
    while (order := ranks.send(None)) is not None:
        trainer.follow(order)
    ranks.close()


def _exit_without_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)  # rank 0 is gone: nobody will send another order
