"""Another run's final model in this peer's state dir: `<state-dir>/final/model.safetensors` written by an earlier
run is named at join (one WARNING) and, when this run writes its own, kept beside it as
`model.<that run's id>.safetensors` instead of being overwritten."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Optional

from safetensors import safe_open

from swarm.config import RunConfig
from swarm.train.model.final_model import RUN_ID_KEY, RUN_SPEC_KEY

logger = logging.getLogger(__name__)

FINAL_MODEL = Path("final") / "model.safetensors"


def final_model_path(state_dir: Path) -> Path:
    return Path(state_dir) / FINAL_MODEL


def other_run(path: Path, run_id: str, run: RunConfig) -> Optional[str]:
    """The id of the run whose final model ``path`` holds, when that is not run ``run_id``; None when there is no
    such file, or it is this run's. A file written before final models named their run (no run id) is another
    run's when its run spec differs from ``run``'s in more than what a run may change (``[rounds] max_rounds``,
    ``[logging]``): it is then named by its round and state hash."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception:  # not a safetensors file (safetensors raises its own error type): not a final model
        return None
    if metadata.get(RUN_ID_KEY):
        return None if metadata[RUN_ID_KEY] == run_id else metadata[RUN_ID_KEY]
    spec = metadata.get(RUN_SPEC_KEY)
    if spec is None or _lasting(spec) == _lasting(run.to_json()):
        return None
    return f"round{metadata.get('round_no', '')}-{metadata.get('state_hash', '')[:12]}"


def _lasting(run_spec_json: str) -> dict:
    """The run spec without what a restart of the same run may change."""
    try:
        spec = json.loads(run_spec_json)
    except ValueError:
        return {}
    spec.pop("logging", None)
    if isinstance(spec.get("rounds"), dict):
        spec["rounds"].pop("max_rounds", None)
    return spec


def warn_if_other_run(state_dir: Path, run_id: str, run: RunConfig, tag: str) -> None:
    """At join: one WARNING when the state dir's final model is another run's (this run's final model replaces it)."""
    path = final_model_path(state_dir)
    other = other_run(path, run_id, run)
    if other is not None:
        logger.warning(
            "%s %s holds run %s's final model; it will be replaced when this run finishes — use another "
            "--state-dir to keep it",
            tag,
            path,
            other,
        )


def set_aside(path: Path, run_id: str, run: RunConfig) -> Optional[Path]:
    """Before this run writes its final model at ``path``: another run's file there moves to
    ``model.<its run id>.safetensors`` (returned); None when there is nothing to keep."""
    other = other_run(path, run_id, run)
    if other is None:
        return None
    aside = path.with_name(f"{path.stem}.{re.sub(r'[^A-Za-z0-9_.-]', '_', other)}{path.suffix}")
    os.replace(path, aside)
    return aside
