"""A real swarm for one attack scenario: a coordinator and peers started with the CLI (``swarm coordinator``,
``swarm peer``, or an attacker's modified peer program), watched with a status token the way a user watches a run
(``swarm status``, ``swarm history``), and each peer's final model.

Every scenario counts a coordinator answer of INTERNAL (to a watcher or to an attacker's call) as a breach: the
target is that no stranger can make a call fail.
"""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import grpc
from chaos import final_eval, kill_tree, spawn

from swarm.app import token_admin
from swarm.app.history import fetch_history, history_from_state_dir, history_to_dict
from swarm.app.status import status_to_dict
from swarm.control.client import CoordinatorClient, CoordinatorError, CoordinatorRejected
from swarm.control.joinstring import JoinString

ROOT = Path(__file__).resolve().parents[2]


class Swarm:
    """One run: ``start`` the coordinator, ``peer`` each peer, ``watch`` until it finishes, ``stop``."""

    def __init__(self, workdir: Path, config_text: str) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.config = workdir / "run.toml"
        self.config.write_text(config_text)
        self.state_dir = workdir / "coordinator"
        self.peers: dict[str, subprocess.Popen] = {}
        self.coordinator: Optional[subprocess.Popen] = None
        self.watcher: Optional[CoordinatorClient] = None
        self.internal: list[str] = []  # calls the coordinator answered INTERNAL
        self.unanswered = 0  # status polls it did not answer in time
        self.status: Optional[dict] = None
        self.started = time.monotonic()

    def start(self) -> JoinString:
        self.coordinator = spawn(
            [
                "coordinator",
                "--config",
                str(self.config),
                "--state-dir",
                str(self.state_dir),
                "--lease-s",
                "6",
                "--exit-grace-s",
                "30",
            ],
            self.workdir / "coordinator.log",
            stdout=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.coordinator.stdout.readline().decode()
            if line.startswith("join: "):
                self.join = JoinString.parse(line.split(" ", 1)[1].strip())
                self.watcher = CoordinatorClient(
                    JoinString.parse(token_admin.create(self.state_dir, role="status")), request_timeout_s=5
                )
                return self.join
            if not line and self.coordinator.poll() is not None:
                break
        raise RuntimeError(f"the coordinator did not start; see {self.workdir / 'coordinator.log'}")

    def peer(self, name: str, *, program: Optional[Path] = None, env: Optional[dict[str, str]] = None) -> None:
        """Start peer ``name`` with ``swarm peer``, or with ``program`` (an attacker's modified peer: a Python file
        that takes the same arguments as ``swarm``)."""
        args = [
            "peer",
            "--join",
            str(self.join),
            "--state-dir",
            str(self.workdir / name),
            "--threads",
            "1",
            "--name",
            name,
            "--join-timeout-s",
            "300",
        ]
        log = self.workdir / f"{name}.log"
        if program is None:
            self.peers[name] = spawn(args, log)
            return
        environment = dict(
            os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", PYTHONPATH=str(ROOT), **(env or {})
        )
        self.peers[name] = subprocess.Popen(
            [sys.executable, str(program), *args],
            stdout=open(log, "ab"),
            stderr=open(log, "ab"),
            env=environment,
            cwd=ROOT,
            start_new_session=True,
        )

    def answered(self, what: str, call: Callable[[], object]) -> object:
        """``call()``'s answer; None when it was refused or not answered; an INTERNAL answer is recorded."""
        try:
            return call()
        except CoordinatorRejected as e:
            if e.code == grpc.StatusCode.INTERNAL:
                self.internal.append(f"{what}: {e.details}")
                print(f"BREACH {what} answered INTERNAL: {e.details}", file=sys.stderr, flush=True)
            return None
        except CoordinatorError:
            return None

    def poll(self) -> Optional[dict]:
        """The run's status as ``swarm status --json`` shows it (None: not answered in time)."""
        response = self.answered("GetStatus", self.watcher.get_status)
        if response is None:
            self.unanswered += 1
            return None
        self.status = status_to_dict(response)
        return self.status

    def history(self) -> dict:
        """The run's history as ``swarm history --json`` shows it: asked of the coordinator, or read from its state dir
        (``swarm history --state-dir``) once it has ended."""
        response = None
        if self.coordinator is not None and self.coordinator.poll() is None:
            response = self.answered(
                "GetHistory", lambda: fetch_history(lambda after: self.watcher.get_history(after_round=after))
            )
        if response is None:
            response = history_from_state_dir(self.state_dir)
        return history_to_dict(response)

    def watch(
        self, timeout_s: float, on_poll: Callable[[dict], None] = lambda status: None, period_s: float = 0.5
    ) -> bool:
        """Poll until the run finishes (True) or ``timeout_s`` passes or the coordinator exits (False), calling
        ``on_poll`` with each status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.poll()
            if status is not None:
                if status["run"]["finished"]:
                    return True
                on_poll(status)
            if self.coordinator.poll() is not None:
                return False
            time.sleep(period_s)  # the watcher's sampling period, as `swarm status --watch`
        return False

    def names_by_id(self) -> dict[str, str]:
        return {p["id"]: p["name"] for p in (self.status or {}).get("peers", [])}

    def stop(self, *, wait_s: float = 120) -> None:
        """Wait for the peers to end (they leave once the run finished), then end the coordinator."""
        deadline = time.monotonic() + wait_s
        for proc in self.peers.values():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        if self.watcher is not None:
            self.watcher.close()
        if self.coordinator is not None:
            kill_tree(self.coordinator)

    def final_models(self, names) -> dict[str, str]:
        """Each named peer's final model, as a digest of its tensors (absent: it wrote none)."""
        paths = {name: self.workdir / name / "final" / "model.safetensors" for name in names}
        return {name: tensors_digest(path) for name, path in paths.items() if path.exists()}

    def final_eval(self, names) -> Optional[float]:
        loss = final_eval(self.workdir, {name: self.peers[name] for name in names})
        return None if loss is None or not math.isfinite(loss) else round(loss, 4)

    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.started, 1)


def tensors_digest(path: Path) -> str:
    """A digest of a final model's tensors, by name (the file's bytes also hold safetensors' metadata, whose order
    varies from process to process)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0" + tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def rounds_config(
    *, inner_steps: int, rounds: int, min_peers: int, round_timeout_s: float = 60.0, extra: str = ""
) -> str:
    """A run's TOML: the tiny model, ``rounds`` rounds of ``inner_steps``, and the short windows of a loopback run."""
    return (
        f"[rounds]\ninner_steps = {inner_steps}\nmax_rounds = {rounds}\nmin_peers = {min_peers}\n"
        f"matchmaking_window_s = 5.0\nexchange_timeout_s = 10.0\nround_timeout_s = {round_timeout_s}\n{extra}"
    )


def verdicts(history: dict) -> dict[int, dict]:
    """Each decided round of ``history`` by number."""
    return {int(r["round"]): r for r in history["rounds"]}
