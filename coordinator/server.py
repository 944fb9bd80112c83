"""The coordinator process: TLS gRPC server, DHT node, state in SQLite, and a tick for timeouts.

``serve()`` is what ``swarm coordinator`` runs: it prints the join string and blocks until the run
finishes or it is interrupted.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import grpc

from coordinator.api.limits import MAX_REQUEST_BYTES, tolerant
from coordinator.api.load import MAX_IN_FLIGHT, LoadMonitor
from coordinator.api.rate_limit import JoinLimits
from coordinator.api.servicer import CoordinatorServicer
from coordinator.api.serving import LoopServer
from coordinator.api.tokens import first_join_string_note
from coordinator.dht_node import DHTNode
from coordinator.engine import CoordinatorEngine
from coordinator.heap import HeapKeeper
from coordinator.http.server import DashboardServer, write_dashboard_url
from coordinator.http.snapshot import snapshot
from coordinator.store.database import STORE_FILE, Store
from coordinator.store.private_files import JOIN_STRING_FILE, private_dir, private_files, write_private
from swarm.config import RunConfig
from swarm.control import tls
from swarm.control.joinstring import JoinString
from swarm.core.trust.credential import PeerKey
from swarm.net.dht_entries import EntryValidator
from swarm.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

SIGNING_KEY_FILE = "coordinator-signing-key.pem"  # Ed25519: signs the members' credentials
# after the run finishes, how long at most to wait for the last peers to say goodbye: the final round's participants
# serve its state for up to 30 s (a peer's --final-serve-s) while peers behind download it, and those then leave
FINISH_LINGER_S = 60.0
_WILDCARDS = ("0.0.0.0", "::", "")
# gRPC's own bound on the calls in flight, behind coordinator.api.load's shares of MAX_IN_FLIGHT
MAX_CONCURRENT_RPCS = 2 * MAX_IN_FLIGHT
SERVICE = "swarm.v1.Coordinator"


class CoordinatorServer:
    def __init__(
        self,
        *,
        run: Optional[RunConfig],
        state_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        dht_port: int = 0,
        announce_host: Optional[str] = None,
        lease_s: float = 15.0,
        heartbeat_interval_s: float = 2.0,
        config_given: bool = True,
        tick_interval_s: float = 0.5,
        clock: Callable[[], float] = time.time,
        exit_grace_s: float = 2.0,
        join_limits: JoinLimits = JoinLimits(),
        http_port: Optional[int] = None,
        http_host: str = "127.0.0.1",
        max_rounds: Optional[int] = None,
    ) -> None:
        """Serve ``run``, or resume the run kept in ``state_dir`` (``max_rounds``, the command line's, sets its
        max_rounds even when ``config_given`` is False: a larger one extends it).

        A kept run with a different config is refused, unless ``config_given`` is False (``run`` is
        then only the default for a new run) or ``run`` is None.  Port 0 reuses the port of the
        previous start when it is free (so the join string stays valid), else lets the OS choose.
        ``join_limits`` are the per-address and per-token join rates; only a load test raises them.
        ``http_port`` (0: any free port; None: none) serves the dashboard and /metrics on ``http_host``.
        """
        self._run = run
        self._exit_grace_s = exit_grace_s  # after the run is done, keep serving status this long
        self._config_given = config_given
        self._max_rounds = max_rounds
        self._state_dir = Path(state_dir)
        self._host = host
        self._port = port
        self._dht_port = dht_port
        self._announce_host = announce_host
        self._lease_s = lease_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._tick_interval_s = tick_interval_s
        self._clock = clock
        self._join_limits = join_limits
        self._http = (http_host, http_port) if http_port is not None else None
        self.dashboard: Optional[DashboardServer] = None
        self._dashboard_store: Optional[Store] = None
        self._store: Optional[Store] = None
        self._dht: Optional[DHTNode] = None
        self._grpc: Optional[LoopServer] = None
        self._ticker: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._done = threading.Event()
        self.engine: Optional[CoordinatorEngine] = None
        self.load = LoadMonitor()  # how saturated the gRPC server is: the peers' pace and the eviction pause
        self.join_string: Optional[JoinString] = None

    def start(self) -> JoinString:
        private_dir(self._state_dir)
        try:
            private_files(self._state_dir)
            self._store = Store.in_dir(self._state_dir)
            signing_key = PeerKey.load_or_create(self._state_dir / SIGNING_KEY_FILE)
            self.engine = CoordinatorEngine(
                self._store,
                config=self._run,
                check_config=self._config_given,
                lease_s=self._lease_s,
                heartbeat_interval_s=self._heartbeat_interval_s,
                clock=self._clock,
                signing_key=signing_key,
                max_rounds=self._max_rounds,
                load=self.load,
            )
            cert_pem, key_pem = tls.ensure_certificate(self._state_dir)
            initial_peers = self._start_dht(signing_key)
            servicer = CoordinatorServicer(
                self.engine,
                dht_initial_peers=initial_peers,
                join_limits=self._join_limits,
            )
            self._grpc = LoopServer(
                self.load,
                options=[
                    ("grpc.so_reuseport", 0),  # a second coordinator on the same port must fail, not share
                    ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
                ],
                maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            )
            self._grpc.add_handlers(SERVICE, servicer_handlers(servicer))
            port = self._bind(self._grpc, tls.server_credentials(cert_pem, key_pem))
            self.engine.serving()  # the leases run from now: starting the DHT node took seconds
            self._grpc.start()
        except BaseException:
            self.stop()
            raise
        self.engine.remember_ports(grpc_port=port, dht_port=self._dht.port)
        self._ticker = threading.Thread(target=self._tick_loop, name="coordinator-tick", daemon=True)
        self._ticker.start()
        self.join_string = JoinString(
            host=self._public_host(), port=port, token=self.engine.run.token, fingerprint=tls.fingerprint(cert_pem)
        )
        write_private(self._state_dir / JOIN_STRING_FILE, f"{self.join_string}\n")  # it holds the token
        if self._http is not None:
            self._start_dashboard(*self._http)
        logger.info("run %s: coordinator listening on %s:%d", self.engine.run.run_id, self._host, port)
        return self.join_string

    def _start_dht(self, signing_key: PeerKey) -> list[str]:
        """Start the run's DHT node and its relay; returns the addresses peers bootstrap from."""
        # A restart keeps the DHT port (the peers' address for this node) and dials the peers it knew.
        self._dht = DHTNode(
            state_dir=self._state_dir,
            host=self._host,
            port=self._dht_port,
            announce_host=self._announce_host,
            previous_port=self.engine.run.dht_port,
            # the run's DHT holds members' signed entries only: a stranger cannot store through this node
            record_validators=[
                EntryValidator(coordinator_public_key=signing_key.public_key, run_id=self.engine.run.run_id)
            ],
        )
        initial_peers = self._dht.start(bootstrap=self.engine.peer_dht_addresses())
        self._dht.start_relay(self.engine.is_live_member)  # for members behind NAT on both ends
        return initial_peers

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the run finished and its last peers left (or lingered too long); False on timeout."""
        return self._done.wait(timeout)

    def _start_dashboard(self, host: str, port: int) -> None:
        # its own read-only connection: the page never waits for the engine's lock, nor the engine for it
        self._dashboard_store = Store(self._state_dir / STORE_FILE, read_only=True)
        store, engine, load = self._dashboard_store, self.engine, self.load
        self.dashboard = DashboardServer(
            lambda: dict(
                snapshot(store),
                load=dict(
                    load.snapshot(), eviction_pauses=engine.eviction_pauses, pace=dataclasses.asdict(engine.last_pace)
                ),
            ),
            host=host,
            port=port,
        )
        try:
            url = self.dashboard.start()
        except BaseException:
            self.stop()
            raise
        write_dashboard_url(self._state_dir, url)
        logger.info("dashboard at %s", url)

    def stop(self) -> None:
        self._stopping.set()
        if self.dashboard is not None:
            self.dashboard.stop()
            self.dashboard = None
        if self._dashboard_store is not None:
            self._dashboard_store.close()
            self._dashboard_store = None
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._grpc is not None:
            self._grpc.stop(grace_s=1.0)
            self._grpc = None
        if self._dht is not None:
            self._dht.stop()
            self._dht = None
        if self._store is not None:
            if self.engine is not None:
                self.engine.close()
            self._store.close()
            self._store = None

    def _bind(self, server: LoopServer, credentials: grpc.ServerCredentials) -> int:
        host = f"[{self._host}]" if ":" in self._host else self._host
        previous = self.engine.run.grpc_port if self.engine is not None else 0
        if self._port == 0 and previous:
            try:
                return server.add_secure_port(f"{host}:{previous}", credentials)
            except RuntimeError:
                logger.warning("port %d of the previous start is taken; the join string changes", previous)
        try:
            bound = server.add_secure_port(f"{host}:{self._port}", credentials)
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(
                f"cannot listen on {host}:{self._port} (in use or not a local address); choose another --port."
            )
        return bound

    def _public_host(self) -> str:
        if self._announce_host:
            return self._announce_host
        if self._host in _WILDCARDS:
            logger.warning(
                "listening on all interfaces but the join string names 127.0.0.1; "
                "give an announce host so peers on other machines can reach the coordinator"
            )
            return "127.0.0.1"
        return self._host

    def _tick_loop(self) -> None:
        assert self.engine is not None
        done_since: Optional[float] = None
        # its first tick leaves what was made while starting (torch, hivemind) out of the collector's full passes
        heap = HeapKeeper()
        while not self._stopping.wait(self._tick_interval_s):
            try:
                heap.tick()
                self.engine.tick()
                if done_since is None and self.engine.done(linger_s=FINISH_LINGER_S):
                    done_since = time.monotonic()
                # keep answering status for a moment, so a watcher sees the final numbers
                if done_since is not None and time.monotonic() - done_since >= self._exit_grace_s:
                    self._done.set()
            except Exception:
                logger.exception("coordinator tick failed")


def servicer_handlers(servicer: CoordinatorServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The servicer's handlers as the generated code registers them, but with deserializers that hand a request
    that is not valid protobuf to the servicer (which refuses it in one sentence) instead of failing it with
    INTERNAL and a traceback in the log, and GetRound answered from its encoding."""

    class _Capture:
        handlers: dict = {}

        def add_generic_rpc_handlers(self, _handlers) -> None:
            pass

        def add_registered_method_handlers(self, _service: str, handlers: dict) -> None:
            self.handlers = handlers

    capture = _Capture()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, capture)
    handlers = {
        name: handler._replace(request_deserializer=tolerant(handler.request_deserializer))
        for name, handler in capture.handlers.items()
    }
    # the most frequent answer, as large as the round: sent from its cached encoding, not copied and encoded again
    handlers["GetRound"] = handlers["GetRound"]._replace(
        unary_unary=servicer.GetRoundEncoded, response_serializer=bytes
    )
    return handlers


