"""Your own model and data: a factory model and a Hugging Face causal LM train in a 2-peer simulated run, token
files shard and resume, tokenized text is cached, a peer with another model or other data is refused, and the
export loads with from_pretrained."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.api.errors import StateMismatch
from coordinator.engine import CoordinatorEngine
from coordinator.store.database import Store
from swarm.config import ConfigError, RunConfig
from swarm.core.state import GlobalState
from swarm.train.data.data import BatchSampler, load_corpus
from swarm.train.model.final_model import write_final_model
from swarm.train.model.run_model import build_run_model
from swarm.train.simulator.sim import simulate
from swarm.train.trainer import LocalTrainer
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.fake_swarm import engine_join

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]

LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}
ROUNDS = {"inner_steps": 4, "max_rounds": 2}
SMALL_DATA = {"seq_len": 32, "batch_size": 4, "eval_batches": 2, "num_shards": 2}


def write_tokens(path: Path, tokens: np.ndarray, dtype: str = "uint16") -> Path:
    path.write_bytes(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    return path


def token_run(tmp_path: Path, **model) -> RunConfig:
    tokens = write_tokens(tmp_path / "train.bin", np.arange(20_000) * 7 % 100)  # learnable: next = previous + 7
    return RunConfig.from_dict(
        {"model": model or {"hf_config": LLAMA}, "rounds": ROUNDS, "data": {**SMALL_DATA, "tokens": str(tokens)}}
    )


def test_a_factory_model_trains_in_a_two_peer_run_and_ends_identical() -> None:
    run = RunConfig.from_dict(
        {
            "model": {
                "factory": "tests.unit.test_workloads:_factory",
                "loss": "examples.my_model:loss",
                "options": {"width": 16, "layers": 1, "heads": 2, "context": 32},
            },
            "data": {**SMALL_DATA, "max_bytes": 200_000},
            "rounds": ROUNDS,
        }
    )
    result = simulate(run, peers=2, rounds=2)
    assert result.consistent
    assert result.final_eval_loss < result.initial_eval_loss
    assert result.initial_hash == LocalTrainer(run, peer_index=1).state.state_hash  # θ0 is a function of the config


def _factory(table: dict) -> torch.nn.Module:
    from examples.my_model import build

    return build(table)


def test_token_files_shard_disjointly_resume_and_read_across_files(tmp_path: Path) -> None:
    tokens = np.arange(10_000) % 60_000
    whole = write_tokens(tmp_path / "whole.bin", tokens)
    write_tokens(tmp_path / "part-0.bin", tokens[:3_333])
    write_tokens(tmp_path / "part-1.bin", tokens[3_333:])
    one = load_corpus(RunConfig.from_dict({"data": {"tokens": str(whole), "eval_fraction": 0.1}}).data)
    two = load_corpus(
        RunConfig.from_dict({"data": {"tokens": str(tmp_path / "part-*.bin"), "eval_fraction": 0.1}}).data
    )
    assert (one.train.numel(), one.eval.numel()) == (9_000, 1_000)
    every = torch.arange(one.train.numel())
    assert torch.equal(one.train[every], two.train[every])  # a glob reads as one stream, windows cross files

    def sampler(index: int) -> BatchSampler:
        return BatchSampler(two.train, shard_index=index, num_shards=2, batch_size=4, seq_len=16, seed=0)

    first, second = sampler(0), sampler(1)
    seen = [set(first.next_batch()[0].flatten().tolist()), set(second.next_batch()[0].flatten().tolist())]
    assert max(seen[0]) < 4_500 <= min(seen[1])  # shard 0 is the first half of the train tokens, shard 1 the second
    resumed = sampler(0)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(resumed.next_batch()[0], first.next_batch()[0])


def _tokenizer(tmp_path: Path, vocab: int = 100, name: str = "tokenizer.json") -> Path:
    from scripts.train_tokenizer import train

    train(str(ROOT / "swarm" / "train"), vocab_size=vocab, out=str(tmp_path / name), max_bytes=100_000)
    return tmp_path / name


def test_text_is_tokenized_once_into_a_cache_keyed_by_text_and_tokenizer(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    tokenizer = _tokenizer(tmp_path)
    data = {"source": str(ROOT / "swarm" / "train"), "tokenizer": str(tokenizer), "cache_dir": str(tmp_path / "cache")}
    run = RunConfig.from_dict({"data": data})
    corpus = load_corpus(run.data)
    assert corpus.vocab_size == 100 and 0 < corpus.train.numel()
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    load_corpus(dataclasses.replace(run.data, eval_fraction=0.1))  # another split of the same tokens
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").iterdir()] == [stamp]
    other = _tokenizer(tmp_path, vocab=120, name="other.json")
    load_corpus(dataclasses.replace(run.data, tokenizer=str(other)))
    assert len(list((tmp_path / "cache").iterdir())) == 2
    with pytest.raises(
        ConfigError, match=r"model's vocabulary \(64 ids\) is smaller than the data's tokenizer's \(100\)"
    ):
        LocalTrainer(RunConfig.from_dict({"model": {"vocab_size": 64}, "data": data}), peer_index=0)


def test_a_hugging_face_run_exports_a_directory_from_pretrained_loads_with_the_final_weights(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from swarm.app.cli import main as cli_main

    run = token_run(tmp_path)
    result = simulate(run, peers=2, rounds=2)
    assert result.consistent and result.final_eval_loss < result.initial_eval_loss
    model = build_run_model(run.model, seed=run.seed).module
    write_final_model(
        tmp_path / "peer" / "final" / "model.safetensors", model, GlobalState(2, result.final_params, []), run=run
    )
    assert cli_main(["export", str(tmp_path / "peer"), str(tmp_path / "hf")]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    names = [name for name, _ in model.named_parameters()]
    exported = dict(loaded.named_parameters())
    assert all(torch.equal(exported[n], p) for n, p in zip(names, result.final_params))


def test_a_peer_with_another_model_or_other_data_is_refused_with_a_sentence(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    run = token_run(tmp_path)
    engine = CoordinatorEngine(Store(":memory:"), config=run, lease_s=60)
    peer, _ = engine_join(engine)
    spec = RunConfig.from_json(engine.run.run_spec_json)  # what every peer receives at join
    assert spec.data.fingerprint  # the coordinator hashed its copy of the token files

    write_tokens(tmp_path / "train.bin", np.arange(20_000) * 3 % 100)  # this peer's files differ
    with pytest.raises(ConfigError, match=r"this peer's data \(fingerprint [^)]+\) differs from the run's"):
        LocalTrainer(spec, peer_index=0)

    wider = build_run_model(dataclasses.replace(run.model, hf_config={**LLAMA, "hidden_size": 48}), seed=run.seed)
    from swarm.train.model.model import model_fingerprint

    with pytest.raises(StateMismatch, match=r"this peer's model \(fingerprint [^)]+\) does not match the run's"):
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=peer.peer_id,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY, state_round=0, model_fingerprint=model_fingerprint(wider.module)
                ),
            )
        )


def test_init_from_starts_every_peer_from_the_given_weights_and_other_weights_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    base = token_run(tmp_path)
    module = build_run_model(base.model, seed=7).module
    save_file({n: p.detach().contiguous() for n, p in module.named_parameters()}, str(tmp_path / "warm.safetensors"))
    run = base.replace(model=dataclasses.replace(base.model, init_from=str(tmp_path / "warm.safetensors")))
    trainer = LocalTrainer(run, peer_index=0)
    assert all(torch.equal(a, b) for a, b in zip(trainer.global_params, module.parameters()))
    engine = CoordinatorEngine(Store(":memory:"), config=run, lease_s=60)
    assert engine.run.initial_hash == trainer.state.state_hash
    peer, _ = engine_join(engine)
    cold = LocalTrainer(base, peer_index=1)  # a peer that ignored init_from
    with pytest.raises(StateMismatch, match=r"initial model state \(hash [^)]+\) differs from the run's"):
        engine.heartbeat(
            pb.HeartbeatRequest(
                peer_id=peer.peer_id,
                metrics=pb.PeerMetrics(
                    state=pb.PEER_STATE_READY,
                    state_round=0,
                    state_hash=cold.state.state_hash,
                    model_fingerprint=cold.fingerprint,
                ),
            )
        )
