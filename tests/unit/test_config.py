"""Run configuration: TOML loading, one-sentence ConfigErrors for every user mistake, and the JSON run spec."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from swarm.config import (
    CODEC_NAMES,
    FRAGMENT_PATTERNS,
    ConfigError,
    DataConfig,
    InnerOptConfig,
    ModelConfig,
    OuterOptConfig,
    RoundConfig,
    RunConfig,
    load_run_config,
)

pytestmark = pytest.mark.timeout(60)

FULL_TOML = """
seed = 42

[model]
preset = "small"
context = 64
dropout = 0.1

[data]
source = "stdlib"
seq_len = 64
batch_size = 4
eval_fraction = 0.1
eval_batches = 2
num_shards = 4
max_bytes = 1000000

[inner]
lr = 1e-3
weight_decay = 0.0
beta1 = 0.8
beta2 = 0.99
warmup_steps = 0
grad_clip = 0.5

[outer]
lr = 1          # an integer for a float is fine
momentum = 0.5
nesterov = false

[rounds]
inner_steps = 10
max_rounds = 3
min_peers = 2
codec = "fp16"
eval_every_rounds = 2
matchmaking_window_s = 5
exchange_timeout_s = 30.0
round_timeout_s = 120.0
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def load_error(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as failure:
        load_run_config(write(tmp_path, text))
    message = str(failure.value)
    assert "\n" not in message, "a ConfigError is one sentence"
    return message


def test_defaults_validate() -> None:
    config = RunConfig()
    assert config.validate() is config
    assert RunConfig.from_dict({}) == config


def test_a_toml_file_with_every_section_loads(tmp_path: Path) -> None:
    config = load_run_config(write(tmp_path, FULL_TOML))
    assert config == RunConfig(
        seed=42,
        model=ModelConfig(preset="small", context=64, dropout=0.1),
        data=DataConfig(
            source="stdlib",
            seq_len=64,
            batch_size=4,
            eval_fraction=0.1,
            eval_batches=2,
            num_shards=4,
            max_bytes=1_000_000,
        ),
        inner=InnerOptConfig(lr=1e-3, weight_decay=0.0, beta1=0.8, beta2=0.99, warmup_steps=0, grad_clip=0.5),
        outer=OuterOptConfig(lr=1.0, momentum=0.5, nesterov=False),
        rounds=RoundConfig(
            inner_steps=10,
            max_rounds=3,
            min_peers=2,
            codec="fp16",
            eval_every_rounds=2,
            matchmaking_window_s=5.0,
            exchange_timeout_s=30.0,
            round_timeout_s=120.0,
        ),
    )
    assert isinstance(config.outer.lr, float) and isinstance(config.rounds.matchmaking_window_s, float)


def test_a_partial_file_keeps_the_other_defaults(tmp_path: Path) -> None:
    config = load_run_config(write(tmp_path, "[rounds]\ninner_steps = 7\n"))
    assert config == RunConfig(rounds=RoundConfig(inner_steps=7))


def test_an_unknown_top_level_key_is_named_with_the_valid_keys(tmp_path: Path) -> None:
    message = load_error(tmp_path, "seed = 1\nsede = 2\n")
    assert "unknown key 'sede'" in message and "the top level" in message
    for valid in ("seed", "model", "data", "inner", "outer", "rounds"):
        assert repr(valid) in message


def test_an_unknown_section_is_named(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[optimizer]\nlr = 1.0\n")
    assert "unknown key 'optimizer'" in message


def test_an_unknown_key_inside_a_section_is_named_with_the_section_and_valid_keys(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[rounds]\ninner_step = 5\n")
    assert "unknown key 'inner_step'" in message and "[rounds]" in message
    for field in dataclasses.fields(RoundConfig):
        assert repr(field.name) in message
    assert str(tmp_path / "run.toml") in message  # says which file


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('seed = "1"\n', "seed"),
        ('[rounds]\ninner_steps = "10"\n', "inner_steps"),
        ("[rounds]\ninner_steps = true\n", "inner_steps"),
        ("[rounds]\ninner_steps = 10.0\n", "inner_steps"),
        ("[rounds]\nmax_rounds = 2.5\n", "max_rounds"),
        ('[rounds]\nmax_rounds = "3"\n', "max_rounds"),
        ("[rounds]\nmin_peers = false\n", "min_peers"),
        ("[rounds]\ncodec = 16\n", "codec"),
        ("[model]\ncontext = 64.5\n", "context"),
        ('[model]\npreset = ["tiny"]\n', "preset"),
        ('[inner]\nlr = "fast"\n', "lr"),
        ("[inner]\nlr = true\n", "lr"),
        ("[outer]\nnesterov = 1\n", "nesterov"),
        ('[outer]\nnesterov = "yes"\n', "nesterov"),
        ("[data]\nmax_bytes = 1e6\n", "max_bytes"),
        ("seed = { value = 1 }\n", "seed"),
    ],
)
def test_a_value_of_the_wrong_type_is_named(tmp_path: Path, text: str, key: str) -> None:
    message = load_error(tmp_path, text)
    assert f"{key} in " in message and "wrong type" in message


def test_a_section_that_is_not_a_table_is_named(tmp_path: Path) -> None:
    message = load_error(tmp_path, 'model = "tiny"\n')
    assert "[model] must be a table" in message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[inner]\nlr = -0.1\n", "[inner] lr must be positive"),
        ("[inner]\nlr = 0\n", "[inner] lr must be positive"),
        ("[outer]\nlr = -1.0\n", "[outer] lr must be positive"),
        ("[outer]\nmomentum = 1.0\n", "[outer] momentum"),
        ('[model]\npreset = "huge"\n', "preset 'huge' is unknown"),
        ("[model]\ncontext = 4\n", "context must be at least 8"),
        ("[model]\ndropout = 1.0\n", "dropout"),
        ('[rounds]\ncodec = "int3"\n', "codec 'int3' is unknown"),
        ('[inner]\nsharding = "zero"\n', "sharding 'zero' is unknown; choose one of ['ddp', 'fsdp']"),
        ("[rounds]\ninner_steps = 0\n", "inner_steps must be at least 1"),
        ("[rounds]\nmax_rounds = 0\n", "max_rounds must be at least 1"),
        ("[rounds]\nmin_peers = 0\n", "min_peers must be at least 1"),
        ("[rounds]\nexchange_timeout_s = 0\n", "exchange_timeout_s must be positive"),
        ("[data]\nseq_len = 0\n", "seq_len must be a positive integer"),
        ("[data]\neval_fraction = 0.5\n", "eval_fraction"),
        ("[data]\nmax_bytes = 10\n", "max_bytes must be at least"),
        ('[data]\nsource = "/nonexistent/corpus"\n', "does not exist"),
    ],
)
def test_a_bad_value_is_rejected_with_what_to_fix(tmp_path: Path, text: str, words: str) -> None:
    assert words in load_error(tmp_path, text)


