"""What a new user trips on, in one process: each mistake gets one sentence that says what to do, and the peer says
what it is waiting for. The same mistakes with real processes are in tests/integration/test_user_mistakes.py."""

from __future__ import annotations

import argparse
import logging
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from peer.faults import FaultPlan
from peer.link.coordinator_link import CoordinatorLink
from peer.link.retry import with_retry
from swarm.app.cli import _run_config, main
from swarm.app.cli_parser import build_parser
from swarm.config import RoundConfig, RunConfig
from swarm.control.client import CoordinatorClient, CoordinatorUnreachable
from swarm.control.joinstring import JoinString
from swarm.core.trust.credential import PeerKey
from swarm.core.wire_protocol import PROTOCOL
from swarm.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)

FP = "ab" * 32


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_wrong_coordinator_port_retries_with_one_clean_sentence(caplog) -> None:
    """Not "...is running.; retrying": the client's sentence is a clause of the retry line."""
    port = _closed_port()
    client = CoordinatorClient(JoinString.parse(f"swarm://127.0.0.1:{port}?token=t&fp={FP}"), connect_timeout_s=5)
    caplog.set_level(logging.INFO, logger="peer.link.retry")
    try:  # two tries half a second apart, then it gives up: one retry line
        assert (
            with_retry(lambda: client.get_round("p"), what="join", stop=threading.Event(), give_up_after_s=0.1) is None
        )
    finally:
        client.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "peer.link.retry"]
    assert lines == [
        f"join: cannot reach the coordinator at 127.0.0.1:{port} (connection refused); check the "
        "address and that the coordinator is running; retrying in 0.5s"
    ]


def test_a_stopped_peer_does_not_announce_a_retry(caplog) -> None:
    """A peer whose start failed for another reason stops its DHT start: that is no retry to announce."""
    stop = threading.Event()

    def call():
        stop.set()  # the peer stops while this try runs
        raise CoordinatorUnreachable("cannot reach the coordinator (connection refused).")

    caplog.set_level(logging.INFO, logger="peer.link.retry")
    assert with_retry(call, what="DHT start", stop=stop) is None
    assert [r.getMessage() for r in caplog.records if r.name == "peer.link.retry"] == []


@pytest.mark.parametrize("device", ["gpu", "cuda0", "cuda:x", "CPU", "tpu:0"])
def test_a_device_torch_cannot_train_on_is_one_sentence_listing_the_forms(device: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["peer", "--join", f"swarm://127.0.0.1:1?token=t&fp={FP}", "--device", device])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"swarm: error: --device {device!r} is not a device torch can train on; give cpu, cuda (the first GPU), "
        "cuda:N (GPU N), mps (Apple silicon) or xpu[:N] (Intel GPUs)."
    )


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "mps", "xpu:0"])
def test_the_device_forms_torch_takes_pass(device: str) -> None:
    from swarm.app.flag_validation import validate_args

    args = build_parser().parse_args(["peer", "--join", f"swarm://127.0.0.1:1?token=t&fp={FP}", "--device", device])
    assert validate_args(args) is None


def test_command_line_overrides_count_before_the_config_is_checked(tmp_path: Path, capsys) -> None:
    """`--max-rounds 8` satisfies a decaying schedule that the TOML gives without max_rounds."""
    config = tmp_path / "run.toml"
    config.write_text('[inner]\nschedule = "cosine"\n\n[rounds]\ninner_steps = 7\n')
    parser = build_parser()
    run = _run_config(
        parser.parse_args(
            ["coordinator", "--config", str(config), "--max-rounds", "8", "--min-peers", "3", "--preset", "small"]
        )
    )
    assert (
        run.inner.schedule,
        run.rounds.max_rounds,
        run.rounds.min_peers,
        run.rounds.inner_steps,
        run.model.preset,
    ) == ("cosine", 8, 3, 7, "small")
    assert _run_config(parser.parse_args(["coordinator", "--max-rounds", "4"])) == RunConfig(
        rounds=RoundConfig(max_rounds=4)
    )
    # without it the sentence names both ways to give it
    assert main(["coordinator", "--config", str(config), "--state-dir", str(tmp_path / "c")]) == 2
    assert "set [rounds] max_rounds (or give --max-rounds)" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_version_is_the_installed_release(capsys) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"swarm {version('swarm-train')}"


