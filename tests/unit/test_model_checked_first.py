"""Mistakes in [model] are reported before anything slow: a misspelt hf_config path or factory module before the
coordinator's imports, what only transformers or the import tells before the data is read, and a model whose
vocabulary is smaller than the data's (which no peer could train) before the coordinator serves it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import coordinator.store.run_identity
from coordinator.store.database import Store
from coordinator.store.run_open import open_run
from swarm.app.cli import main
from swarm.config import ConfigError, RunConfig
from tests.integration.harness import ROOT

pytestmark = pytest.mark.timeout(60)

FACTORY = """
from torch import nn


def build(model_table):
    return nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 100))
"""

# in a fresh interpreter: the sentence, the exit status, and which of the slow modules were imported by then
COLD = """
import sys
from swarm.app.cli import main
code = main(sys.argv[1:])
print("exit", code, "imported", [m for m in ("torch", "transformers", "coordinator.server") if m in sys.modules])
"""


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, sentence",
    [
        (
            'hf_config = "configs/nope/config.json"',
            "[model] hf_config 'configs/nope/config.json' does not exist; give a config.json path.",
        ),
        (
            'factory = "mymodle:build"',
            "[model] factory 'mymodle:build' cannot be imported (No module named 'mymodle'); put its package on PYTHONPATH.",
        ),
    ],
)
def test_a_misspelt_hf_config_or_factory_is_refused_before_the_slow_imports(tmp_path, model, sentence):
    config = _toml(tmp_path, f"[model]\n{model}\n")
    done = subprocess.run(
        [sys.executable, "-c", COLD, "coordinator", "--config", config, "--state-dir", str(tmp_path / "state")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=30,
    )
    assert done.stderr.strip() == f"swarm coordinator: {sentence}"
    assert done.stdout.strip() == "exit 2 imported []"  # no torch, no coordinator: the sentence comes at once


@pytest.fixture
def data_unread(monkeypatch):
    """The coordinator's reading of the data fails the test: a model mistake must be found before it."""

    def read(_data):
        raise AssertionError("the data was read before the model's config was checked")

    monkeypatch.setattr(coordinator.store.run_identity, "data_fingerprint", read)


def _open(tmp_path: Path, run: RunConfig) -> RunConfig:
    store = Store.in_dir(tmp_path)
    try:
        return open_run(store, run, check_config=True, now=0.0)
    finally:
        store.close()


@pytest.mark.parametrize(
    "model, words",
    [
        ({"hf_config": {"model_type": "gpt2x"}}, "[model] hf_config model_type 'gpt2x' is not one transformers"),
        (
            {"factory": "json:nothere"},
            "[model] factory 'json:nothere': json has no function 'nothere'; check the name.",
        ),
    ],
)
def test_what_only_the_import_tells_is_reported_before_the_data_is_read(tmp_path, data_unread, model, words):
    with pytest.raises(ConfigError) as refused:
        _open(tmp_path, RunConfig.from_dict({"model": model}))
    assert str(refused.value).startswith(words) and len(str(refused.value)) < 200


def _tokenizer(path: Path, size: int) -> str:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel({f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}, unk_token="[UNK]")).save(str(path))
    return str(path)


def test_a_preset_with_fewer_ids_than_the_bytes_is_refused_naming_both_sizes(tmp_path, data_unread):
    with pytest.raises(ConfigError) as refused:
        _open(tmp_path, RunConfig.from_dict({"model": {"vocab_size": 100}}))
    assert str(refused.value) == (
        "the model's vocabulary (100 ids) is smaller than the 256 byte values the data is read as, so no peer could"
        " train it; set [model] vocab_size to at least 256, or give [data] a tokenizer of at most 100 ids."
    )


def test_an_hf_model_with_fewer_ids_than_the_tokenizer_is_refused_naming_both_sizes(tmp_path, data_unread):
    tokenizer = _tokenizer(tmp_path / "tokenizer.json", 300)
    hf = {
        "model_type": "gpt2",
        "vocab_size": 260,
        "n_layer": 1,
        "n_embd": 16,
        "n_head": 2,
        "n_positions": 128,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    (tmp_path / "corpus.txt").write_text("w1 w2 w3\n" * 20_000)
    run = RunConfig.from_dict(
        {"model": {"hf_config": hf}, "data": {"source": str(tmp_path / "corpus.txt"), "tokenizer": tokenizer}}
    )
    with pytest.raises(ConfigError) as refused:
        _open(tmp_path, run)
    assert str(refused.value) == (
        f"the model's vocabulary (260 ids) is smaller than the tokenizer's (300 ids, [data] tokenizer {tokenizer}),"
        " so no peer could train it; set the hf_config's vocab_size to at least 300, or use a tokenizer of at most"
        " 260 ids."
    )


def test_a_factory_model_with_fewer_ids_than_the_bytes_is_refused_once_built(tmp_path, monkeypatch):
    (tmp_path / "smallvocab.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = RunConfig.from_dict({"model": {"factory": "smallvocab:build"}, "data": {"max_bytes": 100_000}})
    with pytest.raises(
        ConfigError,
        match=r"^the model's vocabulary \(100 ids\) is smaller than the 256 byte values .*"
        r"set the factory model's embedding size to at least 256",
    ):
        _open(tmp_path, run)
    store = Store.in_dir(tmp_path)
    assert store.get_run() is None  # no run was started
    store.close()


def test_the_coordinator_command_refuses_it_in_one_sentence_with_exit_2(tmp_path, capsys, data_unread):
    config = _toml(tmp_path, "[model]\nvocab_size = 200\n")
    with pytest.raises(SystemExit) as info:
        sys.exit(main(["coordinator", "--config", config, "--state-dir", str(tmp_path / "state")]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        "swarm coordinator: the model's vocabulary (200 ids) is smaller than the 256 byte values the data is read as,"
        " so no peer could train it; set [model] vocab_size to at least 256, or give [data] a tokenizer of at most"
        " 200 ids."
    ]


def test_a_tokenizer_that_fits_the_model_is_served(tmp_path):
    tokenizer = _tokenizer(tmp_path / "tokenizer.json", 300)
    (tmp_path / "corpus.txt").write_text("w1 w2 w3\n" * 20_000)
    run = RunConfig.from_dict(
        {
            "model": {"vocab_size": 300, "preset": "bench"},
            "data": {
                "source": str(tmp_path / "corpus.txt"),
                "tokenizer": tokenizer,
                "cache_dir": str(tmp_path / "cache"),
            },
        }
    )
    assert json.loads(_open(tmp_path, run).to_json())["model"]["vocab_size"] == 300
