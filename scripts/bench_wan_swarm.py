#!/usr/bin/env python3
"""A real swarm across the WAN testbed's sites: a coordinator on h0 and one `swarm peer` (tiny preset,
`--threads 1`) on each of S sites x P hosts, 1 Gbit/s inside a site and a slower rate to and from every host of
another site (per host, each way: the testbed shapes each host's own link, not a shared site uplink), averaging in
two levels (`[rounds] hierarchical = true`, sub-groups of at most --group-size), until the run's last round.
Needs root (network namespaces).

    .venv/bin/python scripts/bench_wan_swarm.py --sites 2 --peers-per-site 3 --group-size 2 --rounds 3 --json
    .venv/bin/python scripts/bench_wan_swarm.py --sites 4 --peers-per-site 6 --group-size 6 --rounds 6 --json

With --json the last stdout line is one JSON object: rounds committed and voided and each decided round's
contributors (the coordinator's history), payload bytes per averaged round in-site and cross-site (the peers'
"averaged" lines) and every IP byte the peers sent in-site and cross-site (the testbed's traffic classes), the
distinct final models (tensors digests: 1 when every peer ended on the same θg), the peers' peak memory (the sum
of RSS and of PSS over every process in their namespaces), the load average and the wall time. Exit status 0 only
when every peer wrote a final model and all of them have the same tensors; 2 on bad input, 3 when memory stayed
short. The testbed's namespaces are removed on every exit, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import string
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from bench_wan_runs import history, run_swarm
from bench_wan_sites import EXCHANGE_LINE, _final_digest
from chaos import run_toml
from testbed import Testbed, make_topology, missing_privileges, teardown
from testbed.network import TestbedError

PREFIX = "sws-"  # this script's namespaces, apart from bench_wan.py's and wan_testbed.py's
GB = 2**30
SAMPLE_S = 10.0  # memory and load every this many seconds


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=2, help="sites (2 to 26)")
    parser.add_argument("--peers-per-site", type=int, default=3, help="peers (hosts) at each site")
    parser.add_argument(
        "--group-size",
        type=int,
        default=2,
        help="[rounds] group_size: a site's peers average in sub-groups of at most this many",
    )
    parser.add_argument("--rounds", type=int, default=3, help="[rounds] max_rounds")
    parser.add_argument("--inner-steps", type=int, default=10, help="[rounds] inner_steps")
    parser.add_argument("--in-site-mbit", type=float, default=1000.0, help="each host's link inside its site")
    parser.add_argument(
        "--cross-site-mbit",
        type=float,
        default=50.0,
        help="each host's rate to and from hosts of other sites, each way",
    )
    parser.add_argument("--flat", action="store_true", help="one flat group instead of two levels (for comparison)")
    parser.add_argument(
        "--lease-s", type=float, default=60.0, help="the coordinator's --lease-s (a loaded machine delays heartbeats)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="one more key of the run config, a TOML value (repeatable); wins over the defaults, "
        "e.g. --set rounds.exchange_timeout_s=300",
    )
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="stop the swarm after this long")
    parser.add_argument(
        "--need-gb", type=float, default=None, help="memory available before starting (default 0.45 GB per peer + 1 GB)"
    )
    parser.add_argument(
        "--wait-memory-s", type=float, default=1200.0, help="how long to wait for that memory, checking every 30 s"
    )
    parser.add_argument("--workdir", help="an empty or new directory for the logs (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="only the summary, one JSON line, on stdout")
    args = parser.parse_args(argv)
    peers = args.sites * args.peers_per_site
    checks = (
        (2 <= args.sites <= len(string.ascii_lowercase), f"--sites must be between 2 and 26, got {args.sites}"),
        (args.peers_per_site >= 1, f"--peers-per-site must be at least 1, got {args.peers_per_site}"),
        (peers <= 199, f"--sites x --peers-per-site must be at most 199 hosts, got {peers}"),
        (args.group_size >= 1, f"--group-size must be at least 1, got {args.group_size}"),
        (args.rounds >= 1, f"--rounds must be at least 1, got {args.rounds}"),
        (args.inner_steps >= 1, f"--inner-steps must be at least 1, got {args.inner_steps}"),
        (_positive(args.in_site_mbit), f"--in-site-mbit must be a positive rate, got {args.in_site_mbit}"),
        (_positive(args.cross_site_mbit), f"--cross-site-mbit must be a positive rate, got {args.cross_site_mbit}"),
        (_positive(args.lease_s), f"--lease-s must be a positive number of seconds, got {args.lease_s}"),
        (_positive(args.timeout_s), f"--timeout-s must be a positive number of seconds, got {args.timeout_s}"),
        (args.need_gb is None or args.need_gb >= 0, f"--need-gb must not be negative, got {args.need_gb}"),
    )
    for ok, message in checks:
        if not ok:
            parser.error(message)
    if args.need_gb is None:
        args.need_gb = round(0.45 * peers + 1, 1)
    return args


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def site_of_hosts(sites: int, per_site: int) -> dict[str, str]:
    """h1, h2, ... by site: the first ``per_site`` hosts at site "a", the next at "b", ... (h0: the coordinator)."""
    return {f"h{1 + s * per_site + i}": string.ascii_lowercase[s] for s in range(sites) for i in range(per_site)}


def run_config(args: argparse.Namespace) -> str:
    """The run's TOML: the tiny model, every peer in round 1, timeouts for many peers on two shared cores, the
    evaluation only after the last round; then ``--set`` keys, which win."""
    rounds: dict[str, object] = {
        "inner_steps": args.inner_steps,
        "max_rounds": args.rounds,
        "min_peers": args.sites * args.peers_per_site,
        "matchmaking_window_s": 30.0,
        "exchange_timeout_s": 120.0,
        "round_timeout_s": 400.0,
        "straggler_slack_s": 30.0,
        "eval_every_rounds": args.rounds,
        "hierarchical": "false" if args.flat else "true",
    }
    if not args.flat:
        rounds["group_size"] = args.group_size
    return '[model]\npreset = "tiny"\n\n' + run_toml(rounds, args.set)


def check_config(text: str) -> str | None:
    """Why the run config would be refused, in one sentence, or None."""
    from swarm.config import ConfigError
    from swarm.config.run import load_run_config

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.toml"
        path.write_text(text)
        try:
            load_run_config(path)
        except ConfigError as e:
            return f"the run config is refused: {e}"
    return None


def wait_for_memory(need_gb: float, wait_s: float, say) -> bool:
    """Whether ``need_gb`` of memory is available, checking every 30 s for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        available = psutil.virtual_memory().available / GB
        if available >= need_gb:
            return True
        if time.monotonic() >= deadline:
            return False
        say(f"{available:.1f} GB available, {need_gb:.1f} GB needed; checking again in 30 s")
        time.sleep(30)  # another job's memory: nothing to await but its end


