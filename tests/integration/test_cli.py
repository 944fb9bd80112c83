"""The `swarm` command as a user runs it: exit codes and the one sentence it prints for each mistake."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.integration.harness import Swarm

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
# Port 9 (discard) on loopback: nothing listens there, so connecting is refused at once.
UNREACHABLE = "swarm://127.0.0.1:9?token=abc&fp=" + "0123456789abcdef" * 4


def swarm_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "swarm.app.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def user_error(result: subprocess.CompletedProcess) -> str:
    """The sentence a failed command printed; asserts it exited 2 without a traceback."""
    assert result.returncode == 2, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_a_garbage_join_string_is_named(tmp_path: Path) -> None:
    stderr = user_error(swarm_cli("peer", "--join", "garbage", "--state-dir", str(tmp_path / "peer")))
    assert "swarm peer: a join string starts with 'swarm://', got 'garbage'" in stderr
    assert "copy the join string exactly" in stderr


def test_status_of_an_unreachable_coordinator_says_so() -> None:
    stderr = user_error(swarm_cli("status", UNREACHABLE))
    assert "swarm status: cannot reach the coordinator at 127.0.0.1:9" in stderr
    assert "check the address and that the coordinator is running" in stderr


def test_a_peer_gives_up_on_an_unreachable_coordinator(tmp_path: Path) -> None:
    result = swarm_cli("peer", "--join", UNREACHABLE, "--join-timeout-s", "2", "--state-dir", str(tmp_path / "peer"))
    stderr = user_error(result)
    assert "could not reach the coordinator at 127.0.0.1:9" in stderr


def test_a_config_with_an_unknown_key_is_named(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[rounds]\ninner_steps = 5\ninner_stepz = 6\n")
    stderr = user_error(swarm_cli("coordinator", "--config", str(config), "--state-dir", str(tmp_path / "c")))
    assert "swarm coordinator:" in stderr and "unknown key 'inner_stepz' in [rounds]" in stderr
    assert "'inner_steps'" in stderr  # lists the valid keys
    assert not (tmp_path / "c").exists(), "nothing should start for a bad config"


def test_a_missing_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    stderr = user_error(swarm_cli("coordinator", "--config", str(missing), "--state-dir", str(tmp_path / "c")))
    assert str(missing) in stderr and "does not exist" in stderr


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Swarm]:
    swarm = Swarm(workdir=tmp_path_factory.mktemp("cli-coordinator"))
    try:
        swarm.start_coordinator("--max-rounds", "1")
        yield swarm
    finally:
        swarm.close()


def test_status_with_a_wrong_token_is_refused_and_the_coordinator_keeps_serving(coordinator: Swarm) -> None:
    wrong = coordinator.join.replace("token=", "token=x", 1)
    assert wrong != coordinator.join
    stderr = user_error(swarm_cli("status", wrong))
    assert "swarm status: the join token is not valid for this run" in stderr

    result = swarm_cli("status", coordinator.join, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["run"]["rounds_committed"] == 0
    assert status["totals"]["bytes_sent"] == 0
    assert coordinator.coordinator.poll() is None, coordinator.log("coordinator")


def test_status_json_is_one_object_with_run_peers_and_totals(coordinator: Swarm) -> None:
    result = swarm_cli("status", coordinator.join, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert set(status) == {"run", "peers", "totals", "peers_omitted"}
    assert status["peers"] == []
    assert status["run"]["max_rounds"] == 1
    assert status["run"]["finished"] is False
