"""What a joined peer builds to run its rounds with, and takes down as it leaves: its trainer (resumed from its own
disk, or θ0) with the progress line and the step probe around it; the round runner with the group, the state
store, the round hooks and the one-thread executor the exchanges run on (``peer.daemon`` joins and runs the
lifecycle; this module only assembles the parts and ends the executor)."""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from peer.link.coordinator_link import CoordinatorLink
from peer.link.heartbeat import HeartbeatThread
from peer.options import PeerOptions
from peer.parts import PeerParts
from peer.report.progress import RoundProgress
from peer.report.round_log import RoundLog
from peer.report.stats import PeerStats
from peer.round_hooks import PeerHooks
from peer.startup import StartupClock
from peer.state.resume import start_trainer
from peer.state.state_store import PeerStateStore
from swarm.config import RunConfig
from swarm.train.multi_gpu.ranks import Ranks
from swarm.train.round import RoundResult, RoundRunner
from swarm.train.step_probe import StepProbe
from swarm.train.trainer import LocalTrainer
from swarm.v1 import coordinator_pb2 as pb

LEAVE_ROUND_WAIT_S = 3.0  # a leaving peer waits this long at most for a round still in flight on the executor

Tag = Callable[[Optional[int]], str]


@dataclass
class PeerTrainer:
    trainer: LocalTrainer
    resumed: bool  # it holds the committed state from this peer's own disk (else θ0, installed at the start)
    progress: RoundProgress
    probe: StepProbe


def build_trainer(
    run: RunConfig,
    options: PeerOptions,
    joined: pb.JoinResponse,
    *,
    ranks: Optional[Ranks],
    stats: PeerStats,
    clock: StartupClock,
    tag: Tag,
) -> PeerTrainer:
    """The trainer of this start: a restarted peer whose own checkpoint or vote is the committed state starts from it
    (no θ0 drawn). Its step time is probed (or, restarted, the one it measured before is reused)."""
    started = start_trainer(
        run,
        options.state_dir,
        run_id=joined.run_id,
        peer_index=joined.peer_index,
        round_no=joined.round.last_committed_round,
        state_hash=joined.round.last_committed_hash,
        device=options.device,
        ranks=ranks,
        build=LocalTrainer,
    )
    trainer = started.trainer
    trainer.throttle = options.faults.throttle(lambda: max(1, stats.metrics().round))  # slow@R (and its probe)
    # utilization to a step, not a round; and a progress line every 30 s in a round that trains for longer
    progress = RoundProgress(trainer, tag=tag, inner=lambda seconds: stats.add(inner_time_s=seconds))
    progress.watch(trainer)
    clock.mark("trainer")
    # a far slower device: a smaller round 1 budget; a peer that trains from θ0 keeps the passes for its first step
    probe = StepProbe(trainer, report=stats.probed, keep=joined.round.last_committed_round == 0)
    probe.reuse(started.known_step_time())  # a restart reuses the step time it measured before
    clock.mark("probe")
    clock.first_passes = trainer.holds_first_passes
    return PeerTrainer(trainer, started.resumed is not None, progress, probe)


class InitialEvaluation:
    """θ0's evaluation, once: at once for a small model (a step probed under ``SLOW_PASS_S``), else while the first
    round's exchange runs (the main thread only waits for it then) rather than before the first step: at a real
    model size it takes seconds, and a peer evaluating when its first round opens starts it late."""

    def __init__(self, trainer: LocalTrainer, hooks: PeerHooks, *, due: bool, beat_now: Callable[[], None]) -> None:
        self.trainer, self.hooks, self.due, self.beat_now = trainer, hooks, due, beat_now

    def __call__(self) -> None:
        if not self.due:
            return
        self.due = False
        if self.trainer.round_no == 0:
            self.hooks.evaluated(0, self.trainer.eval_loss())
            self.beat_now()  # the coordinator records it before the first round's own evaluation


@dataclass
class RoundParts:
    group: Any  # parts.group's: the DHT group (swarm.net.exchange.group.DhtGroup), or a test's fake
    store: PeerStateStore
    hooks: PeerHooks
    executor: concurrent.futures.ThreadPoolExecutor
    runner: RoundRunner
    evaluate_initial: InitialEvaluation  # due unless the peer joined a run under way (it syncs first)


