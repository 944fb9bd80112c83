"""`swarm demo`: a coordinator and N peers as separate processes on loopback, training the embedded default.

It shows progress while the run trains, checks that every peer ended with the same θg, and ends
with a summary table (or, with --json, one JSON line).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from swarm.app.run_progress import RunProgress
from swarm.app.status import format_bytes, status_to_dict


@dataclass(frozen=True, kw_only=True)
class DemoOptions:
    peers: int = 3
    rounds: int = 10
    inner_steps: int = 50
    preset: str = "tiny"
    as_json: bool = False
    workdir: Optional[Path] = None
    timeout_s: float = 900.0


def _spawn(args: list[str], log: Path, *, stdout=None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "swarm.app.cli", *args],
        stdout=stdout if stdout is not None else open(log, "ab"),
        stderr=open(log, "ab"),
        env=env,
        start_new_session=True,
    )


def _read_join_string(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), True)
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if line.startswith("join: "):
            return line.split(" ", 1)[1].strip()
        if not line and proc.poll() is not None:
            break
    raise RuntimeError("the demo coordinator did not print its join string; see its log")


def run_demo(options: DemoOptions) -> int:
    console = Console(stderr=options.as_json)
    workdir = options.workdir or Path(tempfile.mkdtemp(prefix="swarm-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    console.print(
        f"[bold]swarm demo[/bold]: coordinator + {options.peers} peers on loopback, "
        f"{options.rounds} rounds of H={options.inner_steps}, model preset {options.preset}; files in {workdir}"
    )

    coordinator = _spawn(
        [
            "coordinator",
            "--state-dir",
            str(workdir / "coordinator"),
            "--max-rounds",
            str(options.rounds),
            "--min-peers",
            str(options.peers),
            "--inner-steps",
            str(options.inner_steps),
            "--preset",
            options.preset,
            "--exit-grace-s",
            "10",
        ],
        workdir / "coordinator.log",
        stdout=subprocess.PIPE,
    )
    peers: list[subprocess.Popen] = []  # _train adds each peer as it starts it, so the cleanup sees them all
    try:
        status, codes = _train(coordinator, peers, options, workdir, console, deadline=started + options.timeout_s)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        console.print(f"[red]demo failed: {e}[/red]; logs are in {workdir}")
        return 1
    finally:
        _stop([*peers, coordinator])

    summary = _summary(options, workdir, status, codes, started=started)
    _print_summary(summary, console)
    if options.as_json:
        print(json.dumps(summary), flush=True)
    ok = summary["consistent"] and all(c == 0 for c in codes) and summary["rounds_committed"] == options.rounds
    return 0 if ok else 1


def _train(
    coordinator: subprocess.Popen,
    peers: list[subprocess.Popen],
    options: DemoOptions,
    workdir: Path,
    console: Console,
    *,
    deadline: float,
) -> tuple[Optional[dict[str, Any]], list[int]]:
    """Start the peers, follow the run to its end and stop the coordinator: the last status and the
    peers' exit codes."""
    join = _read_join_string(coordinator, timeout_s=120)
    console.print(f"join string: {join}")
    for i in range(options.peers):
        peers.append(
            _spawn(
                [
                    "peer",
                    "--join",
                    join,
                    "--state-dir",
                    str(workdir / f"peer-{i}"),
                    "--threads",
                    "1",
                    "--name",
                    f"demo-peer-{i}",
                    "--site",
                    "loopback",
                ],
                workdir / f"peer-{i}.log",
            )
        )
    status = _follow(join, peers, console, rounds=options.rounds, deadline=deadline)
    codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in peers]
    status = _final_status(join) or status  # after the peers' last heartbeats
    coordinator.send_signal(signal.SIGTERM)  # its exit grace only serves status readers like us
    coordinator.wait(timeout=60)
    return status, codes


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _summary(
    options: DemoOptions, workdir: Path, status: Optional[dict[str, Any]], codes: list[int], *, started: float
) -> dict[str, Any]:
    finals = [workdir / f"peer-{i}" / "final" / "model.safetensors" for i in range(options.peers)]
    from swarm.train.model.final_model import tensors_digest  # torch: imported only once the peers have finished

    digests = [tensors_digest(f) if f.exists() else None for f in finals]
    consistent = all(d is not None for d in digests) and len(set(digests)) == 1
    final_eval = _final_eval_loss(finals[0], options) if finals[0].exists() else math.nan
    run, totals = (status or {}).get("run", {}), (status or {}).get("totals", {})
    return {
        "rounds_committed": run.get("rounds_committed", 0),
        "initial_eval_loss": run.get("initial_eval_loss"),
        "final_eval_loss": final_eval,
        "peers": options.peers,
        "peer_exit_codes": codes,
        "bytes_sent_total": totals.get("bytes_sent", 0),
        "ddp_equivalent_bytes": totals.get("ddp_equivalent_bytes", 0),
        "compute_utilization": totals.get("compute_utilization", 0.0),
        "consistent": consistent,
        "final_hashes": digests,
        "wall_s": round(time.monotonic() - started, 1),
        "workdir": str(workdir),
    }


