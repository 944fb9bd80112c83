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
from swarm.train.multi_gpu.ranks import join_ranks

logger = logging.getLogger("peer.daemon")


EXIT_WATCHDOG_S = 30.0  # once the peer is done, the longest its process may take to exit
STOP_DEADLINE_S = 6.0  # after SIGTERM/SIGINT, the longest the peer takes to leave and exit, whatever it was doing
LEFT_EXIT_S = 2.0  # after a signal, once the peer has left, the longest the interpreter's exit may take


def run_peer(options: PeerOptions, *, metrics_port: Optional[int] = None) -> int:
    """Run a peer until the run finishes; SIGINT/SIGTERM leave the run and exit 0 within ``STOP_DEADLINE_S``
    (a second signal: at once). With ``metrics_port`` (0: any free port) it serves its metrics there for
    Prometheus, on the loopback address."""
    code = _run_peer(options, metrics_port=metrics_port)
    if _signalled.is_set():  # it left as asked: a thread still in an exchange or a download does not hold it
        timer = threading.Timer(LEFT_EXIT_S, _exit_now, args=(code,))
        timer.daemon = True
        timer.start()
    else:
        exit_within(EXIT_WATCHDOG_S, code)
    return code


_signalled = threading.Event()  # SIGTERM/SIGINT arrived: the peer is leaving


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
            from peer.report.metrics_http import start_metrics_server

            url, _stop = start_metrics_server(daemon.stats.metrics, lambda: daemon.peer_id, port=metrics_port)
            logger.info("metrics at %s", url)  # a daemon thread: it ends with the process
        return _run_daemon(daemon)
    finally:
        if peer_ranks is not None:
            peer_ranks.close()


def _run_daemon(daemon: PeerDaemon) -> int:
    if threading.current_thread() is threading.main_thread():

        def leave_on_signal(signum, frame):
            name = signal.Signals(signum).name
            if _signalled.is_set():
                logger.warning("%s %s again: exiting now (%s)", daemon.tag(), name, daemon.state.value)
                _exit_now(0)
            _signalled.set()
            logger.info(
                "%s %s while %s: leaving the run (at most %.0fs)",
                daemon.tag(),
                name,
                daemon.state.value,
                STOP_DEADLINE_S,
            )
            daemon.stop.set()
            _deadline(STOP_DEADLINE_S, daemon)

        signal.signal(signal.SIGTERM, leave_on_signal)
        signal.signal(signal.SIGINT, leave_on_signal)
    code = daemon.run()
    rejection = daemon.heartbeat.rejection if daemon.heartbeat is not None else None
    if code == 0 and rejection and not _signalled.is_set():
        # the heartbeat's refusal (another model or θ0, a revoked token) stopped the peer while it waited or trained:
        # the daemon ended as if stopped, but the peer was refused
        logger.error("%s the coordinator rejected this peer: %s", daemon.tag(), rejection)
        return 2
    return code


def _deadline(seconds: float, daemon: PeerDaemon) -> None:
    """Whatever the peer was doing when the signal came (an exchange that only its timeout ends, a coordinator that
    does not answer its last calls), the process ends ``seconds`` later: a vote and a checkpoint are written
    atomically, so what is on disk stays whole; the coordinator's lease for this peer ends it there."""

    def fire() -> None:
        logger.warning(
            "%s still %s %.0fs after the signal; exiting without the rest of its leave",
            daemon.tag(),
            daemon.state.value,
            seconds,
        )
        _exit_now(0)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def _exit_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