def serve(
    run: Optional[RunConfig],
    state_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    dht_port: int = 0,
    announce_host: Optional[str] = None,
    lease_s: float = 15.0,
    heartbeat_interval_s: float = 2.0,
    max_rounds: Optional[int] = None,
    config_given: bool = True,
    exit_grace_s: float = 2.0,
    http_port: Optional[int] = None,
    http_host: str = "127.0.0.1",
    linger_s: float = 0.0,
) -> int:
    """Run a coordinator until its run finishes or it is interrupted (Ctrl-C, SIGTERM); returns 0.

    Prints one line, ``join: swarm://...``, to stdout. Raises ConfigError (a different config for an existing state
    dir) or OSError (the port is taken) before printing it. ``max_rounds`` overrides the run's; ``config_given=False``
    says ``run`` is a default that a kept run overrides. With ``http_port`` it also prints ``dashboard: http://...``
    and, once the run finished, keeps serving for ``linger_s`` more seconds so the finished run's page can be seen."""
    if max_rounds is not None and run is not None:
        run = run.replace(rounds=dataclasses.replace(run.rounds, max_rounds=max_rounds))
    server = CoordinatorServer(
        run=run,
        state_dir=Path(state_dir),
        host=host,
        port=port,
        dht_port=dht_port,
        announce_host=announce_host,
        lease_s=lease_s,
        heartbeat_interval_s=heartbeat_interval_s,
        config_given=config_given,
        exit_grace_s=exit_grace_s,
        http_port=http_port,
        http_host=http_host,
        max_rounds=max_rounds,
    )
    join = server.start()
    terminated = threading.Event()
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: terminated.set())
    try:
        print(f"join: {join}", flush=True)
        if server.dashboard is not None:
            print(f"dashboard: {server.dashboard.url}", flush=True)
        logger.info(first_join_string_note(str(state_dir)))
        _until_finished(server, terminated, linger_s)
    except KeyboardInterrupt:
        logger.info("interrupted; shutting down")
    finally:
        server.stop()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        sys.stdout.flush()
    return 0


def _until_finished(server: CoordinatorServer, terminated: threading.Event, linger_s: float) -> None:
    """Wait until the run finished (then linger ``linger_s`` for the dashboard) or ``terminated`` is set."""
    while not terminated.is_set():
        if server.wait(timeout=0.5):
            if server.dashboard is not None and linger_s > 0:
                logger.info("run finished; the dashboard stays up for %.0fs", linger_s)
                terminated.wait(linger_s)
            logger.info("run finished; shutting down")
            return
