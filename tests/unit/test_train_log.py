"""Training logs ([logging] tensorboard / wandb): a small run's peers and coordinator write curves that
TensorBoard's own event reader (and W&B's offline run files) show; a peer logs one readable line per round;
a writer that is not installed is skipped with one warning."""

from __future__ import annotations

import builtins
import dataclasses
import logging
import math
from pathlib import Path

import pytest

from coordinator.store.history import History
from coordinator.store.records import COMMITTED, VOIDED, RoundRecord
from coordinator.store.run_log import RunLog
from peer.report.round_log import RoundLog
from swarm.config import ConfigError, LoggingConfig, RoundConfig, RunConfig, WandbConfig, load_run_config
from swarm.train.contribution import Contribution, TrainStats
from swarm.train.round import Averaged, Decision, Outcome, RoundResult, Vote
from swarm.train.round_plan import RoundPlan, plan_round
from swarm.train.train_log import TrainLog, log_dir_name, open_train_log
from swarm.v1 import coordinator_pb2 as pb
from tests.unit.test_peer_lifecycle import RUN, finish, start, swarm

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag under ``log_dir`` as (step, value) pairs, read with TensorBoard's event reader."""
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    events = accumulator.EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


class Recorder:
    def __init__(self) -> None:
        self.written: list[tuple[int, dict]] = []
        self.closed = False

    def write(self, step, values) -> None:
        self.written.append((step, dict(values)))

    def close(self) -> None:
        self.closed = True


# ---- the config ---------------------------------------------------------------------------------------------


