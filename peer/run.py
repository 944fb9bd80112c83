"""``swarm peer``'s entry point: a peer daemon with signal handling, as one process or as rank 0 of a
multi-GPU peer (``--nproc``, or torchrun's environment) whose other ranks only train."""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import threading
from typing import Optional

from peer.daemon import PeerDaemon
from peer.options import PeerOptions
from peer.ranks import PeerRanks, follow, start_ranks, torchrun_rank
from swarm.train.ranks import join_ranks

logger = logging.getLogger("peer.daemon")


EXIT_WATCHDOG_S = 30.0  # once the peer is done, the longest its process may take to exit


def run_peer(options: PeerOptions, *, metrics_port: Optional[int] = None) -> int:
    """Run a peer until the run finishes; SIGINT/SIGTERM leave the run cleanly and exit 0. With ``metrics_port``
    (0: any free port) it serves its metrics there for Prometheus, on the loopback address."""
    code = _run_peer(options, metrics_port=metrics_port)
    exit_within(EXIT_WATCHDOG_S, code)
    return code


def exit_within(seconds: float, code: int) -> None:
    """The peer has left and written what it had to (checkpoint, final model); what remains is the interpreter's
    exit (joining threads, atexit handlers). Should that hang — a finished peer of the suite's crash test once
    did not exit in 180 s, cause not found — log every thread's stack, so the next one shows where, and exit
    with ``code`` anyway instead of holding the machine."""
    def fire() -> None:
        logger.warning("the peer is done but its process has not exited %.0fs later; its threads:", seconds)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True  # it never delays an exit that happens
    timer.start()


def _run_peer(options: PeerOptions, *, metrics_port: Optional[int]) -> int:
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
        daemon = PeerDaemon(options, ranks=peer_ranks.ranks if peer_ranks else None)
        if metrics_port is not None:
            from peer.metrics_http import start_metrics_server

            url, _stop = start_metrics_server(daemon.stats.metrics, lambda: daemon.peer_id, port=metrics_port)
            logger.info("metrics at %s", url)  # a daemon thread: it ends with the process
        return _run_daemon(daemon)
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
