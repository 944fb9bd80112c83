#!/usr/bin/env python3
"""Fast rejoin: how long a restarted peer takes to contribute again.

    .venv/bin/python scripts/bench_rejoin.py --restarts 5 --json

A coordinator and two peers of the tiny model on loopback; once rounds commit, one peer is killed
(kill -9, its process group) and restarted at once with the same state dir, ``--restarts`` times. For
each restart it reads the peer's own start-up line ("first round: training N s after launch (...)")
and asks the coordinator whether the round it started training counted it. With --json the last
stdout line is one JSON object: ``restarts`` (one row per restart: ``to_training_s``, the breakdown,
``round``, ``contributed`` (its report of that round was counted), ``to_committed_s`` (restart to a
committed round holding its update)) and the means ``mean_to_training_s`` and ``mean_to_committed_s``.

With ``--supervised`` the restarted peer runs under ``--max-restarts`` (peer/restarts.py) and only its peer
process is killed (as a crash or an out-of-memory kill would end it); its supervisor forks the next one.
``to_training_s`` then also counts the seconds from the kill to the new process's start (``respawn_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from peer.restarts import peer_processes  # noqa: E402
from swarm.app.status import status_to_dict  # noqa: E402
from swarm.control.client import CoordinatorClient, CoordinatorError  # noqa: E402
from swarm.control.joinstring import JoinString  # noqa: E402

FIRST_ROUND = re.compile(r"r(\d+)\] first round: training ([\d.]+)s after launch \((.*)\)")
CPU_S = re.compile(r"([\d.]+) CPU-s")
RESTARTED = "peer-1"


def spawn(args: list[str], log: Path, stdout=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.app.cli", *args],
        stdout=stdout or open(log, "ab"),
        stderr=open(log, "ab"),
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the daemon and its DHT process and p2pd
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def decided(text: str, round_no: int) -> Optional[str]:
    """ "mine" once the peer's log says round ``round_no`` committed its hash, "not mine" when it committed
    without it or was voided, None while undecided."""
    if re.search(rf" r{round_no}\] committed, hash", text):
        return "mine"
    if re.search(rf" r{round_no}\] (committed .* which this peer does not hold|voided|round {round_no} went on)", text):
        return "not mine"
    return None


def poll(predicate, *, timeout_s: float, what: str, interval_s: float = 0.1, alive=lambda: True):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    if not alive():
        raise RuntimeError(f"a process exited while waiting for {what}; see the logs")
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}")


class Bench:
    def __init__(self, workdir: Path, args: argparse.Namespace) -> None:
        self.workdir, self.args = workdir, args
        self.config = workdir / "run.toml"
        self.config.write_text(
            f'[model]\npreset = "tiny"\n\n[rounds]\ninner_steps = {args.inner_steps}\nmax_rounds = 100000\n'
            "min_peers = 2\nmatchmaking_window_s = 5.0\nexchange_timeout_s = 8.0\nround_timeout_s = 60.0\n"
        )
        self.coordinator: Optional[subprocess.Popen] = None
        self.peers: dict[str, subprocess.Popen] = {}
        self.client: Optional[CoordinatorClient] = None
        self.join = ""

    def start(self) -> None:
        self.coordinator = spawn(
            [
                "coordinator",
                "--config",
                str(self.config),
                "--state-dir",
                str(self.workdir / "coordinator"),
                "--lease-s",
                "4",
            ],
            self.workdir / "coordinator.log",
            stdout=subprocess.PIPE,
        )
        self.join = poll(self._join_line, timeout_s=120, what="the join string")
        self.client = CoordinatorClient(JoinString.parse(self.join), request_timeout_s=3)
        for name in ("peer-0", "peer-1"):
            self.start_peer(name)

    def _join_line(self) -> Optional[str]:
        line = self.coordinator.stdout.readline().decode()
        return line.split(" ", 1)[1].strip() if line.startswith("join: ") else None

    def start_peer(self, name: str) -> None:
        supervised = ["--max-restarts", "1000000"] if self.args.supervised and name == RESTARTED else []
        self.peers[name] = spawn(
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
                "--checkpoint-every",
                "1",
                *supervised,
            ],
            self.workdir / f"{name}.log",
        )

    def status(self) -> Optional[dict]:
        try:
            return status_to_dict(self.client.get_status())
        except CoordinatorError:
            return None

    def peer_row(self, name: str) -> Optional[dict]:
        status = self.status()
        return next((p for p in status["peers"] if p["name"] == name), None) if status else None

    def restart(self, name: str) -> dict:
        log = self.workdir / f"{name}.log"
        before = self.peer_row(name)["rounds_joined"]
        offset, respawn = log.stat().st_size, 0.0  # the restarted process's lines come after this
        if self.args.supervised:
            restarted, respawn = time.monotonic(), self.kill_supervised_child(name)
        else:
            kill_group(self.peers[name])
            restarted = time.monotonic()
            self.start_peer(name)
        since = lambda: log.read_bytes()[offset:].decode(errors="replace")  # noqa: E731  this process's lines
        match = poll(
            lambda: (FIRST_ROUND.findall(since()) or [None])[0],
            timeout_s=120,
            what=f"{name} to train again",
            alive=self.alive,
        )
        round_no, to_training, breakdown = int(match[0]), float(match[1]) + respawn, match[2]
        row = poll(
            lambda: (lambda r: r if r and r["rounds_joined"] > before else None)(self.peer_row(name)),
            timeout_s=120,
            what=f"a committed round holding {name}'s update",
            alive=self.alive,
        )
        to_committed = time.monotonic() - restarted
        contributed = poll(
            lambda: decided(since(), round_no), timeout_s=60, what=f"{name}'s round {round_no}", alive=self.alive
        )
        contributed = contributed == "mine"
        cpu = CPU_S.search(breakdown)
        return {
            "round": round_no,
            "to_training_s": round(to_training, 2),
            "respawn_s": round(respawn, 3),
            "breakdown": breakdown,
            "cpu_s": float(cpu.group(1)) if cpu else None,
            "contributed": contributed,
            "to_committed_s": round(to_committed, 2),
            "rounds_joined": row["rounds_joined"] - before,
        }

    def kill_supervised_child(self, name: str) -> float:
        """kill -9 the peer process under ``name``'s supervisor; seconds from the kill to its successor's start."""
        supervisor = self.peers[name].pid
        (child,) = peer_processes(supervisor)
        killed = time.time()
        os.kill(child, signal.SIGKILL)
        successor = poll(
            lambda: [p for p in peer_processes(supervisor) if p != child],
            timeout_s=30,
            what=f"{name}'s supervisor to start it again",
            alive=self.alive,
        )[0]
        return max(0.0, psutil.Process(successor).create_time() - killed)  # the kernel's, to a clock tick

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in [*self.peers.values(), self.coordinator])

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for proc in [*self.peers.values(), self.coordinator]:
            if proc is not None and proc.poll() is None:
                family = psutil.Process(proc.pid).children(recursive=True)  # a supervised peer's own group too
                kill_group(proc)
                for p in family:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--warm-rounds", type=int, default=2, help="committed rounds before the first kill")
    parser.add_argument("--settle-rounds", type=int, default=1, help="committed rounds between restarts")
    parser.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    parser.add_argument(
        "--supervised",
        action="store_true",
        help="run the restarted peer under --max-restarts and kill only its peer process",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="swarm-rejoin-"))
    workdir.mkdir(parents=True, exist_ok=True)
    bench = Bench(workdir, args)
    rows = []
    try:
        bench.start()
        poll(
            lambda: (bench.status() or {"run": {}})["run"].get("rounds_committed", 0) >= args.warm_rounds,
            timeout_s=300,
            what="the first rounds",
            alive=bench.alive,
        )
        for _ in range(args.restarts):
            rows.append(bench.restart(RESTARTED))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            target = bench.status()["run"]["rounds_committed"] + args.settle_rounds
            poll(
                lambda: bench.status()["run"]["rounds_committed"] >= target,
                timeout_s=120,
                what="a settle round",
                alive=bench.alive,
            )
    finally:
        bench.close()
    mean = lambda key: round(sum(r[key] for r in rows) / len(rows), 2) if rows else None  # noqa: E731
    summary = {
        "restarts": rows,
        "mean_to_training_s": mean("to_training_s"),
        "mean_cpu_s": mean("cpu_s") if all(r["cpu_s"] is not None for r in rows) else None,
        "mean_to_committed_s": mean("to_committed_s"),
        "contributed_to_first_round": sum(r["contributed"] for r in rows),
        "supervised": args.supervised,
        "workdir": str(workdir),
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
