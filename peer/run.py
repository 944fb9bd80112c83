"""``swarm peer``'s entry point: a peer daemon with signal handling."""

from __future__ import annotations

import logging
import signal
import threading

from peer.daemon import PeerDaemon
from peer.options import PeerOptions

logger = logging.getLogger("peer.daemon")


def run_peer(options: PeerOptions) -> int:
    """Run a peer until the run finishes; SIGINT/SIGTERM leave the run cleanly and exit 0."""
    daemon = PeerDaemon(options)
    if threading.current_thread() is threading.main_thread():
        def leave_on_signal(signum, frame):
            logger.info("%s signal %d: leaving the run after the current step", daemon.tag(), signum)
            daemon.stop.set()

        signal.signal(signal.SIGTERM, leave_on_signal)
        signal.signal(signal.SIGINT, leave_on_signal)
    return daemon.run()
