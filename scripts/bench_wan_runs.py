"""The sections of scripts/bench_wan.py that run a real swarm on the testbed: the normal `swarm coordinator` and
`swarm peer` processes, one per host, read back through their logs and `swarm status --json`."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from testbed import Testbed, make_topology  # noqa: E402
from testbed.processes import TWO_PEER_RUN, kill_family, read_join_string  # noqa: E402

PREFIX = os.environ.get("SWARM_BENCH_PREFIX", "swb-")  # bench_wan.py's: its teardown removes these
P2P_PORT = 7100  # each host is a namespace of its own, so every peer can take the same port

UTILIZATION_RUN = """
[model]
preset = "tiny"

[rounds]
inner_steps = {inner_steps}
max_rounds = {rounds}
min_peers = 4
matchmaking_window_s = 20.0
exchange_timeout_s = 60.0
round_timeout_s = 120.0
"""


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))


def _coordinator(
    bed: Testbed, work: Path, config: str, log: Path, grace_s: float, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    (work / "run.toml").write_text(config)
    with open(log, "wb") as err:
        proc = bed.spawn(
            "h0",
            [
                sys.executable,
                "-m",
                "swarm.app.cli",
                "coordinator",
                "--config",
                str(work / "run.toml"),
                "--host",
                "0.0.0.0",
                "--announce-host",
                bed.address("h0"),
                "--state-dir",
                str(work / "coordinator"),
                "--exit-grace-s",
                str(grace_s),
                *extra,
            ],
            cwd=work,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=err,
        )
    return proc, read_join_string(proc, timeout_s=60, log=log)


def _peer(bed: Testbed, host: str, work: Path, join: str, extra: list[str]) -> subprocess.Popen:
    (work / host).mkdir()
    with open(work / f"{host}.log", "wb") as out:
        return bed.spawn(
            host,
            [sys.executable, "-m", "swarm.app.cli", "peer", "--join", join, "--device", "cpu", *extra],
            cwd=work / host,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def section_nat(args: argparse.Namespace) -> dict:
    """tests/integration/test_nat.py's run: a coordinator on h0, bare peers on h1 and behind two NATs (nat, nat1:
    routers of their own, so those two reach each other only through the coordinator's relay)."""
    work = Path(tempfile.mkdtemp(prefix="bench-nat-"))
    procs: list[subprocess.Popen] = []
    hosts = ("h1", "nat", "nat1")
    with Testbed(make_topology(hosts=2, nat_hosts=2, prefix=PREFIX)) as bed:
        try:
            config = TWO_PEER_RUN.replace("min_peers = 2", f"min_peers = {len(hosts)}")
            coordinator, join = _coordinator(bed, work, config, work / "coordinator.log", grace_s=0)
            procs.append(coordinator)
            procs += [_peer(bed, host, work, join, []) for host in hosts]
            _wait_all(procs[1:], 120)
        finally:
            for proc in procs:
                kill_family(proc)
    decided = re.findall(
        r"round (\d+): committed: \d+ of \d+ group members agree on ([0-9a-f]+)",
        (work / "coordinator.log").read_text(errors="replace"),
    )
    last = max(decided, key=lambda d: int(d[0])) if decided else None
    out: dict = {"rounds_committed": len(decided), "logs": str(work)}
    for host in ("nat", "nat1"):
        log = (work / f"{host}.log").read_text(errors="replace")
        committed = dict(re.findall(r"r(\d+)\] committed, hash ([0-9a-f]+)", log))
        key = "" if host == "nat" else f"_{host}"
        out[f"rounds_joined{key}"] = len(committed)
        out[f"on_committed_hash{key}"] = bool(last and committed.get(last[0], "").startswith(last[1]))
        out[f"relayed{key}"] = "through the coordinator's relay" in log
    return out


