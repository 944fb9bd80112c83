#!/usr/bin/env python3
"""Chaos soak: a swarm on loopback whose peers are SIGKILLed and restarted at random, and whose
coordinator is killed and restarted, while every committed round is checked on every live peer.

    .venv/bin/python scripts/chaos.py --peers 5 --rounds 60 --mtbf-s 4 --coordinator-kills 1 --json

Then it runs a fault-free swarm of the same length for comparison. With --json the last stdout line
is one JSON object: faults_injected, coordinator_restarts, rounds_committed, rounds_voided,
divergent_commits (must be 0), lost_committed_rounds (must be 0), nonfinite_seen (must be 0),
final_eval_loss, fault_free_eval_loss, mean_rejoin_s, unexpected_exits, and per run (soak and fault-free) the
rounds committed once every peer had joined one, each round's contributors, the largest sub-group,
the distinct final models, the peak memory of the swarm's processes and the load average. Exit status 0
only when there was no divergence, no lost committed round, nothing non-finite and no peer ended on its own.

A larger swarm on a busy machine (two-level averaging in sub-groups of at most 8, one site):

    .venv/bin/python scripts/chaos.py --peers 24 --rounds 10 --mtbf-s 10 --group-size 8 --lease-s 30 \\
        --set rounds.matchmaking_window_s=30 --set rounds.exchange_timeout_s=60 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402
from rich.console import Console  # noqa: E402

from peer.restarts import peer_processes  # noqa: E402
from swarm.app.run_progress import RunProgress  # noqa: E402
from swarm.app.status import format_bytes, status_to_dict  # noqa: E402
from swarm.control.client import CoordinatorClient, CoordinatorError  # noqa: E402
from swarm.control.joinstring import JoinString  # noqa: E402
from swarm.core.site_plan import plan_sites  # noqa: E402

SLOW = "slow@1:compute=3"


def spawn(args: list[str], log: Path, stdout=None) -> subprocess.Popen:
    # faulthandler: a process that dies of a signal of its own (SIGSEGV, SIGABRT) leaves a traceback
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.app.cli", *args],
        stdout=stdout or open(log, "ab"),
        stderr=open(log, "ab"),
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process group: the daemon and its hivemind/p2pd children
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path, *, faults: bool):
        self.args, self.workdir, self.faults = args, workdir, faults
        self.rng = random.Random(args.seed)
        self.config = workdir / "run.toml"
        rounds = {
            "inner_steps": args.inner_steps,
            "max_rounds": args.rounds,
            "min_peers": args.peers,
            "matchmaking_window_s": 5.0,
            "exchange_timeout_s": 8.0,
            "round_timeout_s": 60.0,
            "overlap_steps": args.overlap_steps,
            "controller": f'"{args.controller}"',
            "codec": f'"{args.codec}"',
        }
        if args.group_size:  # two-level averaging: every peer on one site, cut into sub-groups of at most N
            rounds.update(hierarchical="true", group_size=args.group_size)
        self.config.write_text(run_toml(rounds, args.set))
        from swarm.config import ConfigError
        from swarm.config.run import load_run_config

        try:
            load_run_config(self.config)
        except ConfigError as e:
            raise SystemExit(f"chaos: the run config is refused: {e}") from None
        self.coordinator: Optional[subprocess.Popen] = None
        self.join = ""
        self.peers: dict[str, subprocess.Popen] = {}
        self.restarted_at: dict[str, float] = {}
        self.rejoin_s: list[float] = []
        self.faults_injected = 0
        self.coordinator_restarts = 0
        self.divergent = 0
        self.nonfinite = 0
        self.lost = 0
        self.committed: dict[int, str] = {}
        self.unexpected_exits: list[str] = []  # peers that ended before the run did without being killed
        self.peak_pss = 0  # bytes: the coordinator's and the peers' process trees together, at the worst sample
        self.peak_used = 0  # bytes: the machine's memory in use (every process on it), at the worst sample
        self.load: list[float] = []  # the 1-minute load average at each sample
        self.next_sample = 0.0

    def start_coordinator(self) -> None:
        self.coordinator = spawn(
            [
                "coordinator",
                "--config",
                str(self.config),
                "--state-dir",
                str(self.workdir / "coordinator"),
                "--lease-s",
                str(self.args.lease_s),
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
                self.join = line.split(" ", 1)[1].strip()
                return
            if not line and self.coordinator.poll() is not None:
                break
        raise RuntimeError("the coordinator did not start; see coordinator.log")

    def start_peer(self, name: str) -> None:
        supervised = ["--max-restarts", "1000000"] if self.args.supervised else []
        if int(name.rsplit("-", 1)[1]) < self.args.slow_peers:
            supervised += ["--faults", SLOW]  # a 3x slower device, in every process of this peer
        if self.args.group_size:
            supervised += ["--site", "loopback"]  # a peer without a site is a sub-group of its own
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
                "--join-timeout-s",
                "300",
                "--checkpoint-every",
                "1",
                *supervised,
            ],
            self.workdir / f"{name}.log",
        )

    def kill_peer_process(self, name: str) -> None:
        """--supervised: kill -9 the peer process under ``name``'s supervisor (a fork: the supervisor's command
        line), as a crash or an out-of-memory kill would end it; the supervisor starts the next one."""
        for pid in peer_processes(self.peers[name].pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it died on its own meanwhile

    @staticmethod
    def rounds_joined(status: Optional[dict], name: str) -> int:
        return max((p["rounds_joined"] for p in (status or {}).get("peers", []) if p["name"] == name), default=0)

    def sample_resources(self) -> None:
        """Every 10 s: the swarm's memory (the proportional set size of every process the soak started and of
        their children: shared pages counted once), the machine's memory in use and the load average."""
        now = time.monotonic()
        if now < self.next_sample:
            return
        self.next_sample = now + 10.0
        total = 0
        for proc in [self.coordinator, *self.peers.values()]:
            try:
                root = psutil.Process(proc.pid)
                for p in [root, *root.children(recursive=True)]:
                    total += p.memory_full_info().pss
            except (psutil.Error, AttributeError):
                continue  # it ended meanwhile
        self.peak_pss = max(self.peak_pss, total)
        memory = psutil.virtual_memory()
        self.peak_used = max(self.peak_used, memory.total - memory.available)
        self.load.append(os.getloadavg()[0])

    def history(self, client: CoordinatorClient) -> list[dict]:
        """The decided rounds: number, outcome, contributors (participants) and the matched group's size."""
        rows, after = [], 0
        for _ in range(100):
            try:
                page = client.get_history(after_round=after)
            except CoordinatorError:
                time.sleep(1)
                continue
            rows += [
                {
                    "round": r.round,
                    "committed": bool(r.committed_hash),
                    "participants": r.participants,
                    "group": r.group_size,
                }
                for r in page.rounds
            ]
            if not page.more or not page.rounds:
                break
            after = page.rounds[-1].round
        return rows

    def status(self, client: CoordinatorClient) -> Optional[dict]:
        try:
            return status_to_dict(client.get_status())
        except CoordinatorError:
            return None

    def finished(self, client: CoordinatorClient) -> bool:
        """Whether the run has finished, asking until the coordinator answers (it is busiest right then)."""
        for _ in range(10):
            status = self.status(client)
            if status is not None:
                return bool(status["run"]["finished"])
            time.sleep(0.5)  # the coordinator did not answer within the client's timeout; ask again
        return False

    def check(self, status: dict) -> None:
        run = status["run"]
        if run["committed_hash"]:
            seen = self.committed.setdefault(run["committed_round"], run["committed_hash"])
            if seen != run["committed_hash"]:  # a committed round replaced: it was lost
                self.lost += 1
                print(
                    f"LOST: round {run['committed_round']} was committed as {seen}, now {run['committed_hash']}",
                    file=sys.stderr,
                )
                self.committed[run["committed_round"]] = run["committed_hash"]
        for peer in status["peers"]:
            if peer["state"] in ("left", "evicted"):
                continue
            metrics = peer["metrics"]
            expected = self.committed.get(metrics["state_round"])
            if expected and metrics["state_hash"] and metrics["state_hash"] != expected:
                self.divergent += 1
                print(
                    f"DIVERGENT: {peer['name']} holds {metrics['state_hash']} for round {metrics['state_round']}, "
                    f"committed {expected}",
                    file=sys.stderr,
                )
            if metrics["loss"] is not None and not math.isfinite(metrics["loss"]):
                self.nonfinite += 1
            name = peer["name"]
            if name in self.restarted_at:
                # a restarted peer keeps its id (its key) and its round counts: it is back once it holds a new round
                when, joined_before = self.restarted_at[name]
                if peer["rounds_joined"] > joined_before:
                    self.rejoin_s.append(time.monotonic() - when)
                    del self.restarted_at[name]

    def show(self, progress: RunProgress, status: dict) -> None:
        run = status["run"]
        eval_loss = "—" if run["eval_loss"] is None else f"{run['eval_loss']:.3f}"
        progress.update(
            run["rounds_committed"],
            voided=str(run["rounds_voided"]),
            eval=eval_loss,
            sent=format_bytes(status["totals"]["bytes_sent"]),
            faults=str(self.faults_injected),
            divergent=str(self.divergent),
        )

    def run(self) -> dict:
        started = time.monotonic()
        self.start_coordinator()
        for i in range(self.args.peers):
            self.start_peer(f"peer-{i}")
        client = CoordinatorClient(JoinString.parse(self.join), request_timeout_s=3)
        next_fault = time.monotonic() + self.rng.expovariate(1 / self.args.mtbf_s) + 10
        kill_coordinator_at = sorted(
            self.rng.uniform(0.3, 0.7) * self.args.rounds for _ in range(self.args.coordinator_kills)
        )
        pending_restarts: list[tuple[float, str]] = []
        status: Optional[dict] = None
        deadline = started + self.args.timeout_s
        # on stderr: stdout keeps only the summary
        progress = RunProgress(
            self.args.rounds, what=f"{self.workdir.name}: rounds committed", console=Console(stderr=True)
        ).start()
        while time.monotonic() < deadline:
            self.sample_resources()
            status = self.status(client) or status
            if status:
                self.check(status)
                self.show(progress, status)
                if status["run"]["finished"]:
                    break
            now = time.monotonic()
            committed = status["run"]["rounds_committed"] if status else 0
            if self.faults and kill_coordinator_at and committed >= kill_coordinator_at[0]:
                kill_coordinator_at.pop(0)
                kill_tree(self.coordinator)
                time.sleep(self.rng.uniform(1, 4))  # the outage
                self.start_coordinator()
                self.coordinator_restarts += 1
                self.faults_injected += 1
            if self.faults and now >= next_fault and status and status["run"]["rounds_committed"] >= 1:
                # Any live peer may die, also the last holder of the committed state: every voter wrote
                # its vote to disk before reporting it, and a restarted peer resumes from it.
                live = [n for n, p in self.peers.items() if p.poll() is None and n not in self.restarted_at]
                if len(live) > 2:  # two peers keep training while the others restart
                    victim = self.rng.choice(live)
                    self.faults_injected += 1
                    if self.args.supervised:  # restarted at once by its supervisor: back from the kill on
                        self.kill_peer_process(victim)
                        self.restarted_at[victim] = (time.monotonic(), self.rounds_joined(status, victim))
                    else:
                        kill_tree(self.peers[victim])
                        pending_restarts.append((now + self.rng.uniform(0.5, 3.0), victim))
                next_fault = now + self.rng.expovariate(1 / self.args.mtbf_s)
            restarting = {name for _, name in pending_restarts}
            for name, proc in self.peers.items():
                if name not in restarting and proc.poll() is not None:
                    if proc.returncode == 0 and self.finished(client):
                        continue  # the run just finished: the peer left as it should
                    print(
                        f"UNEXPECTED EXIT: {name} exited with status {proc.returncode}; see {name}.log", file=sys.stderr
                    )
                    self.unexpected_exits.append(name)
                    self.start_peer(name)  # the soak goes on with the full swarm; the exit is reported
            for when, name in list(pending_restarts):
                if now >= when:
                    pending_restarts.remove((when, name))
                    self.start_peer(name)
                    self.restarted_at[name] = (time.monotonic(), self.rounds_joined(status, name))
            time.sleep(0.3)  # the soak's sampling period
        progress.stop()
        # A finished run's peers leave on their own within 120 s all together; a run cut short by --timeout-s
        # does not finish, so its peers are stopped at once.
        leave_by = time.monotonic() + (120 if status and status["run"]["finished"] else 0)
        for proc in self.peers.values():
            try:
                proc.wait(timeout=max(0.0, leave_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_tree(proc)
        final = self.status(client) or status or {"run": {}}
        history = self.history(client)
        client.close()
        kill_tree(self.coordinator, signal.SIGTERM)
        run = final["run"]
        # Round numbers are dense: every round up to the last committed one was committed or voided once.
        gaps = run.get("committed_round", 0) - run.get("rounds_committed", 0) - run.get("rounds_voided", 0)
        self.lost += max(0, gaps)
        joined = sum(peer.get("rounds_joined", 0) for peer in final.get("peers", []))
        # From the first round every peer contributed to on: the rounds a full swarm committed or voided.
        full = next((i for i, r in enumerate(history) if r["participants"] >= self.args.peers), len(history))
        after_full = history[full:]
        largest_subgroup = (
            max(
                (
                    max(
                        len(s.positions)
                        for s in plan_sites(["loopback"] * r["participants"], self.args.group_size).subgroups
                    )
                    for r in history
                    if r["participants"]
                ),
                default=0,
            )
            if self.args.group_size
            else None
        )
        return {
            "mean_contributors": round(joined / max(1, run.get("rounds_committed", 0)), 2),
            "rounds_committed": final["run"].get("rounds_committed", 0),
            "rounds_voided": final["run"].get("rounds_voided", 0),
            "final_eval_loss": final_eval(self.workdir, self.peers),
            "wall_s": round(time.monotonic() - started, 1),
            "first_full_round": after_full[0]["round"] if after_full else None,
            "rounds_after_full": len(after_full),
            "committed_after_full": sum(r["committed"] for r in after_full),
            "contributors": [r["participants"] for r in history],  # per decided round, in order
            "outcomes": "".join("c" if r["committed"] else "v" for r in history),
            "largest_group": max((r["group"] for r in history), default=0),
            "largest_subgroup": largest_subgroup,
            "final_models": final_models(self.workdir, self.peers),
            "peak_pss_gb": round(self.peak_pss / 2**30, 2),
            "peak_machine_used_gb": round(self.peak_used / 2**30, 2),
            "load_1m": [round(min(self.load), 1), round(max(self.load), 1)] if self.load else None,
        }


RUN_FIGURES = (
    "first_full_round",
    "rounds_after_full",
    "committed_after_full",
    "contributors",
    "outcomes",
    "largest_group",
    "largest_subgroup",
    "final_models",
    "peak_pss_gb",
    "peak_machine_used_gb",
    "load_1m",
    "wall_s",
)
FIRST_ROUND = re.compile(r"first round: training ([\d.]+)s after launch")


def restart_to_training_s(workdir: Path, peers: dict[str, subprocess.Popen]) -> list[float]:
    """Each restart's seconds from its process's launch (a supervised one: its fork, right after the kill) to
    training, from the peers' own start-up lines; a peer's first start is not a restart."""
    seconds = []
    for name in peers:
        log = workdir / f"{name}.log"
        if log.exists():
            seconds += [float(s) for s in FIRST_ROUND.findall(log.read_text(errors="replace"))[1:]]
    return seconds


def run_toml(rounds: dict[str, object], settings: list[str]) -> str:
    """The soak's run config: its ``[rounds]`` keys, then ``--set SECTION.KEY=VALUE`` settings, which win over them.
    VALUE is a TOML value (``0.95``, ``true``); a string that is not one is quoted (``rounds.codec=int4``)."""
    import tomllib

    sections: dict[str, dict[str, object]] = {"rounds": dict(rounds)}
    for item in settings:
        key, sep, value = item.partition("=")
        section, dot, name = key.strip().partition(".")
        value = value.strip()
        if not (sep and dot and name and value):
            raise SystemExit(f"--set {item!r}: write SECTION.KEY=VALUE, e.g. --set outer.momentum=0.0.")
        try:
            tomllib.loads(f"v = {value}")
        except tomllib.TOMLDecodeError:
            value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        sections.setdefault(section, {})[name] = value
    return "".join(
        f"[{section}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()) for section, keys in sections.items()
    )


def final_models(workdir: Path, peers: dict[str, subprocess.Popen]) -> dict[str, int]:
    """How many peers wrote each final model (first 12 hex digits of the file's SHA-256): one key when every
    peer ended on the same θg."""
    counts: dict[str, int] = {}
    for name in sorted(peers):
        path = workdir / name / "final" / "model.safetensors"
        if path.exists():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
            counts[digest] = counts.get(digest, 0) + 1
    return counts


def final_eval(workdir: Path, peers: dict[str, subprocess.Popen]) -> Optional[float]:
    from swarm.config import RunConfig
    from swarm.train.model.final_model import final_eval_loss

    for name in sorted(peers):
        path = workdir / name / "final" / "model.safetensors"
        if path.exists():
            return final_eval_loss(path, RunConfig())
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--mtbf-s", type=float, default=4.0, help="mean seconds between peer kills")
    parser.add_argument("--coordinator-kills", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--skip-fault-free", action="store_true")
    parser.add_argument(
        "--supervised",
        action="store_true",
        help="peers run under --max-restarts; a fault kills only the peer process, which its "
        "supervisor starts again at once (the rejoin counts from the kill)",
    )
    parser.add_argument("--overlap-steps", type=int, default=0, help="[rounds] overlap_steps of the run")
    parser.add_argument("--controller", choices=("off", "auto"), default="off", help="[rounds] controller of the run")
    parser.add_argument("--codec", default="fp32", help="[rounds] codec of the run (e.g. int4)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="one more key of the run config, a TOML value (repeatable), e.g. --set outer.momentum=0.0",
    )
    parser.add_argument(
        "--slow-peers",
        type=int,
        default=0,
        help=f"the first N peers run with --faults {SLOW} (each inner step takes 3x its compute)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="two-level averaging ([rounds] hierarchical) in sub-groups of at most N peers, every "
        "peer on one site (default 0: one flat group)",
    )
    parser.add_argument(
        "--lease-s",
        type=float,
        default=4.0,
        help="the coordinator's --lease-s: a peer silent this long is evicted (longer on a busy machine)",
    )
    parser.add_argument("--workdir", help="keep logs here (default: a temporary directory)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    base = Path(args.workdir or tempfile.mkdtemp(prefix="swarm-chaos-"))
    base.mkdir(parents=True, exist_ok=True)
    (base / "chaos").mkdir(exist_ok=True)
    soak = Soak(args, base / "chaos", faults=True)
    result = soak.run()
    calm: dict = {}
    if not args.skip_fault_free:
        (base / "calm").mkdir(exist_ok=True)
        calm = Soak(args, base / "calm", faults=False).run()
    starts = restart_to_training_s(base / "chaos", soak.peers)
    summary = {
        "faults_injected": soak.faults_injected,
        "coordinator_restarts": soak.coordinator_restarts,
        "rounds_committed": result["rounds_committed"],
        "rounds_voided": result["rounds_voided"],
        "divergent_commits": soak.divergent,
        "lost_committed_rounds": soak.lost,
        "nonfinite_seen": soak.nonfinite,
        "final_eval_loss": result["final_eval_loss"],
        "fault_free_eval_loss": calm.get("final_eval_loss"),
        # peers whose update each committed round holds, on average: what the faults cost in compute
        "mean_contributors": result["mean_contributors"],
        "fault_free_mean_contributors": calm.get("mean_contributors"),
        # from the restart to a committed round holding the peer's update (includes the rest of the round)
        "mean_rejoin_s": round(sum(soak.rejoin_s) / len(soak.rejoin_s), 2) if soak.rejoin_s else None,
        "rejoins_measured": len(soak.rejoin_s),
        "rejoin_s": [round(s, 2) for s in soak.rejoin_s],  # each, in the order they happened
        # from the restarted process's launch to its first inner step (its own start-up line)
        "mean_restart_to_training_s": round(sum(starts) / len(starts), 2) if starts else None,
        "restarts_measured": len(starts),
        "unexpected_exits": len(soak.unexpected_exits),
        "wall_s": result["wall_s"],
        "soak": {k: result[k] for k in RUN_FIGURES},
        "fault_free": {k: calm[k] for k in RUN_FIGURES} if calm else None,
        "supervised": args.supervised,
        "workdir": str(base),
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=1), flush=True)
    clean = soak.divergent == 0 and soak.nonfinite == 0 and soak.lost == 0 and not soak.unexpected_exits
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
