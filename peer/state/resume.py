"""What a peer checkpoints and how it resumes: θg and the outer state, its local model, its inner
AdamW state, its error-feedback residuals and its data position (the state in the one layout of swarm.core.state; the files as peer/state/checkpoint.py writes them).

A restarted peer resumes from its own checkpoint only when it is current: the same run, and the
round and hash the coordinator says were committed last. Otherwise it downloads the state from peers.

Before a peer reports the hash of its tentative θg' it also writes that state to disk (its *vote*,
``save_vote`` in peer/state/votes.py, one directory per round). A committed round is therefore on the disk
of every peer whose vote counted, even if all of them are killed before they learn the decision: restarted, they
resume from their votes (``maybe_resume``), so no committed round is ever lost while one of their
disks survives. A vote is deleted only once the coordinator has committed a later round
(``prune_votes``): rounds a group decides on its own during a coordinator outage are provisional, and
the last round the coordinator committed stays on disk until it confirms them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from peer.state.checkpoint import CheckpointError, StagedCheckpoint, load_checkpoint, read_manifest, stage_checkpoint
from peer.state.votes import vote_dir
from swarm.config import RunConfig
from swarm.core.state import GlobalState, state_from_tensors, state_tensors
from swarm.train.multi_gpu.ranks import Ranks
from swarm.train.trainer import LocalTrainer

logger = logging.getLogger(__name__)

GLOBAL_PREFIXES = ("param.", "outer.")  # the committed state's tensors in ``state_tensors``


def save_trainer(directory: Path, trainer: LocalTrainer, *, run_id: str) -> None:
    """The trainer's committed state (in the one state layout) and its local training state."""
    stage_trainer(directory, trainer, run_id=run_id).finish()


