"""Where a peer's global states go: its votes and checkpoints on disk, the state server that joiners
download from, and the coordinator's view of which state it holds. The round runner's StateStore, and
the peer's sync (resume from its own disk, or download from a holder)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Optional

from peer.faults import FaultPlan
from peer.report.stats import PeerStats
from peer.state.checkpoint import CheckpointFinisher
from peer.state.resume import checkpoint_dir, checkpoint_spare, maybe_resume, stage_trainer, step_time_record
from peer.state.votes import prune_votes, save_vote
from swarm.core.state import GlobalState
from swarm.train.trainer import LocalTrainer
from swarm.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)


class PeerStateStore:
    """Owned by the main thread, except ``save_vote``, which the round runner's executor calls (it only
    writes a vote directory of its own round), and the checkpoint ``finisher``'s thread."""

    def __init__(
        self,
        trainer: LocalTrainer,
        transfer,
        *,
        run_id: str,
        state_dir: Path,
        checkpoint_every_rounds: int,
        stats: PeerStats,
        faults: FaultPlan,
        announce: Callable[[], None],
        tag: Callable[[Optional[int]], str],
    ) -> None:
        self.trainer, self.transfer, self.run_id = trainer, transfer, run_id  # transfer: parts.StateTransfer
        self.state_dir, self.every = state_dir, checkpoint_every_rounds
        self.stats, self.faults = stats, faults
        self.announce = announce  # tell the coordinator at once which state this peer holds
        self.tag = tag
        self.provisional = False  # the state is a round the group decided without the coordinator
        self.disk_tried: Optional[int] = None  # the committed round last looked for on this peer's disk
        self.finisher = CheckpointFinisher(self._not_written)  # a round's checkpoint: hashed, fsynced and renamed

    # ---- the round runner's StateStore ---------------------------------------------------------------
    def save_vote(self, state: GlobalState) -> None:
        """The tentative state, on disk before its hash is reported: should every peer whose vote counts
        die before hearing the decision, the committed round still survives on their disks. First the checkpoint
        being finished is in place: it writes θg and the outer state, which the round's commit changes."""
        self.finisher.wait()
        if self.every <= 0:
            return
        try:
            save_vote(self.state_dir, state, run_id=self.run_id, step_time=step_time_record(self.trainer))
        except OSError as e:  # the vote still counts; only this disk copy is missing
            logger.warning("%s could not write the vote to disk: %s", self.tag(state.round_no), e)

    def committed(self, state: GlobalState, *, provisional: bool) -> None:
        """A committed state is installed. A provisional one (decided by the group while the coordinator is
        down) is neither checkpointed nor allowed to delete older votes: the coordinator may still void it."""
        self.publish()
        self.provisional = provisional
        if provisional:
            return
        self.prune(below=state.round_no)
        if state.round_no > 0 and self.every > 0 and state.round_no % self.every == 0:
            self.checkpoint(wait=False)

    def voided(self, round_no: int, *, provisional: bool) -> None:
        if not provisional:
            self.prune(below=self.trainer.round_no)

    def prune(self, *, below: int) -> None:
        """Delete the votes of rounds before ``below``: the coordinator committed ``below`` or later."""
        prune_votes(self.state_dir, below=below)

    # ---- the peer's own ------------------------------------------------------------------------------
    def start(self, *, resumed: bool) -> None:
        """The peer's start: the trainer holds θ0, installed now, or (``resumed``) the committed state from this
        peer's own disk, which it only announces (its disk was read for that round already)."""
        if not resumed:
            self.install(self.trainer.state)
            return
        self.disk_tried = self.trainer.round_no
        self.provisional = False
        self.publish()

    def install(self, state: GlobalState) -> None:
        """A state from outside a round (θ0, a download): θl restarts from it."""
        self.finisher.wait()  # it writes the state being replaced
        self.trainer.commit(state)
        self.committed(state, provisional=False)

    def confirmed(self, *, checkpoint: bool) -> None:
        """The coordinator confirmed the provisional rounds: the state is safe to resume from."""
        self.provisional = False
        if checkpoint and self.every > 0:
            self.checkpoint(wait=False)

    def publish(self) -> None:
        state = self.trainer.state
        self.transfer.publish(state)
        self.stats.update(state_hash=state.state_hash, state_round=state.round_no, state=pb.PEER_STATE_READY)
        # at once: the next round admits late peers only until its first participant starts exchanging
        self.announce()

    def checkpoint(self, *, wait: bool = True) -> None:
        """The trainer's state as a checkpoint (``save_trainer``'s). Its local training state is written now, from
        the trainer's tensors as they are (the next inner step changes θl and the AdamW state). ``wait=False`` (a
        round's): θg and the outer state, which only the next commit changes, are written on the finisher's thread,
        and the file hashed, fsynced and put in place there, while the peer trains on; a crash meanwhile leaves the
        checkpoint before. The next vote, install or checkpoint waits for it. ``wait=True`` (leaving): in place
        when it returns, and one still being finished is given up, as this one replaces it."""
        started = time.perf_counter()
        self.finisher.wait(cancel=wait)
        try:
            staged = stage_trainer(
                checkpoint_dir(self.state_dir),
                self.trainer,
                run_id=self.run_id,
                spare=checkpoint_spare(self.state_dir),
                global_later=not wait,
            )
            written = time.perf_counter()
            if wait:
                staged.finish()
            else:
                self.finisher.start(staged)
        except OSError as e:
            self._not_written(e)
            return
        logger.info(
            "%s checkpoint's tensor file (%d bytes) written in %.2f s%s",
            self.tag(None),
            staged.size,
            written - started,
            f", in place {time.perf_counter() - written:.2f} s later" if wait else "",
        )

    def _not_written(self, error: OSError) -> None:  # a full disk must not stop training; the next one may succeed
        logger.warning("%s could not write a checkpoint: %s", self.tag(None), error)

    def sync(self, info: pb.RoundInfo, holders: Callable[[int], list[str]]) -> bool:
        """Resume the newest committed state from this peer's own disk (a checkpoint or its vote), or else
        download it from a holder; either way its hash must be the committed one."""
        from swarm.net.bulk.state_transfer import StateUnavailable  # hivemind: imported by the DHT start first

        target = info.last_committed_round
        if self.disk_tried != target:
            self.disk_tried = target
            self.finisher.wait()  # the checkpoint being finished is on disk before the disk is read
            if (
                maybe_resume(
                    self.state_dir,
                    self.trainer,
                    run_id=self.run_id,
                    round_no=target,
                    state_hash=info.last_committed_hash,
                )
                is not None
            ):
                self.provisional = False  # the coordinator committed this round
                self.publish()
                return True
        self.stats.update(state=pb.PEER_STATE_JOINING)
        self.faults.at(target, "syncing")
        sources = holders(target)
        logger.info(
            "%s behind (holds round %d, committed is %d): downloading from %d holders",
            self.tag(None),
            self.trainer.round_no,
            target,
            len(sources),
        )
        try:
            state, nbytes = self.transfer.download(
                sources, round_no=target, expected_hash=info.last_committed_hash, like=self.trainer.state
            )
        except StateUnavailable as e:
            logger.warning("%s %s; will retry", self.tag(None), e)
            return False
        self.stats.add(bytes_received=nbytes)
        self.install(state)
        logger.info("%s synced to round %d, hash %s", self.tag(None), target, state.state_hash)
        return True
