"""A peer's votes on disk: the tentative state of a round, written before its hash is reported, one directory per
round, and pruned once the coordinator has committed a later round."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from peer.state.checkpoint import TENSORS, save_checkpoint
from swarm.core.safetensors_io import LazyTensor
from swarm.core.state import GlobalState, state_tensors
from swarm.core.tentative import TentativeState


def vote_dir(state_dir: Path, round_no: int) -> Path:
    return Path(state_dir) / "votes" / f"r{round_no:08d}"


def save_vote(
    state_dir: Path, state: GlobalState | TentativeState, *, run_id: str, step_time: Optional[dict[str, Any]] = None
) -> None:
    """Persist the tentative state of its round before its hash is reported (atomic, verified). The file is
    written straight from the tensors; a ``TentativeState`` is stepped once, a piece at a time, as it is written,
    its hash made in the same pass, so the vote never holds a second θg and outer state. ``step_time``: the peer's
    ``step_time_record``, for a restart to reuse.

    Not fsynced: a killed peer's vote is whole (the page cache outlives the process), and a vote that a machine
    crash left torn or missing is refused on resume (its tensors must hash to the committed state hash, its file
    must have its manifest's size), so that peer downloads the state instead. The file written over is a
    pruned vote's (``prune_votes`` keeps one as ``spare_vote``), not a new one."""

    # no SHA-256 of the file: a vote is used only when its tensors hash to the committed state hash
    def manifest() -> dict[str, Any]:  # after the tensors: a tentative state's hash is made as it is written
        return {
            "kind": "vote",
            "run_id": run_id,
            "round": state.round_no,
            "state_hash": state.state_hash,
            **(step_time or {}),
        }

    spare = spare_vote(state_dir)
    if isinstance(state, TentativeState):
        save_checkpoint(
            vote_dir(state_dir, state.round_no),
            write=state.write_safetensors,
            manifest=manifest,
            file_digest=False,
            durable=False,
            reuse=spare,
        )
        return
    save_checkpoint(
        vote_dir(state_dir, state.round_no),
        tensors=vote_tensors(state),
        manifest=manifest,
        file_digest=False,
        durable=False,
        reuse=spare,
    )


def spare_vote(state_dir: Path) -> Path:
    """A pruned vote's tensor file, kept for the next vote to be written over (never read as a vote)."""
    return Path(state_dir) / "votes" / "spare.safetensors"


def vote_tensors(state: GlobalState | TentativeState) -> dict[str, torch.Tensor | LazyTensor]:
    """The state in the one layout (``state_tensors``); a tentative state's tensors are made when written."""
    if not isinstance(state, TentativeState):
        return state_tensors(state)
    tensors: dict[str, torch.Tensor | LazyTensor] = {}
    for group, (prefix, base) in enumerate((("param", state.base.params), ("outer", state.base.outer_state))):
        for i, t in enumerate(base):
            tensors[f"{prefix}.{i:05d}"] = LazyTensor(
                torch.float32, tuple(t.shape), functools.partial(state.tensor, group, i)
            )
    return tensors


def prune_votes(state_dir: Path, *, below: int) -> None:
    """Delete the votes of rounds before ``below``: the coordinator committed a later round (or ``below``
    itself). Votes of rounds decided only by the group during a coordinator outage are kept, with the
    last round the coordinator committed, until the coordinator confirms something newer. One pruned vote's
    tensor file is kept as ``spare_vote``, for the next vote to be written over."""
    votes = Path(state_dir) / "votes"
    if not votes.exists():
        return
    spare = spare_vote(state_dir)
    for path in votes.iterdir():
        match = re.fullmatch(r"r(\d{8})(\.tmp|\.old)?", path.name)
        if match and int(match.group(1)) < below:
            if not spare.exists():
                try:
                    (path / TENSORS).replace(spare)
                except OSError:  # no tensor file in it: nothing to keep
                    pass
            shutil.rmtree(path, ignore_errors=True)
