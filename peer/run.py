"""``swarm peer``'s entry point: a peer daemon with signal handling."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Optional

from peer.daemon import PeerDaemon
from peer.options import PeerOptions

logger = logging.getLogger("peer.daemon")


def run_peer(options: PeerOptions, *, metrics_port: Optional[int] = None) -> int:
    """Run a peer until the run finishes; SIGINT/SIGTERM leave the run cleanly and exit 0. With ``metrics_port``
    (0: any free port) it serves its metrics there for Prometheus, on the loopback address."""
    daemon = PeerDaemon(options)
    if metrics_port is not None:
        from peer.metrics_http import start_metrics_server

        url, _stop = start_metrics_server(daemon.stats.metrics, lambda: daemon.peer_id, port=metrics_port)
        logger.info("metrics at %s", url)  # a daemon thread: it ends with the process
    if threading.current_thread() is threading.main_thread():
        def leave_on_signal(signum, frame):
            logger.info("%s signal %d: leaving the run after the current step", daemon.tag(), signum)
            daemon.stop.set()

        signal.signal(signal.SIGTERM, leave_on_signal)
        signal.signal(signal.SIGINT, leave_on_signal)
    return daemon.run()