class Sampler(threading.Thread):
    """Every SAMPLE_S: the RSS and PSS summed over every process inside the peers' namespaces and inside the
    coordinator's, the machine's memory in use and the 1-minute load average; the peaks and the loads kept."""

    def __init__(self, namespaces: dict[str, str], coordinator_ns: str) -> None:
        super().__init__(daemon=True)
        self.inodes = {_netns_inode(ns): "peers" for ns in namespaces.values()}
        self.inodes[_netns_inode(coordinator_ns)] = "coordinator"
        self.stop = threading.Event()
        self.peak = {"peers_rss": 0, "peers_pss": 0, "coordinator_rss": 0, "machine_used": 0}
        self.load: list[float] = []
        self.samples = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(SAMPLE_S)

    def sample(self) -> None:
        sums = {"peers_rss": 0, "peers_pss": 0, "coordinator_rss": 0}
        for proc in psutil.process_iter():
            try:
                where = self.inodes.get(_process_netns(proc.pid))
                if where is None:
                    continue
                info = proc.memory_full_info()
            except (psutil.Error, OSError):
                continue  # ended meanwhile
            if where == "peers":
                sums["peers_rss"] += info.rss
                sums["peers_pss"] += info.pss
            else:
                sums["coordinator_rss"] += info.rss
        memory = psutil.virtual_memory()
        sums["machine_used"] = memory.total - memory.available
        for key, value in sums.items():
            self.peak[key] = max(self.peak[key], value)
        self.load.append(os.getloadavg()[0])
        self.samples += 1


def _netns_inode(namespace: str) -> int:
    return os.stat(f"/run/netns/{namespace}").st_ino


def _process_netns(pid: int) -> int | None:
    link = os.readlink(f"/proc/{pid}/ns/net")  # "net:[4026532301]"
    return int(link[link.index("[") + 1 : -1]) if "[" in link else None


def summarize(
    *,
    record: dict,
    logs: dict[str, str],
    digests: dict[str, str | None],
    wire: dict[str, int],
    peaks: dict[str, int],
    load: list[float],
    wall_s: float,
    finished: bool,
) -> dict:
    """The report from a finished run: the coordinator's history (``record``: `swarm history --json`), each
    peer's log and final model's tensors digest (None: none written), the testbed's bytes, the sampled memory
    and load."""
    rounds = record.get("rounds", [])
    committed = [r for r in rounds if r.get("outcome") == "committed"]
    voided = [r for r in rounds if r.get("outcome") == "voided"]
    exchanges = [(int(n), int(a), int(b)) for log in logs.values() for n, a, b in EXCHANGE_LINE.findall(log)]
    averaged = sorted({n for n, _, _ in exchanges})
    models: dict[str, int] = {}
    for digest in digests.values():
        if digest is not None:
            models[digest] = models.get(digest, 0) + 1
    missing = sorted(h for h, d in digests.items() if d is None)
    return {
        "rounds_committed": len(committed),
        "rounds_voided": len(voided),
        "outcomes": "".join("c" if r.get("outcome") == "committed" else "v" for r in rounds),
        "contributors": [r.get("participants", 0) for r in committed],  # per committed round, in order
        "mean_contributors": round(statistics.mean(r.get("participants", 0) for r in committed), 2)
        if committed
        else None,
        "largest_group": max((r.get("group_size", 0) for r in rounds), default=0),
        "round_s": round(statistics.median(r["decided_at"] - r["opened_at"] for r in committed), 2)
        if committed
        else None,
        "exchange_s": round(statistics.median(r["exchange_s"] for r in committed), 2) if committed else None,
        "rounds_averaged": len(averaged),
        "in_site_bytes_per_round": sum(a for _, a, _ in exchanges) // max(1, len(averaged)),
        "cross_site_bytes_per_round": sum(b for _, _, b in exchanges) // max(1, len(averaged)),
        "in_site_wire_bytes": wire.get("in_site", 0),
        "cross_site_wire_bytes": wire.get("cross_site", 0),
        "final_models": models,
        "distinct_final_models": len(models),
        "missing_final_models": missing,
        "identical": len(models) == 1 and not missing,
        "peak_peers_rss_gb": round(peaks.get("peers_rss", 0) / GB, 2),
        "peak_peers_pss_gb": round(peaks.get("peers_pss", 0) / GB, 2),
        "peak_coordinator_rss_gb": round(peaks.get("coordinator_rss", 0) / GB, 2),
        "peak_machine_used_gb": round(peaks.get("machine_used", 0) / GB, 2),
        "load_1m": [round(min(load), 1), round(statistics.mean(load), 1), round(max(load), 1)] if load else None,
        "wall_s": round(wall_s, 1),
        "finished": finished,
    }


