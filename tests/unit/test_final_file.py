"""A peer whose state dir holds another run's final model: one WARNING at join, and the file kept beside the new one
as model.<its run id>.safetensors when this run writes its own, instead of being overwritten."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
from safetensors import safe_open

from peer.state.final_file import final_model_path, other_run, set_aside, warn_if_other_run
from swarm.config import RunConfig
from swarm.core.state import GlobalState
from swarm.train.model.final_model import tensors_digest, write_final_model
from swarm.train.model.run_model import build_run_model

pytestmark = pytest.mark.timeout(60)

RUN = RunConfig.from_dict({"model": {"preset": "bench"}, "rounds": {"max_rounds": 3}})


def _write(path: Path, *, run: RunConfig = RUN, run_id: str | None, seed: int = 0) -> str:
    model = build_run_model(run.model, seed=seed).module
    write_final_model(
        path, model, GlobalState(3, [p.detach().clone() for p in model.parameters()], []), run=run, run_id=run_id
    )
    return tensors_digest(path)


def test_another_runs_final_model_is_named_at_join_and_kept_when_this_run_writes_its_own(tmp_path, caplog):
    path = final_model_path(tmp_path)
    old = _write(path, run_id="run-aaaaaaaaaaaa")
    with caplog.at_level(logging.INFO, logger="peer.state.final_file"):
        warn_if_other_run(tmp_path, "run-bbbbbbbbbbbb", RUN, "[p-1]")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            f"[p-1] {path} holds run run-aaaaaaaaaaaa's final model; it will be replaced when this run "
            "finishes — use another --state-dir to keep it",
        )
    ]
    aside = set_aside(path, "run-bbbbbbbbbbbb", RUN)
    assert aside == tmp_path / "final" / "model.run-aaaaaaaaaaaa.safetensors"
    assert not path.exists() and tensors_digest(aside) == old
    new = _write(path, run_id="run-bbbbbbbbbbbb", seed=1)
    assert tensors_digest(path) == new != old and tensors_digest(aside) == old


def test_this_runs_own_final_model_or_none_is_not_warned_about_nor_moved(tmp_path, caplog):
    path = final_model_path(tmp_path)
    with caplog.at_level(logging.INFO, logger="peer.state.final_file"):
        warn_if_other_run(tmp_path, "run-aaaaaaaaaaaa", RUN, "[p-1]")  # no final model yet
        assert set_aside(path, "run-aaaaaaaaaaaa", RUN) is None
        _write(path, run_id="run-aaaaaaaaaaaa")
        warn_if_other_run(tmp_path, "run-aaaaaaaaaaaa", RUN, "[p-1]")  # a restart of the finished run, extended
        assert set_aside(path, "run-aaaaaaaaaaaa", RUN) is None
    assert caplog.records == [] and sorted(p.name for p in path.parent.iterdir()) == ["model.safetensors"]


def test_a_final_model_that_names_no_run_is_another_runs_when_its_spec_differs(tmp_path):
    path = final_model_path(tmp_path)
    _write(path, run_id=None)  # written before final models named their run
    extended = RUN.replace(rounds=dataclasses.replace(RUN.rounds, max_rounds=9))
    assert other_run(path, "run-aaaaaaaaaaaa", extended) is None  # the same run, extended: replaced as before
    other = RunConfig.from_dict({"model": {"preset": "bench"}, "seed": 7, "rounds": {"max_rounds": 3}})
    with safe_open(str(path), "pt") as f:
        label = f"round3-{f.metadata()['state_hash'][:12]}"
    assert other_run(path, "run-aaaaaaaaaaaa", other) == label
    assert set_aside(path, "run-aaaaaaaaaaaa", other) == path.with_name(f"model.{label}.safetensors")


def test_a_file_that_is_no_safetensors_is_left_to_be_replaced(tmp_path):
    path = final_model_path(tmp_path)
    path.parent.mkdir()
    path.write_bytes(b"not a model")
    assert other_run(path, "run-aaaaaaaaaaaa", RUN) is None
