"""`swarm status` names the model the run trains: an hf_config's model_type, a factory's spec or a preset's name,
in the table and in the JSON (`model`, `model_source`; `model_preset` only for a preset)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from swarm.app.status import model_line, render_status, status_to_dict
from swarm.config import RunConfig

pytestmark = pytest.mark.timeout(60)

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64, "vocab_size": 100}
DATA = {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "num_shards": 2}


def _status(tmp_path: Path, model: dict) -> dict:
    tokens = tmp_path / "train.bin"
    tokens.write_bytes((np.arange(20_000) * 7 % 100).astype("<u2").tobytes())
    run = RunConfig.from_dict({"model": model, "data": {**DATA, "tokens": str(tokens)}})
    engine = CoordinatorEngine(Store(":memory:"), config=run)
    return status_to_dict(engine.status(engine.run.token))


def _table(status: dict) -> str:
    out = io.StringIO()
    render_status(status, Console(file=out))
    return out.getvalue()


@pytest.mark.parametrize("where", ["inline", "file"])
def test_an_hf_config_run_is_shown_as_its_model_type_with_its_size(tmp_path: Path, where: str) -> None:
    pytest.importorskip("transformers")
    spec = GPT2
    if where == "file":
        (tmp_path / "config.json").write_text(json.dumps(GPT2))
        spec = str(tmp_path / "config.json")
    status = _status(tmp_path, {"hf_config": spec})
    run = status["run"]
    assert (run["model"], run["model_source"], run["model_preset"]) == ("gpt2", "hf_config", "")
    assert run["param_count"] > 0
    assert f"gpt2 (hf_config, {run['param_count']:,} parameters)" in _table(status)
    assert "tiny" not in model_line(run)


def test_a_factory_run_is_shown_as_its_factory_spec(tmp_path: Path) -> None:
    run = _status(
        tmp_path,
        {
            "factory": "examples.my_model:build",
            "loss": "examples.my_model:loss",
            "options": {"width": 16, "layers": 1, "heads": 2, "context": 32},
        },
    )["run"]
    assert (run["model"], run["model_source"], run["model_preset"]) == ("examples.my_model:build", "factory", "")
    assert model_line(run) == f"examples.my_model:build (factory, {run['param_count']:,} parameters)"


def test_a_preset_run_keeps_its_preset_name(tmp_path: Path) -> None:
    run = _status(tmp_path, {"preset": "tiny", "vocab_size": 100})["run"]
    assert (run["model"], run["model_source"], run["model_preset"]) == ("tiny", "preset", "tiny")
    assert model_line(run) == f"tiny (preset, {run['param_count']:,} parameters)"


def test_a_coordinator_before_the_model_field_is_shown_by_its_preset() -> None:
    old = {"model_preset": "tiny", "param_count": 443008, "model": "", "model_source": ""}
    assert model_line(old) == "tiny (443,008 parameters)"