def _follow(
    join: str, procs: list[subprocess.Popen], console: Console, *, rounds: int, deadline: float
) -> Optional[dict[str, Any]]:
    """Show the run's progress (a bar on a terminal, else a line per committed round) until it finishes;
    return the last status seen."""
    from swarm.control.client import CoordinatorClient, CoordinatorError
    from swarm.control.joinstring import JoinString

    client = CoordinatorClient(JoinString.parse(join))
    last: Optional[dict[str, Any]] = None
    try:
        with RunProgress(rounds, what="rounds committed", console=console) as progress:
            while time.monotonic() < deadline:
                try:
                    last = status_to_dict(client.get_status())
                except CoordinatorError:
                    if all(p.poll() is not None for p in procs):
                        return last
                    time.sleep(1.0)  # a progress display's refresh period
                    continue
                run, totals = last["run"], last["totals"]
                live = sum(1 for p in last["peers"] if p["state"] not in ("left", "evicted"))
                progress.update(
                    run["rounds_committed"],
                    eval=_loss(run["eval_loss"]),
                    train=_loss(run["loss"]),
                    peers=str(live),
                    sent=format_bytes(totals["bytes_sent"]),
                    θg=run["committed_hash"] or "—",
                )
                if run["finished"] or all(p.poll() is not None for p in procs):
                    return last
                time.sleep(1.0)  # a progress display's refresh period
        raise RuntimeError("the run did not finish within the demo timeout")
    finally:
        client.close()


def _loss(value: Optional[float]) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"


def _final_status(join: str) -> Optional[dict[str, Any]]:
    from swarm.control.client import CoordinatorClient, CoordinatorError
    from swarm.control.joinstring import JoinString

    client = CoordinatorClient(JoinString.parse(join), request_timeout_s=5)
    try:
        return status_to_dict(client.get_status())
    except CoordinatorError:
        return None
    finally:
        client.close()


def _final_eval_loss(path: Path, options: DemoOptions) -> float:
    import dataclasses

    from swarm.config import RunConfig
    from swarm.train.model.final_model import final_eval_loss

    run = RunConfig()
    return final_eval_loss(path, run.replace(model=dataclasses.replace(run.model, preset=options.preset)))


def _print_summary(summary: dict[str, Any], console: Console) -> None:
    table = Table(title="swarm demo — summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    fmt = lambda v: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"  # noqa: E731
    table.add_row("rounds committed", str(summary["rounds_committed"]))
    table.add_row("eval loss (nats/byte)", f"{fmt(summary['initial_eval_loss'])} → {fmt(summary['final_eval_loss'])}")
    table.add_row("peers (exit codes)", f"{summary['peers']} {summary['peer_exit_codes']}")
    sent, ddp = summary["bytes_sent_total"], summary["ddp_equivalent_bytes"]
    ratio = f" ({ddp / sent:,.0f}× less)" if sent and ddp else ""
    table.add_row("bytes sent", f"{format_bytes(sent)} vs {format_bytes(ddp)} for data-parallel{ratio}")
    table.add_row("compute utilization", f"{100 * summary['compute_utilization']:.1f}%")
    table.add_row("final θg identical on all peers", "yes" if summary["consistent"] else "[red]NO[/red]")
    table.add_row("wall time", f"{summary['wall_s']:.0f} s")
    console.print(table)
