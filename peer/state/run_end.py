"""How a peer's part in a finished run ends: holding the final state, it writes the final model (another run's
file kept beside it, ``peer.state.final_file``); stranded (the run finished and no holder of its final state is
left), it checkpoints what it holds and says in one sentence what that is and where."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

from peer.state.final_file import final_model_path, set_aside
from peer.state.resume import checkpoint_dir
from peer.state.state_store import PeerStateStore
from swarm.train.model.final_model import write_final_model
from swarm.train.trainer import LocalTrainer

logger = logging.getLogger("peer.daemon")  # the peer's lifecycle lines, where operators already look for them

Tag = Callable[[Optional[int]], str]


def holds_final(trainer: Optional[LocalTrainer], final: tuple[int, str]) -> bool:
    """The trainer holds the run's final state (its round and hash)."""
    return trainer is not None and (trainer.round_no, trainer.state.state_hash) == tuple(final)


def write_final(state_dir: Path, trainer: LocalTrainer, *, run_id: str, tag: Tag) -> None:
    """The final model, at ``<state-dir>/final/model.safetensors``."""
    path = final_model_path(state_dir)
    aside = set_aside(path, run_id, trainer.run)  # another run's final model is kept, not overwritten
    if aside is not None:
        logger.info("%s kept the earlier run's final model as %s", tag(None), aside)
    write_final_model(path, trainer.model, trainer.state, run=trainer.run, run_id=run_id)
    logger.info("%s run finished at round %d; wrote %s", tag(None), trainer.round_no, path)


def stranded(
    final_round: int,
    trainer: Optional[LocalTrainer],
    store: Optional[PeerStateStore],
    state_dir: Path,
    *,
    download_running: bool,
    checkpointed: bool,
    tag: Tag,
) -> bool:
    """The run finished at ``final_round`` and no holder of its final state is left: one ERROR saying what this peer
    holds and where. A committed state it holds is checkpointed first (unless ``checkpointed`` already, or it is
    provisional); nothing is written while a download may still install a state. True once its checkpoint is
    written."""
    if trainer is None or trainer.round_no <= 0 or download_running:
        where = (
            "it wrote no state (it holds no committed round)"
            if trainer is None or trainer.round_no <= 0
            else "its download was still running"
        )
        held = "no round" if trainer is None else f"round {trainer.round_no}"
    else:
        if not checkpointed and not store.provisional:
            store.checkpoint()
            checkpointed = True
        held = f"round {trainer.round_no} (hash {trainer.state.state_hash[:16]})"
        where = f"its state is in {checkpoint_dir(state_dir)}"
    logger.error(
        "%s the run finished at round %d while this peer held %s; %s; no holder is left to download "
        "round %d from, so it wrote no final model",
        tag(None),
        final_round,
        held,
        where,
        final_round,
    )
    return checkpointed