def stage_trainer(
    directory: Path, trainer: LocalTrainer, *, run_id: str, spare: Optional[Path] = None, global_later: bool = False
) -> StagedCheckpoint:
    """``save_trainer``'s tensor file written (``stage_checkpoint``; ``spare``: the file written over): the trainer
    may train on once it returns, and ``finish`` puts the checkpoint in place. ``global_later``: the committed state's
    tensors (θg and the outer state) are written by ``finish``, and no commit may change them before it has."""
    tensors = state_tensors(trainer.state)
    local = [p.detach() for p in trainer.model.parameters()]
    local_is_global = _holds_global(local, trainer.state.params)
    if not local_is_global:
        tensors.update({f"local.{i:05d}": p for i, p in enumerate(local)})
    inner = trainer.optimizer_state_dict()
    for index, state in inner["state"].items():
        for key, value in state.items():
            tensors[f"inner.{int(index):05d}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    for f, feedback in enumerate(trainer.error_feedback or []):
        if not feedback.is_zero:  # a missing one resumes as zero
            tensors[f"feedback.{f:03d}"] = feedback.residual
    manifest = {
        "run_id": run_id,
        "round": trainer.round_no,
        "state_hash": trainer.state.state_hash,
        "peer_index": trainer.peer_index,
        "inner_steps_done": trainer.inner_steps_done,
        "samples_since_sync": list(trainer._samples_since_sync),
        "sampler": trainer.sampler.state_dict(),
        "inner_param_groups": _jsonable(inner["param_groups"]),
        "local_is_global": local_is_global,
        **step_time_record(trainer),
    }
    later = (lambda name: name.startswith(GLOBAL_PREFIXES)) if global_later else (lambda name: False)
    return stage_checkpoint(directory, tensors=tensors, manifest=manifest, spare=spare, later=later)


def _holds_global(local: list[torch.Tensor], params: list[torch.Tensor]) -> bool:
    """θl holds θg's bits (a round's commit replaced it, as plain DiLoCo's does): the checkpoint's θl is its θg, and
    half a GB fewer are written at 124M. Compared as integers: -0.0 is not 0.0, and NaN is itself."""
    if len(local) != len(params):
        return False
    for p, g in zip(local, params):
        if p.device != g.device or p.dtype != g.dtype or p.shape != g.shape or p.dtype.itemsize != 4:
            return False
        if not torch.equal(p.view(torch.int32), g.view(torch.int32)):
            return False
    return True


def step_time_record(trainer: LocalTrainer) -> dict[str, Any]:
    """The step time this peer measured, for a restart on the same device to reuse instead of probing again."""
    step_s = trainer.local_step_time_s
    return {"step_time_s": step_s, "device": str(trainer.device)} if step_s else {}


@dataclass
class OnDisk:
    """The committed state found on a peer's own disk, hash-checked, with what goes with it."""

    state: GlobalState
    source: str  # "checkpoint" or "vote"
    directory: Path
    # the checkpoint whose local training state is restored with it: the state's own (source "checkpoint"), or
    # an earlier one of the run whose AdamW state and data position go with a vote
    local: Optional[tuple[dict[str, torch.Tensor], dict[str, Any]]]
    step_time_s: Optional[float]  # measured before on ``device`` (None: not recorded)
    device: str = ""


def committed_on_disk(
    state_dir: Path, *, run_id: str, round_no: int, state_hash: str, like: Optional[GlobalState] = None
) -> Optional[OnDisk]:
    """The committed state of ``round_no`` from this peer's checkpoint, or else from its vote, when its tensors
    hash to ``state_hash`` (checked against ``like``'s shapes when given); None (logged) otherwise."""
    directory = checkpoint_dir(state_dir)
    loaded = _load_if_committed(directory, run_id=run_id, round_no=round_no, state_hash=state_hash, what="checkpoint")
    source = "checkpoint"
    if loaded is None:
        directory = vote_dir(state_dir, round_no)
        loaded = _load_if_committed(directory, run_id=run_id, round_no=round_no, state_hash=state_hash, what="vote")
        source = "vote"
    if loaded is None:
        return None
    tensors, manifest = loaded
    try:
        state = state_from_tensors(tensors, round_no, like=like, finite=False)  # its hash is checked next
    except ValueError as e:
        logger.warning("the %s in %s does not fit this model (%s); downloading the state instead", source, directory, e)
        return None
    if state.state_hash != state_hash:
        logger.warning(
            "the %s in %s is corrupted (its tensors do not hash to its manifest's %s); downloading instead",
            source,
            directory,
            state_hash,
        )
        return None
    local = loaded if source == "checkpoint" else _earlier_checkpoint(state_dir, run_id=run_id, round_no=round_no)
    step_s = manifest.get("step_time_s")
    return OnDisk(
        state,
        source,
        directory,
        local,
        float(step_s) if isinstance(step_s, (int, float)) else None,
        str(manifest.get("device", "")),
    )


def _earlier_checkpoint(
    state_dir: Path, *, run_id: str, round_no: int
) -> Optional[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    try:
        manifest = read_manifest(checkpoint_dir(state_dir))
        if manifest and manifest.get("run_id") == run_id and int(manifest.get("round", -1)) < round_no:
            return load_checkpoint(checkpoint_dir(state_dir))
    except (CheckpointError, ValueError, TypeError) as e:
        logger.info("no usable local checkpoint to go with the vote (%s); inner state starts fresh", e)
    return None


def install(trainer: LocalTrainer, found: OnDisk, *, committed: bool = False) -> bool:
    """Make ``found`` the trainer's committed state and restore its local training state: all of it from its own
    checkpoint; from an earlier checkpoint with a vote, the AdamW state and data position only (θl restarts from
    θg, as after any full sync, and error feedback from zero: that checkpoint's residual was already sent).
    ``committed``: the trainer was built from ``found.state`` already. False (logged) when the local state does
    not fit, which leaves the trainer on ``found.state`` with its local state as it was."""
    if not committed:
        trainer.commit(found.state)
    if found.local is None:
        return True
    tensors, manifest = found.local
    own = found.source == "checkpoint"
    try:
        _restore_local(trainer, tensors, manifest, own=own)
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        logger.warning(
            "the local training state of the checkpoint beside the %s in %s does not fit this model "
            "(%s); it starts fresh",
            found.source,
            found.directory,
            e,
        )
        return False
    return True


def resume_trainer(directory: Path, trainer: LocalTrainer, *, run_id: str, round_no: int, state_hash: str) -> bool:
    """Load the checkpoint into trainer when it holds exactly (run_id, round_no, state_hash); True if so."""
    loaded = _load_if_committed(directory, run_id=run_id, round_no=round_no, state_hash=state_hash, what="checkpoint")
    if loaded is None:
        return False
    tensors, manifest = loaded
    try:
        state = state_from_tensors(tensors, round_no, like=trainer.state)
    except ValueError as e:
        logger.warning("checkpoint in %s does not fit this model (%s); downloading the state instead", directory, e)
        return False
    if state.state_hash != state_hash:
        logger.warning(
            "checkpoint in %s restored a state whose hash differs from its manifest; downloading instead", directory
        )
        return False
    return install(trainer, OnDisk(state, "checkpoint", Path(directory), loaded, None))


def _load_if_committed(
    directory: Path, *, run_id: str, round_no: int, state_hash: str, what: str
) -> Optional[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    """(tensors, manifest) of the checkpoint or vote in directory if it holds exactly the committed
    (run_id, round_no, state_hash); None (logged) when it is missing, damaged or another state."""
    try:
        manifest = read_manifest(directory)  # first the manifest: a stale one is skipped without reading tensors
        if manifest is None:
            return None
        if (manifest.get("run_id"), manifest.get("round"), manifest.get("state_hash")) != (
            run_id,
            round_no,
            state_hash,
        ):
            logger.info(
                "%s in %s holds round %s of run %s, not the committed round %d",
                what,
                directory,
                manifest.get("round"),
                manifest.get("run_id"),
                round_no,
            )
            return None
        return load_checkpoint(directory)
    except CheckpointError as e:
        logger.warning("%s; downloading the state from peers instead", e)
        return None


def _restore_local(
    trainer: LocalTrainer, tensors: dict[str, torch.Tensor], manifest: dict[str, Any], *, own: bool
) -> None:
    """The checkpoint's AdamW state, step count and data position into ``trainer``; ``own`` (the checkpoint of the
    committed state itself): θl and the error-feedback residuals too."""
    if own:
        with torch.no_grad():
            source = "param" if manifest.get("local_is_global") else "local"  # θl was θg's bits
            for i, p in enumerate(trainer.model.parameters()):
                p.copy_(tensors[f"{source}.{i:05d}"])
        trainer.lockstep.params_changed = True
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("inner."):
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
    trainer.load_optimizer_state_dict({"state": state, "param_groups": manifest["inner_param_groups"]})
    for f, feedback in enumerate(trainer.error_feedback or []):
        residual = tensors.get(f"feedback.{f:03d}")
        if own and residual is not None:
            feedback.update(residual, torch.zeros_like(residual))  # residual = residual − 0
        else:
            feedback.reset()
    trainer.inner_steps_done = int(manifest["inner_steps_done"])
    if own:
        trainer._samples_since_sync = [int(n) for n in manifest["samples_since_sync"]]
    if manifest.get("peer_index") == trainer.peer_index:
        trainer.sampler.load_state_dict(manifest["sampler"])  # same shard: continue where it stopped


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if torch.is_tensor(value):
        return value.item()
    return value


def checkpoint_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "checkpoint"


def checkpoint_spare(state_dir: Path) -> Path:
    """The tensor file of a replaced checkpoint, kept for the next one to be written over (never read as one)."""
    return Path(state_dir) / "checkpoint.spare.safetensors"


def maybe_resume(
    state_dir: Path, trainer: LocalTrainer, *, run_id: str, round_no: int, state_hash: str
) -> Optional[int]:
    """Resume when the peer's own checkpoint, or else its last vote, is the committed state of round_no;
    returns the round resumed or None (the peer then downloads the state from peers)."""
    found = committed_on_disk(state_dir, run_id=run_id, round_no=round_no, state_hash=state_hash, like=trainer.state)
    if found is None:
        return None
    install(trainer, found)
    _log_resumed(found, state_hash)
    return round_no


def _log_resumed(found: OnDisk, state_hash: str) -> None:
    if found.source == "checkpoint":
        logger.info("resumed from own checkpoint at round %d (hash %s)", found.state.round_no, state_hash)
    else:
        logger.info(
            "resumed from own vote for round %d, which was committed (hash %s)", found.state.round_no, state_hash
        )


@dataclass
class Started:
    """A peer's trainer as its start built it: from its own disk (``resumed``) or from θ0."""

    trainer: LocalTrainer
    resumed: Optional[OnDisk]

    def known_step_time(self) -> Optional[float]:
        """The step time this peer measured before its restart on the same device (None: probe it)."""
        found = self.resumed
        if (
            found is None
            or not found.step_time_s
            or found.device != str(self.trainer.device)
            or self.trainer.ranks is not None
        ):
            return None
        return found.step_time_s


def start_trainer(
    run: RunConfig,
    state_dir: Path,
    *,
    run_id: str,
    round_no: int,
    state_hash: str,
    peer_index: int,
    device: str,
    ranks: Optional[Ranks] = None,
    build: Callable[..., LocalTrainer] = LocalTrainer,
) -> Started:
    """The trainer of a peer's start (made by ``build``, ``LocalTrainer``'s signature). A restarted peer whose own
    checkpoint or vote is the committed state of ``round_no`` builds its model from it (θ0 is neither drawn nor
    hashed) and restores its local training state; any other starts from θ0 (and syncs later)."""
    found = None
    if round_no > 0:
        found = committed_on_disk(state_dir, run_id=run_id, round_no=round_no, state_hash=state_hash)
    if found is not None:
        try:
            trainer = build(run, peer_index=peer_index, device=device, ranks=ranks, initial=found.state)
        except ValueError as e:
            logger.warning(
                "the %s in %s does not fit this model (%s); starting from θ0", found.source, found.directory, e
            )
        else:
            trainer.feedback.spill_to(residual_dir(state_dir))
            install(trainer, found, committed=True)
            _log_resumed(found, state_hash)
            return Started(trainer, found)
    trainer = build(run, peer_index=peer_index, device=device, ranks=ranks)
    trainer.feedback.spill_to(residual_dir(state_dir))
    return Started(trainer, None)


def residual_dir(state_dir: Path) -> Path:
    """Where a peer keeps error feedback's residuals (``SentFeedback.spill_to``): files of this process only."""
    return Path(state_dir) / "residuals"
