"""The round's plan (swarm.train.round_plan): the controller's choice wins, the run's config otherwise, a choice
this peer cannot run is answered in one sentence, and the plan the runner makes is the one the exchange, error
feedback and the log read; what a real swarm may run is decided in one place (RoundConfig.check_real_swarm)."""

from __future__ import annotations

import hashlib

import pytest

from swarm.config import ConfigError, DataConfig, InnerOptConfig, ModelConfig, RoundConfig, RunConfig
from swarm.core.fragments import round_fragment, round_steps
from swarm.train.round import Averaged, Decision, InlineExecutor, Outcome, RoundRunner
from swarm.train.round_plan import PlanRefused, RoundPlan, plan_round
from swarm.train.trainer import LocalTrainer
from swarm.v1 import coordinator_pb2 as pb

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

STREAMING = RoundConfig(inner_steps=10, fragments=2, overlap_steps=2, codec="int4", controller="auto")


def one_sentence(text: str) -> bool:
    return text.endswith(".") and ". " not in text and "\n" not in text


def test_without_a_choice_the_plan_is_the_runs_config() -> None:
    for round_no in range(1, 6):
        plan = plan_round(STREAMING, round_no)
        assert plan == RoundPlan(
            round_no=round_no,
            fragment=round_fragment(round_no, 2),
            codec="int4",
            inner_steps=10,
            steps=round_steps(round_no, 10, 2),
            overlap_steps=2,
        )
        assert not plan.chosen and plan.shares_of(["a", "b"]) is None


def test_the_controllers_choice_wins() -> None:
    choice = pb.RoundChoice(codec="fp16", shares={"b": 3.0, "a": 1.0}, inner_steps=40, fragments=2, round=3)
    plan = plan_round(STREAMING, 3, choice)
    assert (plan.codec, plan.fragment, plan.inner_steps, plan.steps) == ("fp16", 0, 40, 20)
    assert plan.chosen and plan.shares == (("a", 1.0), ("b", 3.0))
    # the digest the group entry carries: members whose plans differ do not exchange
    assert plan.digest == hashlib.sha256(b"fp16|a=1.0,b=3.0").hexdigest()[:16]
    assert plan.digest != plan_round(STREAMING, 3, pb.RoundChoice(codec="int8", shares=choice.shares)).digest
    # a member the choice does not list (admitted late) gets the listed members' mean share
    assert plan.shares_of(["b", "late", "a"]) == [3.0, 2.0, 1.0]


def test_a_choice_without_a_codec_keeps_the_runs_codec_and_equal_slices() -> None:
    plan = plan_round(STREAMING, 1, pb.RoundChoice(inner_steps=5, fragments=2))
    assert (plan.codec, plan.inner_steps, plan.steps) == ("int4", 10, 5)  # a shorter H than the run's: the run's
    assert plan.chosen and plan.shares_of(["a"]) is None


def test_a_choice_this_peer_cannot_run_is_refused_in_one_sentence() -> None:
    with pytest.raises(PlanRefused, match="chose codec 'zstd9' for round 2, which this peer does not know") as unknown:
        plan_round(STREAMING, 2, pb.RoundChoice(codec="zstd9"))
    with pytest.raises(PlanRefused, match="chose codec 'lowrank4-fp16'"):  # the controller never chooses it
        plan_round(STREAMING, 2, pb.RoundChoice(codec="lowrank4-fp16"))
    with pytest.raises(PlanRefused, match="shares for round 4 .* are not all positive") as shares:
        plan_round(STREAMING, 4, pb.RoundChoice(codec="int8", shares={"a": 1.0, "b": 0.0}))
    assert one_sentence(str(unknown.value)) and one_sentence(str(shares.value))


def test_a_real_swarm_refuses_a_simulator_only_codec_in_one_sentence_and_the_simulator_plans_it() -> None:
    rounds = RoundConfig(codec="lowrank4-fp16", aggregation="mean")
    rounds.validate()  # a valid run: the simulator runs it
    assert plan_round(rounds, 1).codec == "lowrank4-fp16"
    with pytest.raises(ConfigError, match="runs only in the simulator so far") as refused:
        rounds.check_real_swarm()
    assert "\n" not in str(refused.value) and str(refused.value).endswith(".")
    for codec in ("fp32", "int4", "sign", "ternary@0.1", "topk-int4"):
        RoundConfig(codec=codec).check_real_swarm()


