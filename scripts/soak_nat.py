"""Usage: sudo .venv/bin/python scripts/soak_nat.py WORKDIR  (root: the WAN testbed)

NAT relay under faults: a public peer and two NAT peers; each NAT peer is SIGKILLed once mid-run and restarted
on its state dir; the coordinator is killed once and restarted. The run must commit every round, end identical."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wan_runs import _coordinator, _env, _peer, kill_family
from testbed import Testbed, make_topology

from swarm.train.model.final_model import tensors_digest

CONFIG = """[model]
preset = "tiny"
[rounds]
inner_steps = 10
max_rounds = 12
min_peers = 2
matchmaking_window_s = 10.0
exchange_timeout_s = 15.0
round_timeout_s = 60.0
"""
work = Path(sys.argv[1])
work.mkdir(parents=True, exist_ok=True)
hosts = ("h1", "nat", "nat1")


def committed() -> int:
    return len(re.findall(r"round \d+: committed", (work / "coordinator.log").read_text(errors="replace")))


def restart(bed, host, join):
    log = work / f"{host}.log"
    with open(log, "ab") as out:
        return bed.spawn(
            host,
            [sys.executable, "-m", "swarm.app.cli", "peer", "--join", join, "--device", "cpu"],
            cwd=work / host,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for(n, timeout=240):
    deadline = time.monotonic() + timeout
    while committed() < n and time.monotonic() < deadline:
        time.sleep(0.5)
    return committed()


with Testbed(make_topology(hosts=2, nat_hosts=2, prefix="swd-")) as bed:
    coord, join = _coordinator(bed, work, CONFIG, work / "coordinator.log", grace_s=30)
    procs = {h: _peer(bed, h, work, join, []) for h in hosts}
    events = []
    try:
        for victim, at in (("nat1", 3), ("nat", 6)):
            print("committed", wait_for(at), flush=True)
            kill_family(procs[victim])
            events.append(f"kill {victim} after {committed()}")
            time.sleep(1.0)
            procs[victim] = restart(bed, victim, join)
            events.append(f"restart {victim}")
        print("committed", wait_for(8), flush=True)
        kill_family(coord)
        events.append(f"kill coordinator after {committed()}")
        time.sleep(2.0)
        with open(work / "coordinator.log", "ab") as err:
            coord = bed.spawn(
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
                    "30",
                ],
                cwd=work,
                env=_env(),
                stdout=subprocess.PIPE,
                stderr=err,
            )
        events.append("restart coordinator")
        codes = {}
        for h, p in procs.items():
            try:
                codes[h] = p.wait(timeout=300)
            except subprocess.TimeoutExpired:
                codes[h] = None
    finally:
        for p in list(procs.values()) + [coord]:
            kill_family(p)
log = (work / "coordinator.log").read_text(errors="replace")
finals = {h: work / h / "swarm-peer" / "final" / "model.safetensors" for h in hosts}
digests = {h: tensors_digest(f) if f.exists() else None for h, f in finals.items()}
print(
    json.dumps(
        {
            "events": events,
            "codes": codes,
            "committed_lines": committed(),
            "voided": len(re.findall(r"round \d+: voided", log)),
            "relayed": {
                h: (work / f"{h}.log").read_text(errors="replace").count("through the coordinator's relay")
                for h in hosts
            },
            "digests": digests,
            "identical": len(set(digests.values())) == 1 and None not in digests.values(),
        }
    )
)
