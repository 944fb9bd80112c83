"""The peer daemon: join a run, train, average pseudo-gradients, commit only what all agree on.

Run it with ``swarm peer --join 'swarm://...'``. The rounds themselves run in ``swarm.train.round``
(the same runner the simulator uses); this module is the peer's lifecycle around them: each pass of its loop
runs the one event ``peer.lifecycle.next_event`` picks, and every state change is a row of
``peer.lifecycle.TRANSITIONS``. Its first transition, the start, is ``peer.joining``.

Threads: the main thread runs the lifecycle and owns every field here and the trainer; the heartbeat
thread reads ``stats``; the round runner's executor runs one exchange and decision at a time.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, Optional

from peer.joining import PeerJoin
from peer.lifecycle import WIRE_STATES, Event, PeerState, View, after, next_event
from peer.link.backlog import report_backlog
from peer.link.coordinator_link import CoordinatorLink, Departed, PeerExit
from peer.link.heartbeat import HeartbeatThread
from peer.link.offline_decider import next_offline_round
from peer.options import PeerOptions
from peer.parts import PeerParts
from peer.report.stats import PeerStats
from peer.round_parts import drain
from peer.startup import StartupClock, result_or_none
from peer.state.run_end import holds_final, stranded, write_final
from peer.state.state_store import PeerStateStore
from peer.stoppable import unless_stopped
from swarm.control.client import CoordinatorRejected, CoordinatorUnreachable
from swarm.train.multi_gpu.ranks import Ranks
from swarm.train.round import Outcome, Pending, RoundResult, RoundRunner
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

STOP_CHECK_S = 0.1  # how often the main thread, waiting on a download, looks at the stop event


class PeerDaemon(PeerJoin):
    def __init__(self, options: PeerOptions, parts: Optional[PeerParts] = None, ranks: Optional[Ranks] = None):
        self.options = options
        self.ranks = ranks  # rank 0 of a multi-GPU peer: the trainer leads the other ranks
        self.parts = parts or PeerParts()
        self.stop = threading.Event()
        self.stats = PeerStats()
        self.state = PeerState.JOINING
        self.client = self.parts.client(options.join)
        # unreachable for --join-timeout-s while it has nothing to do without the coordinator, the peer exits
        self.link = CoordinatorLink(
            self.client,
            stop=self.stop,
            faults=options.faults,
            poll_s=options.poll_s,
            leave_grace_s=options.leave_grace_s,
            tag=self.tag,
            give_up_after_s=options.join_timeout_s,
        )
        self.peer_id, self.transport = "", None
        self.heartbeat: Optional[HeartbeatThread] = None
        self.runner: Optional[RoundRunner] = None
        self.store: Optional[PeerStateStore] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.carry: Optional[Pending] = None  # a round whose exchange overlaps the next round's first steps
        self.offline_next: Optional[int] = None  # the round the group runs next should the coordinator be down
        self.behind = False  # the coordinator contradicted a group decision: resync before anything else
        self.offline = False  # the current round runs while the coordinator is unreachable
        self.evaluate_initial: Callable[[], None] = lambda: None  # θ0's, once (``peer.round_parts.InitialEvaluation``)
        self.clock = StartupClock()  # where a (re)start's seconds go, logged at its first round
        self._network: Optional[concurrent.futures.Future] = None  # the DHT start, overlapping the trainer build
        self._busy_thread = False  # a download left running on its thread when the peer stopped: no checkpoint
        self._checkpointed = False  # the stranded path wrote its checkpoint already

    # ---- lifecycle -----------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.join()
            return self.loop()
        except Departed:
            return self.departed()
        except (PeerExit, CoordinatorRejected) as e:
            rejection = e if isinstance(e, CoordinatorRejected) else (self.heartbeat and self.heartbeat.rejection)
            if rejection:
                logger.error("%s the coordinator rejected this peer: %s", self.tag(), rejection)
                return 2
            return e.code
        finally:
            self.leave()

    def loop(self) -> int:
        """Each pass runs the one event ``next_event`` picks from what the peer knows (``peer.lifecycle``)."""
        waited: Optional[pb.RoundInfo] = None  # the answer a wait for the coordinator ended with
        while not self.stop.is_set():
            info: Optional[pb.RoundInfo] = None
            if not self.heartbeat.rejection and self.carry is None:
                info, waited = waited or self.ask(), None
            event = next_event(
                View(
                    rejected=bool(self.heartbeat.rejection),
                    carrying=self.carry is not None,
                    info=info,
                    final_known=self.link.final is not None,
                    offline_next=self.offline_next,
                    backlog=bool(self.link.backlog),
                    behind=self.behind,
                    held_round=self.runner.trainer.round_no,
                    peer_id=self.peer_id,
                )
            )
            if event is Event.COORDINATOR_DOWN:
                # nothing to do without it: wait (with backoff, logged; Departed when the run is over, PeerExit(1)
                # after --join-timeout-s)
                waited = self.link.round_info(0)
                continue
            code = self.handle(event, info)
            if code is not None:
                return code
        return 0

    def ask(self) -> Optional[pb.RoundInfo]:
        """The current round as the coordinator says it, or None while it is unreachable (what the heartbeat last
        heard counts then: a peer busy downloading learns that the run finished there)."""
        try:
            return self.link.get_round(0)
        except CoordinatorUnreachable:
            if self.heartbeat is not None and self.heartbeat.heard is not None:
                self.link.heard(self.heartbeat.heard)
            return None

    def handle(self, event: Event, info: Optional[pb.RoundInfo]) -> Optional[int]:
        """Run ``event``'s transition; an exit code ends the loop."""
        if event is Event.REJECTED:
            self.move(event)
            logger.error("%s %s", self.tag(), self.heartbeat.rejection)
            return 2
        if event is Event.CARRIED:
            self.train_round(self.carry.round_no + 1, event, offline=self.offline)
        elif event is Event.GROUP_GOES_ON:
            self.train_round(self.offline_next, event, offline=True)
        elif event is Event.BACKLOG:
            self.move(event)
            self.report_backlog()
        elif event is Event.BEHIND:
            if not self.sync(info) and info.finished and not info.holders and not self.stop.is_set():
                self.move(Event.SYNC_FAILED_AT_END)
                return self.stranded(info.last_committed_round)  # the holders serve a while (--final-serve-s)
        elif event is Event.FINISHED:
            return self.finish()
        elif event is Event.PLANNED:
            self.train_round(info.open_round, event)
        else:
            self.move(Event.UNPLANNED)
            self.probe.again()  # before its first round: a better estimate meanwhile
            self.stop.wait(self.link.poll_s)  # waiting to be planned into a round (at the coordinator's pace)
        return None

    def move(self, event: Event) -> None:
        """The state ``event`` leads to from this one (``peer.lifecycle.TRANSITIONS``), shown to the coordinator."""
        self.enter(after(self.state, event, offline=self.offline, strict=False))

    def enter(self, state: PeerState) -> None:
        self.state = state
        if state in WIRE_STATES:
            self.stats.update(state=WIRE_STATES[state])

    # ---- transitions ---------------------------------------------------------------------------------
    def train_round(self, round_no: int, event: Event, *, offline: bool = False) -> None:
        """TRAINING → EXCHANGING → DECIDING (OFFLINE_DECIDING while the coordinator is unreachable): one
        round through the runner, which first finishes the carried one."""
        self.offline = offline
        self.clock.first_round(self.tag(round_no))
        self.move(event)
        self.stats.update(round=round_no)
        self.group.live_peers = self.link.live_peers
        carry, self.carry = self.carry, None
        result = self.runner.run_round(round_no, carry)
        if result.outcome is Outcome.IN_FLIGHT:
            self.carry = result.pending
        elif result.outcome is not Outcome.STOPPED:
            self.move(Event.ROUND_ENDED)

    def round_state(self, name: str) -> None:
        """The round hooks' 'exchanging' and 'deciding' points (on the main thread)."""
        self.move(Event.EXCHANGE if name == "exchanging" else Event.DECIDE)
        if name == "deciding":
            self.evaluate_initial()  # the main thread only waits for the exchange here; θg is θ0 until it commits

    def on_decided(self, result: RoundResult) -> None:
        """A round was decided: the round the group goes on with should the coordinator be unreachable for it."""
        self.offline_next = next_offline_round(result, self.run_config.rounds.max_rounds)
        if result.group:
            self.link.last_group = set(result.group)

    def report_backlog(self) -> None:
        """The coordinator is back: report the rounds the group decided without it (``peer.link.backlog``)."""
        self.offline_next = None
        if not report_backlog(self.link, self.client, self.store, self.runner.trainer, tag=self.tag):
            self.behind = True  # resync from the committed state

    def sync(self, info: pb.RoundInfo) -> bool:
        """SYNCING: get the committed state (own disk first, else a holder). The download runs on a thread of its
        own, so that a stopped peer leaves at once instead of after it (``state_timeout_s`` at most)."""
        self.move(Event.BEHIND)
        if info.last_committed_round < 0:
            return False
        done, synced = unless_stopped(
            lambda: self.store.sync(info, holders=self.link.holders), self.stop, name="swarm-sync", check_s=STOP_CHECK_S
        )
        if not done:
            self._busy_thread = True  # it may yet install a state: leave writes no checkpoint meanwhile
            return False
        if synced:
            self.behind, self.offline_next = False, None  # the group this peer was in moved on without it
        else:
            self.stop.wait(1.0)  # back off before asking the coordinator for holders again
        return synced

    def finish(self) -> int:
        """FINISHING: write the final model, then stay a holder while live peers still download it."""
        self.move(Event.FINISHED)
        write_final(self.options.state_dir, self.runner.trainer, run_id=self.run_id, tag=self.tag)
        self.link.serve_final_state(
            self.options.final_serve_s, ready=lambda: self.stats.update(state=pb.PEER_STATE_READY)
        )
        return 0

    def departed(self) -> int:
        """The coordinator said the run finished and is gone since: a peer holding the final state writes the final
        model (there is nobody left to serve it to); one that does not cannot get it any more."""
        trainer = self.runner.trainer if self.runner is not None else None
        if self._busy_thread or self.behind or not holds_final(trainer, self.link.final):
            return self.stranded(self.link.final[0])
        self.move(Event.FINISHED)
        write_final(self.options.state_dir, trainer, run_id=self.run_id, tag=self.tag)
        return 0

    def stranded(self, final_round: int) -> int:
        """The run finished and no holder of its final state is left: say what this peer holds and where
        (``peer.state.run_end.stranded``), then exit 1."""
        self._checkpointed = stranded(
            final_round,
            self.runner.trainer if self.runner is not None else None,
            self.store,
            self.options.state_dir,
            download_running=self._busy_thread,
            checkpointed=self._checkpointed,
            tag=self.tag,
        )
        return 1

    def leave(self) -> None:
        """LEAVING: checkpoint a committed state, a last heartbeat with the final numbers, then leave."""
        self.state = after(self.state, Event.STOP)  # not shown: the last heartbeat says it leaves
        self.stop.set()
        in_flight = drain(self._executor)  # a round still in flight gets a moment to end; after that, no checkpoint
        trainer = self.runner.trainer if self.runner is not None else None
        if (
            trainer is not None
            and trainer.round_no > 0
            and not self.store.provisional
            and not self.behind
            and not (in_flight or self._busy_thread or self._checkpointed)
        ):
            self.store.checkpoint()  # a restarted peer resumes here if the run has not moved on
        if self.store is not None:
            self.store.finisher.wait()  # a round's checkpoint still being finished is in place before the exit
        if self.runner is not None:
            self.hooks.close()  # the training logs' last round
        if self.heartbeat is not None:
            self.heartbeat.beat_now()  # wakes it from its interval wait: it sees stop and ends
            self.heartbeat.join(timeout=5)
        if self.peer_id:
            self.link.leave(self.stats.heartbeat_request(self.peer_id))
        self.transport = self.transport or result_or_none(self._network, timeout_s=10)  # a failed start's DHT too
        if self.transport is not None:
            self.transport.shutdown()
        self.client.close()

    def tag(self, round_no: Optional[int] = None) -> str:
        return f"[{self.peer_id or 'peer'}{'' if round_no is None else f' r{round_no}'}]"