def _status(bed: Testbed, join: str) -> dict | None:
    """`swarm status --json` from h0, or None when it gave no answer within 60 s (a loaded machine)."""
    try:
        out = bed.run(
            "h0",
            [sys.executable, "-m", "swarm.app.cli", "status", join, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
        )
    except subprocess.TimeoutExpired:
        return None
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return None


def run_swarm(
    bed: Testbed,
    work: Path,
    config: str,
    hosts: list[str],
    *,
    peer_args=lambda host: [],
    on_status=None,
    timeout_s: float = 600,
    poll_s: float = 2.0,
    coordinator_args: tuple[str, ...] = (),
) -> bool:
    """A coordinator on h0 (with ``coordinator_args``, e.g. ``("--lease-s", "60")``) and a peer on each of
    ``hosts`` until the peers exit (max_rounds) or ``timeout_s``; ``on_status(status)`` sees each
    `swarm status --json` meanwhile (not asked without ``on_status``). Everything started is ended on return.
    True when every peer exited on its own before ``timeout_s``."""
    procs: list[subprocess.Popen] = []
    try:
        coordinator, join = _coordinator(
            bed, work, config, work / "coordinator.log", grace_s=60, extra=coordinator_args
        )
        procs.append(coordinator)
        peers = [_peer(bed, host, work, join, peer_args(host)) for host in hosts]
        procs += peers
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(p.poll() is None for p in peers):
            status = _status(bed, join) if on_status is not None else None
            if status:
                on_status(status)
            time.sleep(poll_s)  # status is a poll of the coordinator; there is nothing to await
        return all(p.poll() is not None for p in peers)
    finally:
        for proc in procs:
            kill_family(proc)


def history(work: Path) -> dict:
    """`swarm history STATE_DIR --json` of a finished run: {"rounds": [...], "peer_rounds": [...]}."""
    out = subprocess.run(
        [sys.executable, "-m", "swarm.app.cli", "history", str(work / "coordinator"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=work,
    )
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"rounds": [], "peer_rounds": [], "error": out.stderr.strip()[-500:]}


def compute_share(record: dict, *, skip: int = 1) -> float | None:
    """Each round's mean inner seconds over its peers, summed from round ``skip`` + 1 on, over the time from that
    round's opening to the last decision. Biased high with overlap: a round's first steps train before it opens
    (while the previous round's exchange runs), so they fall outside the window (1.049 on one run); kept for
    comparison with figures taken this way. ``_shares`` is the measure."""
    rows = [r for r in record.get("rounds", []) if r.get("round", 0) > skip and r.get("outcome") == "committed"]
    inner: dict[int, list[float]] = {}
    for p in record.get("peer_rounds", []):
        if p.get("inner_s") is not None:
            inner.setdefault(p["round"], []).append(p["inner_s"])
    if not rows or not all(r["round"] in inner for r in rows):
        return None
    span = rows[-1]["decided_at"] - rows[0]["opened_at"]
    busy = sum(sum(inner[r["round"]]) / len(inner[r["round"]]) for r in rows)
    return round(busy / span, 3) if span > 0 else None


def _shares(first: dict, last: dict) -> list[float]:
    """Each peer's inner seconds over its wall seconds between two `swarm status` polls. Both numbers come from
    the same heartbeat of the peer, and a peer's inner seconds grow a step at a time (the trainer's clock), so
    the share is exact to a step: the window is from round 2's opening to the last round's (``steady_end``) or
    to the end."""
    start, end = _peer_times(first), _peer_times(last)
    return [
        (end[p][0] - start[p][0]) / (end[p][1] - start[p][1]) for p in start if p in end and end[p][1] > start[p][1]
    ]


def _peer_times(status: dict) -> dict[str, tuple[float, float]]:
    return {
        p["id"]: (p.get("metrics", {}).get("inner_time_s", 0.0), p.get("metrics", {}).get("wall_time_s", 0.0))
        for p in status.get("peers", [])
    }


def _proxies(bed: Testbed, hosts: list[str], one_way_ms: float) -> list[subprocess.Popen]:
    """A delay proxy on each host's address in front of its peer's libp2p port on loopback."""
    procs = []
    for host in hosts:
        proxy = bed.spawn(
            host,
            [
                sys.executable,
                "-m",
                "testbed.delay_proxy",
                "--listen",
                f"{bed.address(host)}:{P2P_PORT}",
                "--to",
                f"127.0.0.1:{P2P_PORT}",
                "--delay-ms",
                str(one_way_ms),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        proxy.stdout.readline()  # its port: listening
        procs.append(proxy)
    return procs


def section_utilization(
    args: argparse.Namespace,
    *,
    peers: int = 4,
    mbit: float = 100,
    one_way_ms: float = 50,
    rounds: int = 5,
    inner_steps: int = 60,
    extra_rounds: str = "",
) -> dict:
    """4 peers at ``mbit`` whose libp2p traffic all passes a 50 ms delay proxy: each peer listens on
    loopback and announces its host's address, where a delay proxy forwards to it. Utilization is the share of
    wall time the peers spent in inner steps between the first committed round and the end, from
    `swarm status --json`. ``extra_rounds``: more [rounds] lines (the controller, overlap)."""
    work = Path(tempfile.mkdtemp(prefix="bench-util-"))
    hosts = [f"h{i}" for i in range(1, peers + 1)]
    seen: dict[str, dict] = {}

    def on_status(status: dict) -> None:
        committed = status.get("run", {}).get("rounds_committed", 0)
        if committed >= 1:
            seen.setdefault("first", status)  # round 2 open
            seen["last"] = status
        if committed >= rounds - 1:
            seen.setdefault("steady_end", status)  # the last round open: its final exchange is not in the window

    with Testbed(make_topology(hosts=peers + 1, mbit=mbit, prefix=PREFIX)) as bed:
        proxies = _proxies(bed, hosts, one_way_ms)
        try:
            run_swarm(
                bed,
                work,
                UTILIZATION_RUN.format(inner_steps=inner_steps, rounds=rounds) + extra_rounds,
                hosts,
                peer_args=lambda host: [
                    "--p2p-host",
                    "127.0.0.1",
                    "--p2p-port",
                    str(P2P_PORT),
                    "--announce-host",
                    bed.address(host),
                    "--threads",
                    "1",
                ],
                on_status=on_status,
            )
        finally:
            for proxy in proxies:
                kill_family(proxy)
    result = {"peers": peers, "mbit": mbit, "one_way_ms": one_way_ms, "inner_steps": inner_steps, "logs": str(work)}
    if "first" not in seen:
        return dict(result, utilization=None, error="no round committed; see the logs")
    first, last = seen["first"], seen["last"]
    steady = _shares(first, seen.get("steady_end", last))
    whole = _shares(first, last)
    record = history(work)
    rows = record["rounds"]
    return dict(
        result,
        utilization=round(sum(steady) / len(steady), 3) if steady else None,
        utilization_to_end=round(sum(whole) / len(whole), 3) if whole else None,
        history_share=compute_share(record),
        rounds_committed=last["run"].get("rounds_committed"),
        rounds_voided=last["run"].get("rounds_voided"),
        per_peer=[round(s, 3) for s in steady],
        status_utilization=last.get("totals", {}).get("compute_utilization"),
        codecs=[r.get("codec") for r in rows],
        exchange_s=[round(r.get("exchange_s") or 0, 2) for r in rows],
        controller=(last["run"].get("controller") or {}).get("reason"),
    )


CONTROLLED = """controller = "auto"
fragments = {fragments}
overlap_steps = {overlap}
eval_every_rounds = {rounds}
"""


def section_utilization_controlled(args: argparse.Namespace) -> dict:
    """The WAN utilization setup with the controller and overlap: 4 peers, 50 ms one-way, the link scaled so that one
    fp32 exchange of `tiny` takes ~20% of a round (`small` does not run 4 peers on 2 shared cores here);
    evaluation only after the last round, so the share measured is training against exchanging."""
    rounds, inner_steps = 6, 60
    extra = CONTROLLED.format(fragments=1, overlap=20, rounds=rounds)
    return dict(
        section_utilization(args, mbit=args.util_mbit, rounds=rounds, inner_steps=inner_steps, extra_rounds=extra),
        controller_config=extra.strip().splitlines(),
    )