def test_unknown_choices_list_the_valid_ones(tmp_path: Path) -> None:
    assert "'fp16'" in load_error(tmp_path, '[rounds]\ncodec = "int3"\n')
    assert "'tiny'" in load_error(tmp_path, '[model]\npreset = "huge"\n')


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, "[rounds\ninner_steps = 5\n")
    assert "not valid TOML" in message and "run.toml" in message


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as failure:
        load_run_config(missing)
    assert str(missing) in str(failure.value)


@pytest.mark.parametrize(
    "config",
    [
        RunConfig(),
        RunConfig(
            seed=7,
            model=ModelConfig(preset="small", context=64, dropout=0.25),
            data=DataConfig(seq_len=32, max_bytes=None, eval_fraction=0.125),
            inner=InnerOptConfig(lr=1e-4, warmup_steps=3),
            outer=OuterOptConfig(lr=0.5, nesterov=False),
            rounds=RoundConfig(inner_steps=3, max_rounds=9, codec="fp16", round_timeout_s=1.5),
        ),
    ],
)
def test_the_json_run_spec_round_trips(config: RunConfig) -> None:
    again = RunConfig.from_json(config.to_json())
    assert again == config
    assert again.to_json() == config.to_json()


def test_a_bad_json_run_spec_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown key 'extra'"):
        RunConfig.from_json('{"extra": 1}')
    with pytest.raises(ConfigError, match="inner_steps must be at least 1"):
        RunConfig.from_json('{"rounds": {"inner_steps": 0}}')


def test_the_valid_names_are_the_implemented_ones() -> None:
    # The config is a leaf and lists the names itself; swarm.core implements them.
    from swarm.core.codecs.codec import CODECS
    from swarm.core.fragments import PATTERNS, fragments

    assert len(set(CODEC_NAMES)) == len(CODEC_NAMES) and set(CODEC_NAMES) == set(CODECS)
    assert list(FRAGMENT_PATTERNS) == list(PATTERNS)
    shapes = [torch.Size([100])] + [torch.Size([10])] * 3  # sizes on which every pattern deals differently
    dealt = {pattern: fragments(shapes, 2, pattern) for pattern in FRAGMENT_PATTERNS}
    assert len({str(groups) for groups in dealt.values()}) == len(FRAGMENT_PATTERNS)  # no name is an alias
    with pytest.raises(ValueError, match="fragment pattern 'random' is unknown"):
        fragments(shapes, 2, "random")


@pytest.mark.parametrize(
    "text, words",
    [
        ("[rounds]\ninner_steps = 9223372036854775807\n", "[rounds] inner_steps must be a finite number"),
        ("[rounds]\nround_timeout_s = inf\n", "[rounds] round_timeout_s must be a finite number"),
        ("[rounds]\nexchange_timeout_s = nan\n", "[rounds] exchange_timeout_s must be positive"),
        ("[rounds]\nmax_rounds = 9223372036854775807\n", "[rounds] max_rounds must be a finite number"),
        ("[rounds]\nmin_peers = 1000000000\n", "[rounds] min_peers must be a finite number"),
        ("[outer]\nlr = inf\n", "[outer] lr must be a finite number"),
        ("[inner]\nlr = inf\n", "[inner] lr must be a finite number"),
        ("[inner]\ngrad_clip = inf\n", "[inner] grad_clip must be a finite number"),
        ("[data]\nbatch_size = 100000000\n", "[data] batch_size must be a finite number"),
        ("[data]\nseq_len = 100000000\n", "[data] seq_len must be a finite number"),
        ("[model]\ncontext = 100000000\n", "[model] context must be a finite number"),
        ('[outer]\nname = "AdamW"\n[outer.options]\neps = inf\n', "[outer.options] eps must be a finite number"),
        ("seed = -1\n", "seed must be a finite number"),
    ],
)
def test_numbers_must_be_finite_and_in_range(tmp_path, text: str, words: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert words in str(info.value)


def test_a_config_path_that_is_a_directory_unreadable_or_not_utf8_gets_one_sentence(tmp_path) -> None:
    import os

    with pytest.raises(ConfigError, match="is a directory"):
        load_run_config(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"# caf\xe9\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_run_config(latin1)
    locked = tmp_path / "locked.toml"
    locked.write_text("seed = 1\n")
    locked.chmod(0)
    if os.access(locked, os.R_OK):
        pytest.skip("running as root: permissions do not stop reading")
    with pytest.raises(ConfigError, match="cannot be read"):
        load_run_config(locked)