def test_the_coordinator_refuses_a_simulator_only_codec_before_it_starts(tmp_path, capsys) -> None:
    from swarm.app.cli import main

    config = tmp_path / "run.toml"
    config.write_text('[rounds]\ncodec = "lowrank4-fp16"\n')
    assert main(["coordinator", "--config", str(config), "--state-dir", str(tmp_path / "state")]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("swarm coordinator: [rounds] codec lowrank4-fp16 runs only in the simulator so far")
    assert "\n" not in said and not (tmp_path / "state").exists()


class OneMemberGroup:
    """A group of this peer alone that decides its rounds by its vote (the coordinator's side too: ``choice`` gives
    the controller's choice of a round, and ``asked`` the rounds it was asked for); it keeps the plans it saw."""

    def __init__(self, choice) -> None:
        self.plans: list[RoundPlan] = []
        self.choice, self.asked = choice, []

    def round_choice(self, round_no):
        self.asked.append(round_no)
        return self.choice(round_no)

    def average(self, round_no, contribution) -> Averaged:
        self.plans.append(contribution.plan)
        return Averaged(average=contribution.delta.clone(), group=["a"])

    def post(self, vote) -> None:
        pass

    def decide(self, vote) -> Decision:
        return Decision(vote.round_no, vote.state_hash if vote.ok else None)

    def still_planned(self, round_no) -> bool:
        return True

    def save_vote(self, state) -> None:
        pass

    def committed(self, state, *, provisional) -> None:
        pass

    def voided(self, round_no, *, provisional) -> None:
        pass


def run_rounds(rounds: RoundConfig, choice, count: int = 2):
    run = RunConfig(
        seed=0,
        model=ModelConfig(preset="tiny"),
        inner=InnerOptConfig(warmup_steps=1),
        data=DataConfig(max_bytes=200_000, num_shards=2, batch_size=2, seq_len=32, eval_batches=1),
        rounds=rounds,
    ).validate()
    trainer, group = LocalTrainer(run, peer_index=0), OneMemberGroup(choice)
    runner = RoundRunner(
        trainer, run, exchange=group, votes=group, decider=group, store=group, executor=InlineExecutor(), evaluate=False
    )
    outcomes = [runner.run_round(r).outcome for r in range(1, count + 1)]
    return outcomes, group.plans, group.asked, trainer


def test_the_runner_makes_each_rounds_plan_once_and_error_feedback_keeps_what_its_codec_dropped() -> None:
    rounds = RoundConfig(inner_steps=2, codec="fp32", controller="auto")
    outcomes, plans, asked, trainer = run_rounds(rounds, lambda r: pb.RoundChoice(codec="int4") if r == 2 else None)
    assert outcomes == [Outcome.COMMITTED] * 2 and asked == [1, 2]
    assert [p.codec for p in plans] == ["fp32", "int4"] and [p.round_no for p in plans] == [1, 2]
    assert trainer.error_feedback[0].residual.abs().sum() > 0  # int4 dropped something; fp32 would not


def test_with_the_controller_off_the_runner_asks_no_choice_and_a_refused_one_fails_the_exchange() -> None:
    _, plans, asked, _ = run_rounds(RoundConfig(inner_steps=2, codec="int8"), lambda r: pb.RoundChoice(codec="fp16"))
    assert asked == [] and [p.codec for p in plans] == ["int8", "int8"]
    rounds = RoundConfig(inner_steps=2, codec="fp32", controller="auto")
    outcomes, plans, _, trainer = run_rounds(rounds, lambda r: pb.RoundChoice(codec="zstd9"), count=1)
    assert outcomes == [Outcome.VOIDED] and plans == []  # its vote failed: the exchange never ran
    assert trainer.round_no == 0
