"""``swarm peer``'s entry point: a peer daemon with signal handling, as one process or as rank 0 of a
multi-GPU peer (``--nproc``, or torchrun's environment) whose other ranks only train."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Optional

from peer.daemon import PeerDaemon
from peer.options import PeerOptions
from peer.ranks import PeerRanks, follow, start_ranks, torchrun_rank
from swarm.train.ranks import join_ranks

logger = logging.getLogger("peer.daemon")


def run_peer(options: PeerOptions) -> int:
    """Run a peer until the run finishes; SIGINT/SIGTERM leave the run cleanly and exit 0."""
    peer_ranks: Optional[PeerRanks] = None
    launched = torchrun_rank()
    if launched is not None:
        rank, world_size = launched
        ranks = join_ranks(rank=rank, world_size=world_size, device=options.device)
        if rank != 0:
            follow(ranks)
            return 0
        peer_ranks = PeerRanks(ranks)
    elif options.nproc > 1:
        peer_ranks = start_ranks(options.nproc, device=options.device, threads=options.threads)
    if peer_ranks is not None:
        options = dataclasses.replace(options, device=str(peer_ranks.ranks.device))
    try:
        return _run_daemon(PeerDaemon(options, ranks=peer_ranks.ranks if peer_ranks else None))
    finally:
        if peer_ranks is not None:
            peer_ranks.close()


def _run_daemon(daemon: PeerDaemon) -> int:
    if threading.current_thread() is threading.main_thread():
        def leave_on_signal(signum, frame):
            logger.info("%s signal %d: leaving the run after the current step", daemon.tag(), signum)
            daemon.stop.set()

        signal.signal(signal.SIGTERM, leave_on_signal)
        signal.signal(signal.SIGINT, leave_on_signal)
    return daemon.run()