def _subcommands(parser: argparse.ArgumentParser, prefix: str = ""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield f"{prefix}{name}", child
                yield from _subcommands(child, f"{prefix}{name} ")


def test_every_subcommand_s_help_shows_its_defaults_and_explains_every_option() -> None:
    subcommands = dict(_subcommands(build_parser()))
    assert {"coordinator", "peer", "demo", "status", "history", "dashboard", "export", "token create"} <= set(
        subcommands
    )
    for name, parser in subcommands.items():
        text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"swarm {name} {action.option_strings[0]} has no help text"
            default = action.default
            if default is not None and default is not False and default != "":
                assert "default" in " ".join(parser.formatter_class("swarm")._get_help_string(action).split()), (
                    f"swarm {name} --help does not show the default of {action.option_strings[0]}"
                )
        if name == "peer":
            assert "(default: cpu)" in text and "(default: 120.0)" in text
        if name == "demo":
            assert "how many peers to start on this machine (default: 3)" in text


class _WaitingClient:
    """A coordinator with one peer of a run that needs two: no round opens."""

    def __init__(self, run: RunConfig) -> None:
        self.run = run
        self.live = 1

    def join(self, **kwargs) -> pb.JoinResponse:
        return pb.JoinResponse(
            peer_id="p-1", run_id="r", run_spec_json=self.run.to_json(), protocol=PROTOCOL, session=1
        )

    def get_round(self, peer_id: str, round_no: int = 0) -> pb.RoundInfo:
        return pb.RoundInfo(round=0, live_peers=self.live)


def test_a_lone_peer_says_once_how_many_more_peers_round_1_waits_for(caplog) -> None:
    client = _WaitingClient(RunConfig(rounds=RoundConfig(min_peers=3)).validate())
    link = CoordinatorLink(
        client,
        stop=threading.Event(),
        faults=FaultPlan(),
        poll_s=0.1,
        leave_grace_s=1.0,
        tag=lambda round_no=None: "[p-1]",
    )
    options = SimpleNamespace(
        site="", device="cpu", name="n", join_timeout_s=5.0, join=SimpleNamespace(address="127.0.0.1:1")
    )
    link.join(options, key=PeerKey.generate(), libp2p=None)
    caplog.set_level(logging.INFO, logger="peer.link.round_plans")
    for live in (1, 1, 1, 2, 2, 3):
        client.live = live
        link.get_round(0)
    assert [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()] == [
        "[p-1] waiting for 2 more peers (min_peers = 3) before round 1 opens",
        "[p-1] waiting for 1 more peer (min_peers = 3) before round 1 opens",
    ]


def _finished_run(tmp_path: Path, *, rounds: int):
    """A coordinator's state dir whose run committed ``rounds`` rounds and finished (max_rounds = rounds)."""
    import dataclasses as dc

    from coordinator.engine import CoordinatorEngine
    from coordinator.store.database import Store
    from coordinator.store.records import COMMITTED, RoundRecord

    config = RunConfig(rounds=RoundConfig(max_rounds=rounds))
    engine = CoordinatorEngine(Store.in_dir(tmp_path), config=config)
    store = engine._store
    for number in range(1, rounds + 1):
        store.put_round(RoundRecord(round=number, outcome=COMMITTED, committed_hash=f"h{number}", opened_at=0.0))
    store.put_run(dc.replace(store.get_run(), finished_at=1.0))
    store.close()
    return config


def _engine(tmp_path: Path, config, **kwargs):
    from coordinator.engine import CoordinatorEngine
    from coordinator.store.database import Store

    return CoordinatorEngine(Store.in_dir(tmp_path), config=config, **kwargs)


def test_a_finished_run_restarted_with_a_larger_max_rounds_goes_on(tmp_path: Path) -> None:
    config = _finished_run(tmp_path, rounds=2)
    more = config.replace(rounds=RoundConfig(max_rounds=4))
    engine = _engine(tmp_path, more)  # --config with max_rounds raised, nothing else
    assert engine.config.rounds.max_rounds == 4 and not engine.run.finished
    engine._store.close()
    # without --config (the embedded default), --max-rounds alone extends it too
    engine = _engine(tmp_path, RunConfig(rounds=RoundConfig(max_rounds=6)), check_config=False, max_rounds=6)
    assert engine.config.rounds.max_rounds == 6 and not engine.run.finished
    engine._store.close()
    engine = _engine(tmp_path, RunConfig(), check_config=False)  # no --max-rounds: as stored
    assert engine.config.rounds.max_rounds == 6
    engine._store.close()


def test_a_restart_may_not_change_more_than_max_rounds_nor_go_below_the_committed_rounds(tmp_path: Path) -> None:
    from swarm.config import ConfigError

    config = _finished_run(tmp_path, rounds=3)
    other = config.replace(rounds=RoundConfig(max_rounds=5, min_peers=2))
    with pytest.raises(ConfigError, match=r"different config \(rounds.min_peers differs\)"):
        _engine(tmp_path, other)
    with pytest.raises(
        ConfigError,
        match=r"has committed 3 rounds already, more than max_rounds 2; give "
        r"--max-rounds 3 or more \(more extends the run\)\.",
    ):
        _engine(tmp_path, config.replace(rounds=RoundConfig(max_rounds=2)))
    engine = _engine(tmp_path, None)
    assert engine.config.rounds.max_rounds == 3 and engine.run.finished  # nothing changed
    engine._store.close()


def test_a_peer_evicted_for_another_model_is_told_to_use_the_run_s_model_code_not_to_restart() -> None:
    from coordinator import membership
    from coordinator.api.errors import PeerGone, StateMismatch
    from coordinator.store.records import PeerRecord, RunRecord

    run = RunRecord(
        run_id="r", token="t", run_spec_json="{}", created_at=0.0, model_fingerprint="fp", initial_hash="h0"
    )
    peer = PeerRecord(peer_id="p-1", peer_index=0, joined_at=0.0, last_seen=0.0, lease_expiry=10.0)
    beat = pb.HeartbeatRequest(peer_id="p-1", metrics=pb.PeerMetrics(model_fingerprint="other"))
    result = membership.apply_heartbeat(run, peer, beat, now=1.0, lease_s=10.0)
    assert isinstance(result.rejection, StateMismatch)
    assert str(result.rejection) == (
        "this peer's model (fingerprint other) does not match the run's (fp): this peer builds a different model "
        "than the run; use the run's [model] code (the same factory module, preset or hf_config) and the "
        "coordinator's Swarm release, then start the peer again."
    )
    with pytest.raises(PeerGone) as later:  # its next call
        membership.check_member("p-1", result.peer)
    assert str(later.value) == (
        "peer p-1 was evicted (it builds a different model than the run: model fingerprint other, the run's fp); use "
        "the run's [model] code (the same factory module, preset or hf_config) and the coordinator's Swarm release, "
        "then start the peer again."
    )
