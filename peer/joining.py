"""JOINING, a peer's start: join the run, start its heartbeats, build the trainer while the DHT starts, then the
round runner and the parts around it (``peer.round_parts``). The first transition of ``peer.daemon.PeerDaemon``,
whose main thread owns every field set here."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, Optional

import torch

from peer import identity
from peer.link.coordinator_link import CoordinatorLink
from peer.link.heartbeat import HeartbeatThread
from peer.options import PeerOptions
from peer.parts import PeerParts
from peer.report.stats import PeerStats
from peer.round_parts import PeerTrainer, RoundParts, build_round, build_trainer
from peer.startup import StartupClock
from peer.state.final_file import warn_if_other_run
from peer.state.state_store import PeerStateStore
from swarm.config import RunConfig
from swarm.control.client import CoordinatorClient
from swarm.train.multi_gpu.ranks import Ranks
from swarm.train.round import RoundRunner
from swarm.train.step_probe import SLOW_PASS_S
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger("peer.daemon")  # the peer's lifecycle lines, where operators already look for them


class PeerJoin:
    """``join`` for the daemon, which gives it the fields below the first group and ``tag``, ``round_state`` and
    ``on_decided``; ``join`` sets the rest."""

    options: PeerOptions
    parts: PeerParts
    ranks: Optional[Ranks]
    client: CoordinatorClient
    link: CoordinatorLink
    stats: PeerStats
    stop: threading.Event
    clock: StartupClock

    peer_id: str
    run_id: str
    run_config: RunConfig
    heartbeat: Optional[HeartbeatThread]
    _network: Optional[concurrent.futures.Future]  # the DHT start, overlapping the trainer build
    store: Optional[PeerStateStore]
    runner: Optional[RoundRunner]
    evaluate_initial: Callable[[], None]

    def join(self) -> None:
        """JOINING: join the run, start heartbeats, build the trainer and the network parts."""
        o = self.options
        if o.threads:
            torch.set_num_threads(o.threads)
        libp2p = self.parts.libp2p_identity(o.state_dir)  # fresh each start; the DHT starts with it
        # the next start's identity and the trainer build's slow imports, while the join waits on the network
        self.clock.warm(lambda: self.parts.spare_libp2p_identity(o.state_dir))
        joined = self.link.join(o, key=identity.peer_key(o.state_dir), libp2p=libp2p)
        self.peer_id = joined.peer_id
        self.run_id, self.run_config = joined.run_id, RunConfig.from_json(joined.run_spec_json)
        logger.info(
            "%s joined run %s as peer index %d%s",
            self.tag(),
            joined.run_id,
            joined.peer_index,
            f" (restarted: session {joined.session})" if joined.session > 1 else "",
        )
        warn_if_other_run(o.state_dir, self.run_id, self.run_config, self.tag())  # its final model is replaced
        # heartbeats start now: building the model and the transport takes longer than a short lease
        self._start_heartbeat(joined)
        self.clock.mark("join")
        # the DHT starts (hivemind's import, its process, p2pd) as the trainer builds: no gRPC call here meanwhile
        peers = list(joined.dht_initial_peers)
        self._network = self.clock.overlap(
            lambda: self.parts.transport(
                o, peers, stop=self.stop, tag=self.tag(), identity=libp2p, member=self.link.member
            )
        )
        built = build_trainer(
            self.run_config, o, joined, ranks=self.ranks, stats=self.stats, clock=self.clock, tag=self.tag
        )
        self.progress, self.probe = built.progress, built.probe
        self.transport = self._network.result()  # PeerExit when it could not start
        r = self._build_round(built, joined)
        self.group, self.store, self.hooks, self._executor, self.runner = (
            r.group,
            r.store,
            r.hooks,
            r.executor,
            r.runner,
        )
        self.evaluate_initial = r.evaluate_initial  # due unless a joiner of a run under way: it syncs first
        self.clock.overlap(lambda: self.stats.update(rtt_ms=r.group.probe_rtt_ms()), name="swarm-rtt-probe")
        self.clock.mark("DHT")
        self.store.start(resumed=built.resumed)
        if self.probe.best is not None and self.probe.best < SLOW_PASS_S:
            self.evaluate_initial()  # a small model's takes a moment: at once, before its first round
        self.heartbeat.beat_now()

    def _start_heartbeat(self, joined: pb.JoinResponse) -> None:
        """This peer's heartbeats to the coordinator, at the interval the join gave."""
        self.heartbeat = HeartbeatThread(
            self.client,
            self.peer_id,
            self.stats,
            self.stop,
            interval_s=joined.heartbeat_interval_s,
            faults=self.options.faults,
            renewed=self.link.renew,
        )
        self.heartbeat.start()

    def _build_round(self, built: PeerTrainer, joined: pb.JoinResponse) -> RoundParts:
        """The round runner and the parts around it (``peer.round_parts.build_round``), on the started transport."""
        return build_round(
            self.parts,
            self.transport,
            built,
            run=self.run_config,
            joined=joined,
            options=self.options,
            link=self.link,
            stats=self.stats,
            heartbeat=self.heartbeat,
            stop_requested=self.stop.is_set,
            on_state=self.round_state,
            on_decided=self.on_decided,
            tag=self.tag,
        )