def test_the_logging_section_loads_and_bad_values_get_one_sentence(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('[logging]\ntensorboard = "tb"\nwandb = { project = "swarm-demo", mode = "offline" }\n')
    assert load_run_config(path).logging == LoggingConfig(tensorboard="tb", wandb=WandbConfig(project="swarm-demo"))
    assert RunConfig().logging == LoggingConfig() and not RunConfig().logging.wandb.project  # off by default
    for text, words in [
        ('wandb = { project = "p", mode = "cloud" }', "wandb mode 'cloud' is unknown; choose one of"),
        ('wandb = { mode = "online" }', "wandb needs a project"),
        ('wandb = { project = "a b/c" }', "wandb project must be"),
        ('wandb = { project = "p", colour = 1 }', "unknown key 'colour' in [logging.wandb]"),
        ("tensorboard = 3", "tensorboard in [logging] has the wrong type"),
        ('tensorboard = " "', "[logging] tensorboard must be a directory path"),
    ]:
        path.write_text(f"[logging]\n{text}\n")
        with pytest.raises(ConfigError) as failure:
            load_run_config(path)
        assert words in str(failure.value) and "\n" not in str(failure.value), text
    spec = RunConfig(logging=LoggingConfig(tensorboard="/runs/tb"))
    assert RunConfig.from_json(spec.to_json()) == spec  # the peers get it in the run spec


# ---- the writers --------------------------------------------------------------------------------------------


def test_a_writer_that_is_not_installed_is_skipped_with_one_warning(monkeypatch, caplog, tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_writers(name, *args, **kwargs):
        if name in ("torch.utils.tensorboard", "wandb"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_writers)
    config = LoggingConfig(tensorboard=str(tmp_path / "tb"), wandb=WandbConfig(project="p"))
    with caplog.at_level(logging.WARNING, logger="swarm.train.train_log"):
        log = open_train_log(config, name="peer-a")
    log.log(1, {"train/loss": 2.0})  # logs nothing, raises nothing
    log.close()
    assert not log.on
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("\n" not in w for w in warnings)
    assert "pip install 'swarm-train[tensorboard]'" in warnings[0] and "swarm-train[wandb]" in warnings[1]


def test_nan_values_are_left_out_and_a_failing_writer_is_dropped(caplog) -> None:
    class Broken(Recorder):
        def write(self, step, values) -> None:
            raise OSError("disk full")

    good = Recorder()
    log = TrainLog([Broken(), good])
    log.log(1, {"train/loss": 2.0, "link/rtt_ms": math.nan, "eval/loss": None})
    log.log(2, {"train/loss": 1.5})
    assert good.written == [(1, {"train/loss": 2.0}), (2, {"train/loss": 1.5})]
    assert any("disk full" in r.getMessage() for r in caplog.records)
    assert log_dir_name("../../etc/x y") == "_.._etc_x_y" and log_dir_name("..") == "unnamed"


def test_tensorboard_events_are_readable_by_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    log = open_train_log(LoggingConfig(tensorboard=str(tmp_path / "tb")), name="peer a")
    assert log.on
    log.log(1, {"train/loss": 3.0})
    log.log(2, {"train/loss": 2.5, "eval/loss": 2.75})
    assert scalars(tmp_path / "tb" / "peer_a") == {"train/loss": [(1, 3.0), (2, 2.5)], "eval/loss": [(2, 2.75)]}
    log.close()


def test_wandb_offline_writes_its_run_files(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = LoggingConfig(wandb=WandbConfig(project="swarm-test", dir=str(tmp_path / "wandb")))
    log = open_train_log(config, name="coordinator", group="run-1")
    assert log.on
    log.log(1, {"train/loss": 3.0})
    log.log(0, {"eval/loss": 3.2})  # a late evaluation of an earlier round still lands
    log.close()
    runs = list((tmp_path / "wandb" / "coordinator").rglob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").rglob("*"))


# ---- the peer's round line and scalars ----------------------------------------------------------------------


def _int8_chosen(round_no: int) -> RoundPlan:
    """The plan of a round of an fp32 run whose controller chose int8: the log names the codec it was sent with."""
    return plan_round(RoundConfig(codec="fp32", controller="auto"), round_no, pb.RoundChoice(codec="int8"))


def _vote(round_no: int, *, ok: bool = True) -> Vote:
    train = TrainStats(steps=50, samples=400, tokens=51_200, mean_loss=2.3456, inner_time_s=4.0)
    averaged = (
        Averaged(
            average=None,
            group=["a", "b"],
            bytes_sent=1_500_000,
            bytes_received=1_400_000,
            seconds=0.84,
            upload_mbit_s=90.0,
            download_mbit_s=math.nan,
            rtt_ms=12.0,
        )
        if ok
        else None
    )
    return Vote(
        round_no=round_no,
        fragment=0,
        ok=ok,
        state_hash="ab12" if ok else "",
        group=["a", "b"],
        contribution=Contribution(fragment=0, delta=None, samples=400, plan=_int8_chosen(round_no)),
        train=train,
        averaged=averaged,
        error="" if ok else "round 3: the group did not form",
    )


def test_a_peer_logs_one_readable_line_per_round_and_its_scalars(caplog) -> None:
    recorder = Recorder()
    log = RoundLog(TrainLog([recorder]), tag=lambda r: f"[peer-a r{r}]" if r is not None else "[peer-a]")
    with caplog.at_level(logging.INFO, logger="peer.round_hooks"):
        for round_no, ok in ((2, True), (3, False)):
            vote = _vote(round_no, ok=ok)
            log.trained(round_no, vote.train, lr=3e-3)
            log.voted(vote)
            if ok:
                log.evaluated(round_no, 2.1)
            outcome = Outcome.COMMITTED if ok else Outcome.VOIDED
            log.decided(
                RoundResult(
                    round_no,
                    outcome,
                    Decision(round_no, "ab12" if ok else None),
                    overhead_s=1.25 if ok else 0.0,
                    eval_s=0.5 if ok else 0.0,
                )
            )
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "[peer-a r2] committed, hash ab12: 50 steps, loss 2.3456, 12,800 tokens/s; sent 1.5 MB, received 1.4 MB,"
        " exchange 0.84 s; codec int8; local work 1.25 s; eval loss 2.1000",
        "[peer-a r3] voided by the coordinator (this round's work carries into the next): 50 steps, loss 2.3456,"
        " 12,800 tokens/s; codec int8; exchange failed: round 3: the group did not form",
    ]
    assert caplog.records[1].levelno == logging.WARNING
    steps = {step: values for step, values in recorder.written if "round/committed" in values}
    assert steps[2] == {
        "round/committed": 1.0,
        "round/waited_s": 0.0,
        "train/lr": 3e-3,
        "train/loss": 2.3456,
        "train/steps": 50.0,
        "train/tokens_per_s": 12_800.0,
        "train/step_time_s": 0.08,
        "exchange/bytes_sent": 1.5e6,
        "exchange/bytes_received": 1.4e6,
        "exchange/seconds": 0.84,
        "link/upload_mbit_s": 90.0,
        "link/rtt_ms": 12.0,
        "round/overhead_s": 1.25,
        "round/eval_s": 0.5,
    }
    assert steps[3]["round/committed"] == 0.0 and "exchange/seconds" not in steps[3]
    assert (2, {"eval/loss": 2.1}) in recorder.written


# ---- the coordinator's curves -------------------------------------------------------------------------------


class _Store:
    def put_history(self, row, peer_rows) -> None: ...

    def put_peer_history(self, peer_rows) -> None: ...

    def add_eval(self, round_number, peer_id, loss) -> None: ...


def test_the_coordinator_writes_one_eval_point_per_round_once_its_holders_evaluated() -> None:
    recorder = Recorder()
    run_log = RunLog(TrainLog([recorder]), committed=4, voided=1)  # a restarted coordinator keeps the totals
    history = run_log.history(_Store())
    config = RunConfig()
    for number, outcome in ((6, COMMITTED), (7, VOIDED), (8, COMMITTED)):
        row = RoundRecord(
            round=number,
            opened_at=0.0,
            outcome=outcome,
            participants=("a", "b"),
            holders=("a", "b") if outcome == COMMITTED else (),
            decided_at=1.0,
            committed_hash="h" if outcome == COMMITTED else "",
            choice='{"codec": "int4", "shares": {}}',
        )
        history.record_round(row, [], {}, config, ddp_equivalent_bytes=10)
        if number == 6:
            history.record_eval("a", 6, 2.0)
            history.record_eval("a", 6, 2.0)  # a heartbeat repeating it
            assert not any("eval/loss" in v for _, v in recorder.written)  # b has not evaluated it yet
            history.record_eval("b", 6, 3.0)
        if number == 8:
            history.record_eval("a", 8, 1.0)  # b never does: written when the run's log closes
    run_log.close()
    rounds = {step: v for step, v in recorder.written if "rounds/committed_total" in v}
    assert [(s, v["rounds/committed_total"], v["rounds/voided_total"]) for s, v in rounds.items()] == [
        (6, 5.0, 1.0),
        (7, 5.0, 2.0),
        (8, 6.0, 2.0),
    ]
    assert rounds[7]["controller/codec_bits"] == 4.0 and rounds[6]["round/participants"] == 2.0
    evals = [(step, v["eval/loss"], v["eval/peers"]) for step, v in recorder.written if "eval/loss" in v]
    assert evals == [(6, 2.5, 2.0), (8, 1.0, 1.0)] and recorder.closed
    assert type(RunLog(TrainLog([])).history(_Store())) is History  # logging off: the plain history


# ---- a whole small run --------------------------------------------------------------------------------------


def test_a_run_with_tensorboard_on_leaves_curves_for_every_peer_and_the_coordinator(tmp_path: Path, caplog) -> None:
    pytest.importorskip("tensorboard")
    tb = tmp_path / "tb"
    run = dataclasses.replace(
        RUN, rounds=dataclasses.replace(RUN.rounds, eval_every_rounds=1), logging=LoggingConfig(tensorboard=str(tb))
    )
    coordinator, parts = swarm(run)
    with caplog.at_level(logging.INFO, logger="peer.round_hooks"):
        a, b = start(parts, tmp_path, "a"), start(parts, tmp_path, "b")
        assert finish(a, b) == [0, 0]
    coordinator.engine.run_log.close()
    for name in ("a", "b"):
        peer = scalars(tb / name)
        assert [step for step, _ in peer["train/loss"]] == [1, 2, 3, 4], peer.keys()
        assert [step for step, _ in peer["eval/loss"]] == [0, 1, 2, 3, 4]
        assert {"train/lr", "train/tokens_per_s", "train/step_time_s", "exchange/bytes_sent"} <= set(peer)
        round_lines = [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith(f"[{_peer_id(a if name == 'a' else b)} r")
        ]
        assert len([line for line in round_lines if "committed, hash" in line]) == 4, round_lines
    run_curves = scalars(tb / "coordinator")
    assert run_curves["rounds/committed_total"][-1] == (4, 4.0)
    assert [step for step, _ in run_curves["eval/loss"]] == [0, 1, 2, 3, 4]
    assert {"run/utilization", "exchange/bytes_sent", "round/participants", "train/loss"} <= set(run_curves)


def _peer_id(peer) -> str:
    return peer.daemon_.peer_id
