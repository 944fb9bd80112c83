"""Real coordinator and peer processes on loopback, for the integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil
from testbed.processes import TWO_PEER_RUN, kill_family, read_join_string  # noqa: F401 (the tests import them from here)

from swarm.app.status import status_to_dict
from swarm.control.client import CoordinatorClient, CoordinatorError
from swarm.control.joinstring import JoinString
from tests.integration.cli_launcher import LaunchedCli, launch

ROOT = Path(__file__).resolve().parents[2]


def swarm_process(args: list[str], log: Path, *, stdout=None, cold: bool = False) -> LaunchedCli | subprocess.Popen:
    """``swarm *args`` (tests/integration/cli_launcher.py), its stderr and stdout appended to ``log``; with
    ``stdout=subprocess.PIPE`` its stdout goes to ``log``'s ``.stdout`` sibling instead, read by the
    returned process's ``stdout.readline()``. ``cold``: a fresh interpreter, as a user's shell starts it
    (for a test about what a start costs)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    if cold:
        return subprocess.Popen(
            [sys.executable, "-m", "swarm.app.cli", *args],
            stdout=stdout or open(log, "ab"),
            stderr=open(log, "ab"),
            env=env,
            cwd=ROOT,
        )
    out = log.with_suffix(".stdout") if stdout == subprocess.PIPE else log
    return launch(list(args), stdout=out, stderr=log, env=env, cwd=ROOT)


def poll(predicate: Callable[[], object], *, timeout_s: float, what: str, interval_s: float = 0.2):
    """Return predicate()'s first truthy value; fail with `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


@dataclass
class Swarm:
    """A coordinator plus peers started by a test, with their logs in one directory."""

    workdir: Path
    coordinator: Optional[LaunchedCli] = None
    join: str = ""
    peers: dict[str, LaunchedCli | subprocess.Popen] = field(default_factory=dict)
    _client: Optional[CoordinatorClient] = None

    def start_coordinator(self, *args: str, timeout_s: float = 60) -> str:
        self.coordinator = swarm_process(
            ["coordinator", "--state-dir", str(self.workdir / "coordinator"), *args],
            self.workdir / "coordinator.log",
            stdout=subprocess.PIPE,
        )
        self.join = read_join_string(self.coordinator, timeout_s=timeout_s, log=self.workdir / "coordinator.log")
        return self.join

    def start_peer(self, name: str, *args: str, cold: bool = False) -> LaunchedCli | subprocess.Popen:
        proc = swarm_process(
            [
                "peer",
                "--join",
                self.join,
                "--state-dir",
                str(self.workdir / name),
                "--threads",
                "1",
                "--name",
                name,
                *args,
            ],
            self.workdir / f"{name}.log",
            cold=cold,
        )
        self.peers[name] = proc
        return proc

    def status(self) -> Optional[dict]:
        if self._client is None:
            self._client = CoordinatorClient(JoinString.parse(self.join), request_timeout_s=5)
        try:
            return status_to_dict(self._client.get_status())
        except CoordinatorError:
            return None

    def wait_status(self, predicate: Callable[[dict], bool], *, timeout_s: float, what: str) -> dict:
        return poll(
            lambda: (lambda s: s if s and predicate(s) else None)(self.status()), timeout_s=timeout_s, what=what
        )

    def wait_peers(self, *, timeout_s: float) -> dict[str, int]:
        codes = {}
        for name, proc in self.peers.items():
            try:
                codes[name] = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"peer {name} did not exit; its threads:\n{self.stacks(name)}") from None
        return codes

    def stacks(self, name: str) -> str:
        """The end of ``name``'s log after it dumped every thread's stack (SIGUSR1: swarm.app.cli)."""
        before = len(self.log(name))
        self.peers[name].send_signal(signal.SIGUSR1)
        try:
            poll(lambda: "most recent call first" in self.log(name)[before:], timeout_s=10, what="the stack dump")
        except AssertionError:
            pass  # the log as it is
        return self.log(name)[-12000:]

    def final_model(self, name: str) -> Path:
        return self.workdir / name / "final" / "model.safetensors"

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill_coordinator(self) -> None:
        """kill -9: no shutdown, only what SQLite already holds survives."""
        self.coordinator.kill()
        self.coordinator.wait(timeout=30)
        self._client = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        for proc in [*self.peers.values(), self.coordinator]:
            if proc is not None and proc.poll() is None:
                # hivemind's DHT runs in a forked child (with its p2pd below it): killing only this process
                # would orphan them to init, out of reach of the conftest's reaper.
                try:
                    descendants = psutil.Process(proc.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    descendants = []
                proc.kill()
                proc.wait(timeout=10)
                for child in descendants:
                    try:
                        child.kill()
                    except psutil.NoSuchProcess:
                        pass
                psutil.wait_procs(descendants, timeout=5)
