#!/usr/bin/env python3
"""Swarm over emulated WAN links: its exchange beside stock hivemind and raw TCP on tbf-shaped
testbed links, the network model's calibration, a peer behind NAT, and real swarms (the controller adapting to a
link cut 10x, two-level averaging across two sites, utilization with overlap). Needs root (network namespaces).

    .venv/bin/python scripts/bench_wan.py --json                                   # every section
    .venv/bin/python scripts/bench_wan.py --sections exchange --mbit 100 --peers 2 4 --codecs fp32
    .venv/bin/python scripts/bench_wan.py --sections sim_wan_calibration,nat
    .venv/bin/python scripts/bench_wan.py --json --sections adaptation,hierarchical,utilization_under_wan

One worker process per testbed host (scripts/bench_wan_worker.py); every timed exchange starts at the
same wall-clock moment on all hosts and takes as long as its slowest host. With --json the last stdout
line is one JSON object, one key per section; otherwise a table per section. The testbed is torn down
on every exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_wan_adapt import section_adaptation  # noqa: E402  (scripts/, beside this file)
from bench_wan_runs import section_nat, section_utilization, section_utilization_controlled  # noqa: E402
from bench_wan_sites import section_hierarchical  # noqa: E402
from testbed import Testbed, make_topology, missing_privileges, teardown  # noqa: E402

from swarm.core.codecs.codec import CODECS  # noqa: E402
from swarm.net.bulk.tcp_congestion import CONGESTION_CONTROL, congestion_problem  # noqa: E402
from swarm.train.simulator.network_model import Costs, butterfly, ideal_exchange_s, make_peers  # noqa: E402

PREFIX = os.environ.get("SWARM_BENCH_PREFIX", "swb-")  # every namespace of this benchmark; teardown removes only these
WORKER = ROOT / "scripts" / "bench_wan_worker.py"
NUMEL = {20: 1_250_000, 100: 6_250_000, 1000: 25_000_000}  # fp32: ~3 s at the link rate for 4 peers (1.2 s at 1G)
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Hosts:
    """One bench worker per testbed host, spoken to in JSON lines."""

    def __init__(self, bed: Testbed, names: list[str]) -> None:
        self.bed, self.names, self.procs, self.hello = bed, names, [], []
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for i, name in enumerate(names):
            boot = self.hello[0]["maddrs"] if self.hello else []
            proc = bed.spawn(
                name,
                [sys.executable, str(WORKER), "--host", bed.address(name), "--index", str(i), "--bootstrap", *boot],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            self.procs.append(proc)
            self.hello.append(self._read(proc))

    def _read(self, proc: subprocess.Popen) -> dict:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a bench worker exited with {proc.wait()} before replying (its stderr is above)")
        return json.loads(line)

    def ask(self, cmds: list[dict] | dict) -> list[dict]:
        cmds = cmds if isinstance(cmds, list) else [cmds] * len(self.procs)
        for proc, cmd in zip(self.procs, cmds):
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        return [self._read(p) for p in self.procs]

    def timed(self, cmd: dict, lead_s: float = 2.0) -> tuple[float | None, list[dict]]:
        """Every host starts ``cmd`` at the same moment; the exchange takes as long as the slowest."""
        replies = self.ask(dict(cmd, at=time.time() + lead_s))
        if any(r.get("seconds") is None for r in replies):
            return None, replies
        return max(r["seconds"] for r in replies), replies

    def identical(self) -> bool:
        """Whether every host holds the same bits after the last exchange (hashed after the clocks stopped)."""
        digests = {r["digest"] for r in self.ask({"cmd": "digest"})}
        return len(digests) == 1 and None not in digests

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds used so far in the hosts' namespaces, split into p2pd (libp2p) and the rest (Python)."""
        split = {"p2pd": 0.0, "python": 0.0}
        for name in self.names:
            pids = subprocess.run(
                ["ip", "netns", "pids", self.bed.topology.namespace(name)], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
                split["p2pd" if "p2pd" in comm else "python"] += (int(fields[11]) + int(fields[12])) / CLK_TCK
        return split

    def close(self) -> None:
        for proc in self.procs:
            try:
                proc.stdin.close()
                proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()


def _row(system: str, peers: int, mbit: float, codec: str, payload: int, times: list[float], **extra) -> dict:
    ideal = ideal_exchange_s(payload, peers, mbit) if mbit else None  # unshaped: no link rate to compare with
    measured = statistics.median(times) if times else None
    return {
        "system": system,
        "peers": peers,
        "mbit": mbit,
        "codec": codec,
        "payload_bytes": payload,
        "ideal_s": round(ideal, 3) if ideal else None,
        "measured_s": round(measured, 3) if measured else None,
        "ratio_to_ideal": round(measured / ideal, 2) if measured and ideal else None,
        "repeats": len(times),
        **extra,
    }


# Swarm's exchange as each system name runs it: over the bulk channel or libp2p only, sending all at once or in turn.
SWARM_SYSTEMS = {
    "swarm": {"bulk": True, "in_turn": False},
    "swarm-libp2p": {"bulk": False, "in_turn": False},
    "swarm-in-turn": {"bulk": True, "in_turn": True},
    "swarm-paced": {"bulk": True, "in_turn": False},
}


def _swarm_rows(
    hosts: Hosts, peers: int, mbit: float, codec: str, numel: int, repeats: int, tag: str, system: str = "swarm"
) -> dict:
    options = SWARM_SYSTEMS[system]
    cmd = {
        "cmd": "swarm",
        "group": [h["dht_peer_id"] for h in hosts.hello],
        "numel": numel,
        "codec": codec,
        "bulk": [h["bulk"] if options["bulk"] else "" for h in hosts.hello],
        "in_turn": options["in_turn"],
        # swarm-paced: each bulk connection at most its share of the link (K−1 flows leave each host)
        "pace_mbit": 0.95 * mbit / (peers - 1) if system == "swarm-paced" and mbit and peers > 1 else 0,
    }
    tag = f"{tag}.{system}"
    # untimed: each host makes its vector and the hosts' connections open, as in a running swarm
    hosts.timed(dict(cmd, key=f"bench.{tag}.{codec}.warm"))
    times, identical, late, inside, phases, used = [], True, [0.0], [], [], {"p2pd": 0.0, "python": 0.0}
    for rep in range(repeats):
        before = hosts.cpu_s()
        seconds, replies = hosts.timed(dict(cmd, key=f"bench.{tag}.{codec}.{rep}"))
        if seconds is None:
            log(f"  swarm rep {rep} failed: {replies}")
            continue
        after = hosts.cpu_s()
        used = {k: v + after[k] - before[k] for k, v in used.items()}  # the exchange's, not the digest's
        times.append(seconds)
        identical &= hosts.identical()
        late += [r["late_s"] for r in replies]
        inside.append(max(r["inside_s"] for r in replies))
        phases.append({name: max(r["phases_s"].get(name, 0.0) for r in replies) for name in replies[0]["phases_s"]})
    cpu = {k: round(v / max(1, len(times)), 2) for k, v in used.items()}
    return _row(
        system,
        peers,
        mbit,
        codec,
        CODECS[codec].encoded_size(numel),
        times,
        identical=identical,
        cpu_s_per_exchange=cpu,
        exchange_own_s=round(statistics.median(inside), 3) if inside else None,
        # the slowest host's passing of each point of the exchange, median over repeats
        phases_s={name: round(statistics.median(p[name] for p in phases), 3) for name in phases[0]} if phases else {},
        late_s=round(max(late), 3),
    )


def _tcp_row(
    hosts: Hosts, peers: int, mbit: float, codec: str, numel: int, repeats: int, in_turn: bool = False
) -> dict:
    payload = CODECS[codec].encoded_size(numel)
    times = [
        hosts.timed({"cmd": "tcp", "slice_bytes": payload // peers, "in_turn": in_turn})[0] for _ in range(repeats)
    ]
    return _row("tcp-in-turn" if in_turn else "tcp", peers, mbit, codec, payload, [t for t in times if t is not None])


def _hivemind_row(hosts: Hosts, peers: int, mbit: float, codec: str, numel: int, repeats: int, tag: str) -> dict:
    payload = CODECS[codec].encoded_size(numel)
    if codec != "fp32":
        return _row("hivemind", peers, mbit, codec, payload, [], note=f"stock hivemind has no {codec} codec")
    hosts.ask({"cmd": "hm_open", "numel": numel, "peers": peers, "prefix": f"hm{tag}"})
    times, identical = [], True
    try:
        for rep in range(repeats):
            if not all(r.get("ok") for r in hosts.ask({"cmd": "hm_arm"})):
                log(f"  hivemind rep {rep}: no group formed")
                continue
            seconds, replies = hosts.timed({"cmd": "hm_go"})
            if seconds is None:
                log(f"  hivemind rep {rep} failed: {replies}")
                continue
            times.append(seconds)
            identical &= hosts.identical()
    finally:
        hosts.ask({"cmd": "hm_close"})
    return _row("hivemind", peers, mbit, codec, payload, times, identical=identical)


def measure_exchange(
    mbit: float | None, peers: int, codecs: list[str], systems: list[str], repeats: int, numel: int
) -> list[dict]:
    rows = []
    with Testbed(make_topology(hosts=peers, mbit=mbit, prefix=PREFIX)) as bed:
        hosts = Hosts(bed, [f"h{i}" for i in range(peers)])
        try:
            hosts.ask(
                [
                    {
                        "cmd": "tcp_connect",
                        "peers": [[bed.address(n), h["tcp_port"]] for n, h in zip(hosts.names, hosts.hello)],
                    }
                ]
                * peers
            )
            for codec in codecs:
                tag = f"{mbit}.{peers}"
                for system in systems:
                    row = {
                        **{
                            name: lambda name=name: _swarm_rows(
                                hosts, peers, mbit or 0, codec, numel, repeats, tag, name
                            )
                            for name in SWARM_SYSTEMS
                        },
                        "tcp": lambda: _tcp_row(hosts, peers, mbit or 0, codec, numel, repeats),
                        "tcp-in-turn": lambda: _tcp_row(hosts, peers, mbit or 0, codec, numel, repeats, True),
                        "hivemind": lambda: _hivemind_row(
                            hosts, peers, mbit or 0, codec, numel, repeats, f"{tag}{codec}".replace(".", "_")
                        ),
                    }[system]()
                    log(f"  {row}")
                    rows.append(row)
        finally:
            hosts.close()
    return rows


def section_exchange(args: argparse.Namespace) -> list[dict]:
    rows = []
    for mbit in args.mbit:
        for peers in args.peers:
            log(f"exchange: {peers} peers at {mbit} Mbit/s")
            rows += measure_exchange(
                mbit, peers, args.codecs, args.systems, args.repeats, args.numel or NUMEL.get(int(mbit), 6_250_000)
            )
    return rows


def codec_cpu_s_per_byte(codec: str, numel: int = 4_000_000, peers: int = 4) -> float:
    """CPU seconds of one peer's encode + reduce + decode per encoded payload byte (CPU time, not wall time:
    the machine's other load must not count)."""
    import torch

    from swarm.core.aggregation import Aggregation
    from swarm.net.exchange.slices.reduction import reduce_slice

    torch.set_num_threads(1)
    c, flat = CODECS[codec], torch.randn(numel)
    start = time.process_time()
    data = c.encode(flat)
    part = numel // peers
    reduce_slice(Aggregation(), c, [c.encode(flat[:part])] * peers, [1.0] * peers, part, "calibration")
    c.decode(data, numel)
    return (time.process_time() - start) / c.encoded_size(numel)


def section_calibration(args: argparse.Namespace) -> dict:
    """Measure what the model needs, then predict the 4-peer exchange at 100 Mbit/s and compare:
    - the codec's CPU per byte (here, in CPU time);
    - the transport's CPU per byte sent or received (the hosts' CPU time in an unshaped 4-peer exchange, from
      /proc, less the codec's);
    - the links' payload efficiency under the butterfly's concurrent flows (raw TCP in the same pattern).
    The hosts share this machine's cores, so CPU costs count ``peers / cores`` times as wall time."""
    peers, mbit, codec, numel = 4, 100, "fp32", NUMEL[100]
    payload = CODECS[codec].encoded_size(numel)
    contention = max(1.0, peers / (os.cpu_count() or 1))
    codec_cpu = codec_cpu_s_per_byte(codec)
    log("sim_wan_calibration: 4 peers unshaped (the transport's CPU per byte)")
    unshaped = measure_exchange(None, peers, [codec], ["swarm"], args.repeats, numel)[0]
    moved = 2 * (peers - 1) / peers * payload  # per peer, both phases, each way
    cpu_s = sum(unshaped["cpu_s_per_exchange"].values())  # all hosts, per exchange
    transport_cpu = max(0.0, cpu_s - peers * codec_cpu * payload) / (peers * 2 * moved)
    log("sim_wan_calibration: 4 peers at 100 Mbit/s, swarm and raw TCP")
    rows = {r["system"]: r for r in measure_exchange(mbit, peers, [codec], ["swarm", "tcp"], args.repeats, numel)}
    measured, efficiency = rows["swarm"]["measured_s"], rows["tcp"]["ideal_s"] / rows["tcp"]["measured_s"]
    costs = Costs(
        codec_s_per_byte=codec_cpu * contention,
        transport_s_per_byte=transport_cpu * contention,
        link_efficiency=efficiency,
    )
    predicted = butterfly(payload, make_peers(peers, up_mbit=mbit), costs).seconds
    return {
        "peers": peers,
        "mbit": mbit,
        "codec": codec,
        "payload_bytes": payload,
        "codec_cpu_s_per_byte": codec_cpu,
        "transport_cpu_s_per_byte": transport_cpu,
        "contention": contention,
        "unshaped_s": unshaped["measured_s"],
        "unshaped_cpu_s": cpu_s,
        "link_efficiency": round(efficiency, 3),
        "tcp_s": rows["tcp"]["measured_s"],
        "swarm_cpu_s": rows["swarm"]["cpu_s_per_exchange"],
        "predicted_s": round(predicted, 3),
        "measured_s": measured,
        "error": round(predicted / measured - 1, 3) if measured else None,
    }


STRAGGLER = ROOT / "scripts" / "bench_straggler.py"


def section_straggler(args: argparse.Namespace) -> dict:
    """scripts/bench_straggler.py's measurement (loopback, one peer 3x slower), run once for both keys; its
    last stdout line with --json is one JSON object carrying them."""
    if "straggler" not in _cache:
        if not STRAGGLER.exists():
            _cache["straggler"] = {"skipped": "scripts/bench_straggler.py is not in this checkout yet"}
        else:
            out = subprocess.run(
                [sys.executable, str(STRAGGLER), "--json"], capture_output=True, text=True, cwd=ROOT, timeout=3600
            )
            lines = out.stdout.strip().splitlines()
            try:
                _cache["straggler"] = json.loads(lines[-1])
            except (json.JSONDecodeError, IndexError):
                _cache["straggler"] = {"error": f"bench_straggler.py exited {out.returncode}: {out.stderr[-500:]}"}
    return _cache["straggler"]


def straggler_key(key: str):
    def section(args: argparse.Namespace):
        result = section_straggler(args)
        return result.get(key, result) if isinstance(result, dict) else result

    return section


_cache: dict[str, dict] = {}  # bench_straggler.py's one run, shared by both straggler_* keys


SECTIONS = {
    "exchange": section_exchange,
    "sim_wan_calibration": section_calibration,
    "nat": section_nat,  # bench_wan_runs.py: real coordinator and peer processes on the testbed
    "utilization_under_wan": section_utilization_controlled,  # the controller and overlap
    "utilization_baseline": section_utilization,  # fixed H, no overlap, no controller, 100 Mbit/s
    "straggler_throughput_ratio": straggler_key("straggler_throughput_ratio"),  # scripts/bench_straggler.py
    "straggler_eval_loss_ratio": straggler_key("straggler_eval_loss_ratio"),
    "adaptation": section_adaptation,  # bench_wan_adapt.py
    "hierarchical": section_hierarchical,  # bench_wan_sites.py
}


def print_table(name: str, result) -> None:
    print(f"\n## {name}")
    if isinstance(result, list) and result:
        cols = ["system", "peers", "mbit", "codec", "payload_bytes", "ideal_s", "measured_s", "ratio_to_ideal"]
        print("  ".join(f"{c:>14}" for c in cols))
        for row in result:
            print("  ".join(f"{str(row.get(c)):>14}" for c in cols))
    else:
        print(json.dumps(result, indent=1))


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # unwinds through every Testbed's __exit__, which tears it down


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sections", default="exchange,sim_wan_calibration,nat", help=f"comma-separated, from {', '.join(SECTIONS)}"
    )
    parser.add_argument("--mbit", type=float, nargs="+", default=[20, 100, 1000])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--codecs", nargs="+", default=["fp32", "int4"], choices=sorted(CODECS))
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["swarm", "hivemind", "tcp"],
        choices=[*SWARM_SYSTEMS, "hivemind", "tcp", "tcp-in-turn"],
        help="swarm: over the bulk channel, every slice of a phase sent at once; swarm-libp2p: libp2p "
        "only; swarm-in-turn: bulk, one groupmate at a time; swarm-paced: bulk, each connection paced at "
        "0.95/(K-1) of the link; tcp: the butterfly's bytes on "
        "raw sockets, all at once; tcp-in-turn: the same, one groupmate at a time",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--numel", type=int, help="parameters per exchange (default: sized to the link rate)")
    parser.add_argument(
        "--util-mbit",
        type=float,
        default=4,
        help="utilization_under_wan's link rate: one fp32 exchange of `tiny` ~20%% of a round",
    )
    parser.add_argument(
        "--tcp-congestion",
        default=CONGESTION_CONTROL,
        help="congestion control of Swarm's bulk connections and of the raw TCP rows (default: "
        "Swarm's; 'system': the machine's default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    problem = congestion_problem(args.tcp_congestion)
    if problem:
        parser.error(problem)
    os.environ["SWARM_BENCH_TCP_CONGESTION"] = args.tcp_congestion  # the workers' (scripts/bench_wan_worker.py)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    why = missing_privileges(nat="nat" in sections)
    if why:
        print(f"bench_wan: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)  # also when started with SIGINT ignored (a background job)
    teardown(PREFIX)  # a previous run that was killed hard
    out = {}
    try:
        for name in sections:
            started = time.monotonic()
            try:
                out[name] = SECTIONS[name](args)
            except Exception as e:  # one broken section must not lose the others' measurements
                log(f"{name} failed: {e!r}")
                out[name] = {"error": repr(e)}
                teardown(PREFIX)
            log(f"{name}: {time.monotonic() - started:.0f} s")
            if not args.json:
                print_table(name, out[name])
    except KeyboardInterrupt:
        log("interrupted: the testbed is down")
        return 130
    finally:
        teardown(PREFIX)
    if args.json:
        print(json.dumps({**out, "tcp_congestion": args.tcp_congestion}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
