"""A peer's handle on hivemind's DHT and libp2p transport, with an asyncio loop of its own.

The training loop is synchronous; the data plane (``swarm.net.exchange.allreduce``, ``swarm.net.bulk.state_transfer``) is
asyncio on hivemind's ``P2P``. This object owns the DHT, a replica of its P2P daemon client, and one
event-loop thread, and runs coroutines there with a bound on every wait.

hivemind (``swarm.net.hivemind_api``) is imported when a Transport is made, not with this module: a peer signs
its join and builds its trainer before it needs the DHT, and ``FORK_LOCK`` (which its heartbeat thread holds)
must not cost a restart hivemind's import.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Optional, Sequence

from swarm.net.bulk.bulk_channel import BulkChannel
from swarm.net.bulk.bulk_sender import BulkSender
from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL
from swarm.net.link.p2p_address import free_port, maddr

if TYPE_CHECKING:
    from swarm.net.hivemind_api import DHT

logger = logging.getLogger(__name__)

# Bytes per message of a tensor transfer (all-reduce slices, state downloads): below hivemind's 2 MiB
# unary limit and small enough to interleave streams.
CHUNK_BYTES = 1 << 20


# hivemind's DHT runs in a forked child process. Forking while another thread is inside a gRPC call
# corrupts gRPC's state in the child (seen as "Other threads are currently calling into gRPC, skipping
# fork() handlers" and then an abseil mutex abort), and the peer hangs waiting for a DHT that never
# gets ready. Threads that call gRPC while a Transport may be starting hold this lock around each call.
FORK_LOCK = threading.Lock()


PARENT_POLL_S = 1.0
REPLICATE_TIMEOUT_S = 15.0  # the started DHT process hands over its p2p daemon within this, or the start is retried


async def _exit_with_parent(parent_pid: int, _dht: Any, node: Any) -> None:
    """Runs inside the DHT process: once the process that started it is gone (a kill -9, an OOM kill),
    shut the node and its p2pd down and exit, instead of living on as an orphan that still answers in
    the overlay under the dead process's identity and holds its port."""
    try:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_POLL_S)
    except asyncio.CancelledError:  # a normal shutdown
        return
    try:
        await asyncio.wait_for(node.shutdown(), timeout=5)
    finally:
        os._exit(0)


def exit_with_parent(dht: DHT) -> Any:
    """Make a started DHT's process end when this process does; returns the watch's future."""
    return dht.run_coroutine(functools.partial(_exit_with_parent, os.getpid()), return_future=True)


class TransportStartFailed(RuntimeError):
    """The DHT process could not start, typically because no bootstrap peer answered."""


class Transport:
    def __init__(
        self,
        *,
        initial_peers: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: Optional[str] = None,  # what groupmates dial (``swarm.net.link.p2p_address``); None: host
        start_timeout_s: float = 60.0,
        identity_path: Optional[str] = None,
        record_validators: Sequence[Any] = (),
        tcp_congestion: str = CONGESTION_CONTROL,  # the bulk connections' (``swarm peer --tcp-congestion``)
    ):
        """``identity_path``: the libp2p key (``swarm.net.link.libp2p_identity``) to run with; made fresh by the
        peer at each start, so it is never taken by another node and the check for that is skipped.
        ``record_validators`` (hivemind ``RecordValidatorBase``s) guard the node from its first moment: one
        added after the start lets entries stored meanwhile stay (``swarm.net.dht_entries.EntryValidator``)."""
        from swarm.net.hivemind_api import DHT

        if announce_host and not port:
            port = free_port(host)  # hivemind refuses port 0 in announced addresses
        host_maddrs = [maddr(host, port)]
        announce = [maddr(announce_host, port)] if announce_host else None
        identity = {"identity_path": identity_path, "check_if_identity_free": False} if identity_path else {}
        self.dht = DHT(
            start=False,
            initial_peers=list(initial_peers),
            host_maddrs=host_maddrs,
            announce_maddrs=announce,
            startup_timeout=start_timeout_s,
            record_validators=list(record_validators),
            **identity,
        )
        self.validates_entries = bool(record_validators)
        with FORK_LOCK:  # the DHT runs in a forked process: no gRPC call may be in flight meanwhile
            self.dht.start()
        try:
            self.dht.wait_until_ready(start_timeout_s)
        except Exception as e:  # hivemind raises P2PDaemonError, TimeoutError, ...: all mean "not started"
            raise self._failed_start(initial_peers, e) from e
        self.listen_host, self.announce_host = host, announce_host
        self.bulk: Optional[BulkChannel] = None  # the loop's; opened by the first exchange (open_bulk)
        self.bulk_sender: Optional[BulkSender] = None
        self.tcp_congestion = tcp_congestion
        self._orphan_watch = exit_with_parent(self.dht)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm-p2p", daemon=True)
        self._thread.start()
        try:  # a local call to the DHT process, ready by now: when it does not answer, starting again is faster
            self.p2p = self.run(self.dht.replicate_p2p(), timeout_s=min(start_timeout_s, REPLICATE_TIMEOUT_S))
        except Exception as e:  # e.g. no answer from the DHT process on a loaded machine: a start to retry
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise self._failed_start(initial_peers, e) from e
        self.peer_id = str(self.p2p.peer_id)
        self.relay: Any = None  # swarm.net.link.relay.RelayClient once the peer installs it

    def _failed_start(self, initial_peers: Sequence[str], error: Exception) -> TransportStartFailed:
        """Stop the DHT process of a start that failed (left running, it would keep this process from exiting:
        the interpreter waits for it, and it waits for this process to end) and say why, as a start to retry."""
        self._stop_dht()
        return TransportStartFailed(
            f"the DHT did not start through {list(initial_peers) or 'no peers'}: "
            f"{str(error).strip() or type(error).__name__}"
        )

    def _stop_dht(self) -> None:
        """Shut the DHT process down; kill it if it is still there after hivemind's grace period and SIGTERM (a chaos
        soak saw one outlive both, and the interpreter's exit then waited for it forever)."""
        try:
            self.dht.shutdown()
        except Exception as e:  # the DHT process may already be gone
            logger.debug("DHT shutdown: %r", e)
        self.dht.join(timeout=2)  # hivemind's shutdown sends SIGTERM after its grace period without waiting
        if self.dht.is_alive():
            logger.warning("the DHT process (pid %s) did not end when asked; killing it", self.dht.pid)
            self.dht.kill()
            self.dht.join(timeout=5)

    @property
    def visible_maddrs(self) -> list[str]:
        return [str(m) for m in self.dht.get_visible_maddrs()]

    def run(self, coro: Awaitable[Any], *, timeout_s: float) -> Any:
        """Run a coroutine on the transport loop and wait for it at most timeout_s seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"transport operation did not finish within {timeout_s:.1f}s") from None

    async def open_bulk(self) -> BulkChannel:
        """This node's bulk channel (``swarm.net.bulk.bulk_channel``), listening beside its libp2p node; one per
        transport, shared by its exchanges, since a member's entry announces one bulk address."""
        if self.bulk is None:
            channel = BulkChannel()
            await channel.start(self.listen_host, self.announce_host)
            self.bulk, self.bulk_sender = channel, BulkSender(congestion=self.tcp_congestion)
        return self.bulk

    def shutdown(self) -> None:
        if self.bulk is not None:
            self._loop.call_soon_threadsafe(self.bulk.close)
            self.bulk_sender.close()
        try:
            self.run(self._cancel_tasks(), timeout_s=5)
        except Exception as e:  # shutting down; nothing left to protect
            logger.debug("transport tasks: %r", e)
        self._stop_dht()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _cancel_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