def measure(args: argparse.Namespace, work: Path, config: str, say) -> dict:
    sites = site_of_hosts(args.sites, args.peers_per_site)
    hosts = list(sites)
    topology = make_topology(
        hosts=len(hosts) + 1,
        mbit=args.in_site_mbit,
        sites=["", *sites.values()],
        cross_site_mbit=args.cross_site_mbit,
        prefix=PREFIX,
    )
    started = time.monotonic()
    with Testbed(topology) as bed:
        sampler = Sampler({h: topology.namespace(h) for h in hosts}, topology.namespace("h0"))
        sampler.start()
        try:
            say(f"testbed up: {len(hosts)} peers at {args.sites} sites; logs in {work}")
            finished = run_swarm(
                bed,
                work,
                config,
                hosts,
                timeout_s=args.timeout_s,
                poll_s=5.0,
                peer_args=lambda host: [
                    "--site",
                    sites[host],
                    "--name",
                    host,
                    "--threads",
                    "1",
                    "--join-timeout-s",
                    "600",
                ],
                coordinator_args=("--lease-s", str(args.lease_s)),
            )
        finally:
            sampler.stop.set()
            sampler.join(timeout=60)
        wire = {
            "in_site": sum(bed.in_site_bytes_sent(h) for h in hosts),
            "cross_site": sum(bed.cross_site_bytes_sent(h) for h in hosts),
        }
    wall_s = time.monotonic() - started
    logs = {h: (work / f"{h}.log").read_text(errors="replace") for h in hosts}
    digests = {h: _final_digest(work, h) for h in hosts}
    report = summarize(
        record=history(work),
        logs=logs,
        digests=digests,
        wire=wire,
        peaks=sampler.peak,
        load=sampler.load,
        wall_s=wall_s,
        finished=finished,
    )
    return {
        "sites": args.sites,
        "peers_per_site": args.peers_per_site,
        "peers": len(hosts),
        "group_size": None if args.flat else args.group_size,
        "hierarchical": not args.flat,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "in_site_mbit": args.in_site_mbit,
        "cross_site_mbit": args.cross_site_mbit,
        **report,
        "final_digest": {h: d or "missing" for h, d in digests.items()},
        "logs": str(work),
    }


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the same unwinding, the testbed torn down on the way out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(message: str) -> None:
        print(message, file=sys.stderr if args.json else sys.stdout, flush=True)

    config = run_config(args)
    refused = check_config(config) or missing_privileges(nat=False)
    if refused:
        print(f"bench_wan_swarm: {refused}", file=sys.stderr)
        return 2
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-wan-swarm-"))
    if work.exists() and any(work.iterdir()):
        print(f"bench_wan_swarm: --workdir {work} is not empty; give a new or empty directory", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    if not wait_for_memory(args.need_gb, args.wait_memory_s, say):
        print(
            f"bench_wan_swarm: {args.need_gb:.1f} GB of memory did not become available within "
            f"{args.wait_memory_s:.0f} s; try again when the machine is less busy",
            file=sys.stderr,
        )
        return 3
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        result = measure(args, work, config, say)
    except KeyboardInterrupt:
        print(f"bench_wan_swarm: interrupted; the testbed is removed, the logs stay in {work}", file=sys.stderr)
        return 130
    except TestbedError as e:
        print(f"bench_wan_swarm: the testbed could not be built: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        teardown(PREFIX)  # idempotent: what Testbed's exit did not get to
    print(json.dumps(result) if args.json else json.dumps(result, indent=1), flush=True)
    if not result["identical"]:
        print(
            f"bench_wan_swarm: the final models differ or are missing: {result['final_models']}, "
            f"missing on {result['missing_final_models'] or 'none'}; see {work}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
