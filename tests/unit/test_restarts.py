"""``swarm peer --max-restarts`` (peer/restarts.py): which ends of the peer process are restarted, how many
times, that nothing of a dead one is left behind, and that SIGTERM ends the supervision — each in a real
supervising process whose forked children end as the test tells them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from peer.restarts import peer_processes
from tests.integration.harness import poll

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]

# argv: a directory for the starts' traces, the ends of the 1st, 2nd, ... start (the last repeats), max restarts
SUPERVISED = """
import os, signal, subprocess, sys, time
from peer.restarts import supervise

trace, ends = sys.argv[1], sys.argv[2].split(",")

def run():
    starts = len(os.listdir(trace))
    with open(os.path.join(trace, f"start-{starts}"), "w") as f:
        f.write(str(os.getpid()))
    end = ends[min(starts, len(ends) - 1)]
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if end == "raise":
        raise RuntimeError("a bug in the peer")
    if end == "orphan":  # a child of its own (as the DHT process is), then killed: the child must not outlive it
        leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(trace, "leftover"), "w") as f:
            f.write(str(leftover.pid))
        os.kill(os.getpid(), signal.SIGKILL)
    if end == "wait":
        time.sleep(600)
    return int(end)

sys.exit(supervise(run, max_restarts=int(sys.argv[3]), preload=()))
"""


def supervise(tmp_path: Path, ends: str, max_restarts: int) -> subprocess.Popen:
    trace = tmp_path / "starts"
    trace.mkdir()
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, str(trace), ends, str(max_restarts)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stderr=subprocess.PIPE,
        text=True,
    )


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def starts(tmp_path: Path) -> int:
    return len([p for p in (tmp_path / "starts").iterdir() if p.name.startswith("start-")])


@pytest.mark.parametrize(
    "ends, max_restarts, code, started",
    [
        ("kill,raise,0", 2, 0, 3),  # killed, then an uncaught exception: both restarted; then it finished
        ("kill", 1, 1, 2),  # killed every time: one restart, then the supervisor gives up (exit 1)
        ("2", 5, 2, 1),  # refused or misconfigured: a restart would end the same way
        ("130", 5, 130, 1),  # interrupted
        ("0", 5, 0, 1),
    ],
)
def test_a_dead_peer_process_is_restarted_and_one_that_finished_or_was_refused_is_not(
    tmp_path: Path, ends: str, max_restarts: int, code: int, started: int
) -> None:
    proc = supervise(tmp_path, ends, max_restarts)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == code, stderr
    assert starts(tmp_path) == started
    assert stderr.count("starting it again") == started - 1
    if started > 1:
        assert "starting it again at once from its state dir (restart 1 of" in stderr  # the first: no wait
    if code == 1:
        assert "was killed by SIGKILL; it was restarted 1 times (--max-restarts), giving up" in stderr
    if "raise" in ends:
        assert "RuntimeError: a bug in the peer" in stderr  # the traceback is shown, then the restart


def test_a_peer_process_that_keeps_dying_at_once_is_restarted_after_growing_waits(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "kill,kill,kill,0", 5)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert starts(tmp_path) == 4
    assert [
        line.split("starting it again ")[1].split(" from")[0]
        for line in stderr.splitlines()
        if "starting it again" in line
    ] == ["at once", "in 1s", "in 2s"]  # peer/restarts.py backoff_s
    times = sorted((tmp_path / "starts" / f"start-{i}").stat().st_mtime for i in range(4))
    assert times[2] - times[1] >= 1.0 and times[3] - times[2] >= 2.0


def test_sigterm_during_a_wait_before_a_restart_ends_the_supervision_at_once(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "kill", 10)  # waits 0, 1, then 2 s before the 2nd, 3rd and 4th start
    poll(lambda: starts(tmp_path) == 3, timeout_s=20, what="the third start")
    third = int((tmp_path / "starts" / "start-2").read_text())
    # the third process has ended (killed itself): the supervisor is now in its 2 s wait, not forwarding the signal
    poll(lambda: _ended(third), timeout_s=20, what="the third start's end")
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert time.monotonic() - signalled < 1.9 and starts(tmp_path) == 3


def test_nothing_of_a_dead_peer_process_outlives_it(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "orphan,0", 1)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    leftover = int((tmp_path / "starts" / "leftover").read_text())
    assert not psutil.pid_exists(leftover) or psutil.Process(leftover).status() == psutil.STATUS_ZOMBIE


def test_sigterm_reaches_the_peer_and_ends_the_supervision(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "wait", 5)
    poll(lambda: starts(tmp_path) == 1, timeout_s=20, what="the first start")
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, stderr  # the child's end, passed on: not restarted
    assert starts(tmp_path) == 1


def test_kill_9_of_the_supervisor_ends_the_peer_process_too(tmp_path: Path) -> None:
    proc = supervise(tmp_path, "wait", 5)
    poll(lambda: starts(tmp_path) == 1, timeout_s=20, what="the first start")
    child = psutil.Process(int((tmp_path / "starts" / "start-0").read_text()))
    assert peer_processes(proc.pid) == [child.pid]  # what the soaks and benchmarks kill
    proc.kill()
    proc.wait(timeout=10)
    # the parent-death signal (peer/restarts.py): the orphan is re-parented to this test process (a subreaper)
    # or init, and dies
    psutil.wait_procs([child], timeout=10)
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def test_a_supervised_peer_that_cannot_start_says_why_once_and_is_not_restarted(tmp_path: Path) -> None:
    join = "swarm://127.0.0.1:1?token=t&fp=" + "ab" * 32
    if torch_sees_cuda():
        pytest.skip("this machine has a CUDA device: --device cuda is not a mistake here")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarm.app.cli",
            "peer",
            "--join",
            join,
            "--device",
            "cuda",
            "--max-restarts",
            "3",
            "--state-dir",
            str(tmp_path / "peer"),
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("torch sees no CUDA device; use --device cpu.") == 1
    assert "starting it again" not in result.stderr and "Traceback" not in result.stderr


def test_under_torchrun_max_restarts_is_refused_with_the_fix(monkeypatch, capsys) -> None:
    from swarm.app.cli import main

    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["peer", "--join", "swarm://127.0.0.1:1?token=t&fp=" + "ab" * 32, "--max-restarts", "2"]) == 2
    assert "under torchrun, use torchrun's own instead." in capsys.readouterr().err


def torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
