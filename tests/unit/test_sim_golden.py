"""Golden numbers of small simulated runs (2 peers, 3 rounds): any change to the algorithm's bits shows
up here. The "diloco_fp32" scenario holds the numbers the simulator computed before codecs, fragments
and outer optimizers existed; the real-swarm integration test compares a swarm against that path.

Regenerate after a deliberate change, and say why in the commit:

    SWARM_REGEN_GOLDEN=1 python -m pytest tests/unit/test_sim_golden.py

The bits of training depend on torch's CPU kernels, so the fixture records the torch version and the
CPU capability it was made with; elsewhere the test skips instead of failing.
"""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from swarm.config import DataConfig, InnerOptConfig, ModelConfig, OuterOptConfig, RoundConfig, RunConfig
from swarm.train.simulator.sim import simulate

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

GOLDEN = Path(__file__).parent / "golden" / "sim_2peers_3rounds.json"

BASE = RunConfig(
    seed=0,
    model=ModelConfig(preset="tiny"),
    data=DataConfig(max_bytes=1_000_000, num_shards=4, batch_size=8, seq_len=64, eval_batches=2),
    inner=InnerOptConfig(warmup_steps=5),
    rounds=RoundConfig(inner_steps=10),
)

SCENARIOS = {
    # The defaults: fp32, Nesterov, one fragment, no overlap, equal peers.
    "diloco_fp32": (BASE, {}),
    # Streaming DiLoCo: int4 with error feedback, 2 strided fragments, 1 step of overlap.
    "streaming_int4_ef_overlap": (
        BASE.replace(rounds=RoundConfig(inner_steps=6, codec="int4", fragments=2, overlap_steps=1)),
        {},
    ),
    # AdamW outer optimizer, int8, a half-speed peer.
    "adamw_int8_half_speed": (
        BASE.replace(
            rounds=RoundConfig(inner_steps=6, codec="int8"),
            outer=OuterOptConfig(name="AdamW", lr=0.01, options={"betas": [0.9, 0.95]}),
        ),
        {"speeds": [1.0, 0.5]},
    ),
}


def _environment() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _numbers(run: RunConfig, kwargs: dict) -> dict:
    result = simulate(run.validate(), peers=2, rounds=3, **kwargs)
    assert result.consistent
    return {
        "config": run.to_dict(),
        "simulate_kwargs": kwargs,
        "initial_hash": result.initial_hash,
        "initial_eval_loss": result.initial_eval_loss,
        "rounds": [
            {
                "round": r.round,
                "fragment": r.fragment,
                "state_hash": r.state_hash,
                "train_loss": r.train_loss,
                "eval_loss": r.eval_loss,
                "steps": r.steps,
                "bytes_sent": r.bytes_sent,
            }
            for r in result.rounds
        ],
    }


def _as_recorded(config: dict, recorded: dict) -> dict:
    """``config`` without the fields added after the fixture was made, where they hold their defaults
    (a field added at its default changes no bits; one set otherwise stays and fails the comparison)."""
    defaults = RunConfig().to_dict()
    return {
        section: {
            k: v for k, v in values.items() if k in recorded.get(section, {}) or v != defaults[section].get(k, object())
        }
        if isinstance(values, dict) and isinstance(recorded.get(section), dict)
        else values
        for section, values in config.items()
        if section in recorded or values != defaults.get(section)  # a section added at its defaults
    }


def test_simulated_runs_reproduce_the_golden_numbers():
    if os.environ.get("SWARM_REGEN_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        data = {
            "environment": _environment(),
            "scenarios": {name: _numbers(run, kwargs) for name, (run, kwargs) in SCENARIOS.items()},
        }
        GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"regenerated {GOLDEN}")
    golden = json.loads(GOLDEN.read_text())
    if golden["environment"] != _environment():
        pytest.skip(f"golden numbers were made with {golden['environment']}, this is {_environment()}")
    assert sorted(golden["scenarios"]) == sorted(SCENARIOS)
    for name, (run, kwargs) in SCENARIOS.items():
        expected = golden["scenarios"][name]
        assert expected["config"] == _as_recorded(run.to_dict(), expected["config"]), (
            f"{name}: the scenario changed; regenerate the fixture"
        )
        got = _numbers(run, kwargs)
        got["config"] = _as_recorded(got["config"], expected["config"])
        # JSON floats round-trip exactly, so this compares every loss to the last bit.
        assert json.loads(json.dumps(got)) == expected, name


def test_the_golden_defaults_are_plain_diloco():
    # The first scenario must stay the defaults the integration test and earlier releases use.
    run, kwargs = SCENARIOS["diloco_fp32"]
    defaults = RoundConfig()
    assert kwargs == {} and run.outer == OuterOptConfig()
    assert dataclasses.replace(run.rounds, inner_steps=defaults.inner_steps) == defaults