def build_round(
    parts: PeerParts,
    transport: Any,
    built: PeerTrainer,
    *,
    run: RunConfig,
    joined: pb.JoinResponse,
    options: PeerOptions,
    link: CoordinatorLink,
    stats: PeerStats,
    heartbeat: HeartbeatThread,
    stop_requested: Callable[[], bool],
    on_state: Callable[[str], None],
    on_decided: Callable[[RoundResult], None],
    tag: Tag,
) -> RoundParts:
    """The round runner and what it runs rounds with, wired to the coordinator link: the link decides with the
    group's votes, and plans each round's budget and who is left out or passed over."""
    o, trainer, run_id = options, built.trainer, joined.run_id
    group = _linked_group(parts, transport, run, joined=joined, options=o, link=link)
    link.param_count = trainer.param_count
    store = _state_store(
        parts, transport, trainer, run_id=run_id, options=o, link=link, stats=stats, heartbeat=heartbeat, tag=tag
    )
    hooks = PeerHooks(
        stats,
        o.faults,
        beat_now=heartbeat.beat_now,
        on_state=on_state,
        on_decided=on_decided,
        tag=tag,
        lr=lambda: trainer.optimizer.param_groups[0]["lr"],
        log=RoundLog.for_run(run, name=o.name or joined.peer_id, run_id=run_id, tag=tag),
    )
    executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="swarm-exchange")
    runner = RoundRunner(
        trainer,
        run,
        exchange=group,
        votes=group,
        decider=link,
        store=store,
        executor=executor,
        hooks=hooks,
        stopping=stop_requested,
        left_out=lambda r: link.left_out(r, stats.metrics().step_time_s),
        passed_over=lambda r: link.passed_over(r, heartbeat.heard, trainer.local_step_time_s or float("nan")),
        merge_when_ready=run.rounds.controller == "auto",
        budget=lambda r: built.progress.planned(r, link.budget(r, runner.full_speed(r))),
    )
    stats.update(
        model_fingerprint=trainer.fingerprint,
        param_count=trainer.param_count,
        dht_peer_id=transport.peer_id,
        dht_maddrs=tuple(transport.visible_maddrs),
    )
    evaluate_initial = InitialEvaluation(
        trainer, hooks, due=joined.round.last_committed_round == 0, beat_now=heartbeat.beat_now
    )
    return RoundParts(group, store, hooks, executor, runner, evaluate_initial)


def _state_store(
    parts: PeerParts,
    transport: Any,
    trainer: LocalTrainer,
    *,
    run_id: str,
    options: PeerOptions,
    link: CoordinatorLink,
    stats: PeerStats,
    heartbeat: HeartbeatThread,
    tag: Tag,
) -> PeerStateStore:
    """Where the peer's global states go (``peer.state.state_store``): its votes and checkpoints on disk, and the
    state transfer over ``transport`` that joiners download from."""
    transfer = parts.state_transfer(transport, run_id=run_id, timeout_s=options.state_timeout_s, member=link.member)
    return PeerStateStore(
        trainer,
        transfer,
        run_id=run_id,
        state_dir=options.state_dir,
        checkpoint_every_rounds=options.checkpoint_every_rounds,
        stats=stats,
        faults=options.faults,
        announce=heartbeat.beat_now,
        tag=tag,
    )


def _linked_group(
    parts: PeerParts,
    transport: Any,
    run: RunConfig,
    *,
    joined: pb.JoinResponse,
    options: PeerOptions,
    link: CoordinatorLink,
):
    """The peer's exchange group, deciding with the coordinator link and paced under ``--uplink-mbit``."""
    group = parts.group(
        transport,
        run,
        run_id=joined.run_id,
        peer_id=joined.peer_id,
        peer_index=joined.peer_index,
        planned=link.planned,
        faults=options.faults,
        member=link.member,
        processes=link.current_processes,
    )
    link.group_decision, group.plan_holds = group.group_decision, lambda: link.plan_open
    if options.uplink_mbit > 0:
        group.exchange.uplink_mbit_s = options.uplink_mbit  # --uplink-mbit: the bulk sends are paced under it
    return group


def drain(executor: Optional[concurrent.futures.ThreadPoolExecutor], wait_s: float = LEAVE_ROUND_WAIT_S) -> bool:
    """End the round executor as the peer leaves: a round still exchanging or awaiting its decision gets ``wait_s``
    to end (its vote is on disk either way). True when one is still running after that: the peer leaves without it
    and writes no checkpoint (the round may be changing the trainer)."""
    if executor is None:
        return False
    executor.shutdown(wait=False, cancel_futures=True)
    until = time.monotonic() + wait_s
    in_flight = False
    for thread in list(getattr(executor, "_threads", ())):
        thread.join(timeout=max(0.0, until - time.monotonic()))
        in_flight = in_flight or thread.is_alive()
    return in_flight
