"""`swarm export` takes the run's tokenizer along: AutoModelForCausalLM and AutoTokenizer both load the export and
generate() runs; a run on bytes says it has none and how to get one; special token ids outside the vocabulary are
warned about at export and at the coordinator's start."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from swarm.app.cli import main as cli_main
from swarm.config import RunConfig
from swarm.core.state import GlobalState
from swarm.train.model.final_model import write_final_model
from swarm.train.model.run_model import build_run_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "swarm" / "train"
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 64, "vocab_size": 100}
DATA = {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "num_shards": 2, "max_bytes": 200_000}


def _tokenizer(path: Path, *, special: str = "") -> Path:
    pytest.importorskip("tokenizers")
    from scripts.train_tokenizer import train

    train(str(TEXT), vocab_size=100, out=str(path), max_bytes=100_000)
    if special:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.add_special_tokens([special])  # id 100
        tokenizer.save(str(path))
    return path


def _finished_peer(tmp_path: Path, run: RunConfig) -> Path:
    """A peer state dir holding the run's final model (θ0 stands for θg: what matters here is the file's form)."""
    model = build_run_model(run.model, seed=run.seed).module
    params = [p.detach().clone() for p in model.parameters()]
    write_final_model(tmp_path / "peer" / "final" / "model.safetensors", model, GlobalState(3, params, []), run=run)
    return tmp_path / "peer"


def _hf_run(tmp_path: Path, hf_config: dict, tokenizer: Path) -> RunConfig:
    return RunConfig.from_dict(
        {
            "model": {"hf_config": hf_config},
            "data": {**DATA, "source": str(TEXT), "tokenizer": str(tokenizer), "cache_dir": str(tmp_path / "cache")},
        }
    )


def _generate(out: Path) -> tuple[object, torch.Tensor]:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    inputs = tokenizer("def main():", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 3
    assert tokenizer.decode(generated[0]).startswith("def main():")
    return tokenizer, generated


def test_an_hf_export_carries_the_runs_tokenizer_and_both_auto_classes_load_and_generate(
    tmp_path: Path, capsys
) -> None:
    pytest.importorskip("transformers")
    run = _hf_run(tmp_path, GPT2, _tokenizer(tmp_path / "tok.json"))
    peer = _finished_peer(tmp_path, run)
    assert cli_main(["export", str(peer), str(tmp_path / "hf")]) == 0
    printed = capsys.readouterr()
    assert "tokenizer.json" in printed.out
    # GPT-2's default bos/eos id 50256 is no id of a 100-token vocabulary: one sentence says so
    (warning,) = printed.err.splitlines()
    assert "bos_token_id 50256 and eos_token_id 50256 lie outside its vocabulary of 100 ids" in warning
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 64
    assert not {"bos_token", "eos_token"} & set(config)  # the tokenizer has no special tokens to name
    tokenizer, _ = _generate(tmp_path / "hf")
    assert len(tokenizer) == 100


def test_special_tokens_the_tokenizer_and_the_config_agree_on_are_named(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    config = {**GPT2, "vocab_size": 101, "bos_token_id": 100, "eos_token_id": 100}
    run = _hf_run(tmp_path, config, _tokenizer(tmp_path / "tok.json", special="<|endoftext|>"))
    peer = _finished_peer(tmp_path, run)
    assert cli_main(["export", str(peer), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().err == ""  # the ids fit: nothing to warn about
    tokenizer, _ = _generate(tmp_path / "hf")
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>" and tokenizer.eos_token_id == 100


def test_a_tokenizer_found_beside_the_state_dir_or_given_with_a_flag_is_exported(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    pytest.importorskip("transformers")
    _tokenizer(tmp_path / "tok.json")
    monkeypatch.chdir(tmp_path)
    run = _hf_run(tmp_path, GPT2, Path("tok.json"))  # relative, as a run TOML names it
    peer = _finished_peer(tmp_path, run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert cli_main(["export", str(peer), "hf"]) == 0  # found beside the peer's state dir
    assert (elsewhere / "hf" / "tokenizer.json").is_file()
    (tmp_path / "tok.json").rename(tmp_path / "moved.json")
    capsys.readouterr()
    assert cli_main(["export", str(peer), "hf2"]) == 0
    assert "The run's tokenizer 'tok.json' is not on this machine" in capsys.readouterr().err
    assert not (elsewhere / "hf2" / "tokenizer.json").exists()
    assert cli_main(["export", str(peer), "hf3", "--tokenizer", str(tmp_path / "moved.json")]) == 0
    _generate(elsewhere / "hf3")


def test_export_refusals_are_one_sentence(tmp_path: Path, capsys) -> None:
    pytest.importorskip("transformers")
    run = _hf_run(tmp_path, GPT2, _tokenizer(tmp_path / "tok.json"))
    peer = _finished_peer(tmp_path, run)
    assert cli_main(["export", str(peer), str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "nope.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("swarm export: --tokenizer") and "does not exist" in line
    from scripts.train_tokenizer import train

    train(str(TEXT), vocab_size=150, out=str(tmp_path / "big.json"), max_bytes=100_000)
    assert cli_main(["export", str(peer), str(tmp_path / "hf"), "--tokenizer", str(tmp_path / "big.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "has 150 tokens, more than the model's vocabulary of 100" in line


def test_a_run_on_bytes_exports_without_a_tokenizer_and_says_so(tmp_path: Path, capsys) -> None:
    run = RunConfig.from_dict({"data": {**DATA, "source": str(TEXT)}})
    peer = _finished_peer(tmp_path, run)
    assert cli_main(["export", str(peer), str(tmp_path / "out")]) == 0
    (line,) = capsys.readouterr().err.splitlines()
    assert "read its text as bytes" in line and "[data] tokenizer" in line
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]


def test_the_coordinator_warns_at_start_of_special_token_ids_outside_the_vocabulary(tmp_path: Path, caplog) -> None:
    pytest.importorskip("transformers")
    run = _hf_run(tmp_path, GPT2, _tokenizer(tmp_path / "tok.json"))
    with caplog.at_level(logging.WARNING, logger="coordinator.store.run_open"):
        CoordinatorEngine(Store(":memory:"), config=run)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "eos_token_id 50256" in warning and "outside its vocabulary of 100 ids" in warning
    caplog.clear()
    fitting = _hf_run(tmp_path, {**GPT2, "bos_token_id": 0, "eos_token_id": 0}, tmp_path / "tok.json")
    with caplog.at_level(logging.WARNING, logger="coordinator.store.run_open"):
        CoordinatorEngine(Store(":memory:"), config=fitting)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
