"""bench_wan.py's `hierarchical` section: 2 sites x 2 peers on the testbed, 1 Gbit/s inside a site and
20 Mbit/s between sites, the same run flat and with `[rounds] hierarchical = true`. Cross-site bytes come
from the peers' logs ("N in-site, M cross-site": the exchange's payload) and from the testbed's cross-site
traffic classes (every IP byte, DHT and headers included); round seconds from the run's history; θg is
identical when every peer's final model has the same tensors digest (the file's bytes differ: safetensors
writes the metadata in no fixed order)."""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
from pathlib import Path

from bench_wan_runs import PREFIX, history, run_swarm
from testbed import Testbed, make_topology

from swarm.train.model.final_model import tensors_digest

SITES = {"h1": "a", "h2": "a", "h3": "b", "h4": "b"}
SITES_RUN = """
[model]
preset = "tiny"

[rounds]
inner_steps = {inner_steps}
max_rounds = {rounds}
min_peers = 4
matchmaking_window_s = 20.0
exchange_timeout_s = 90.0
round_timeout_s = 180.0
eval_every_rounds = {rounds}
hierarchical = {hierarchical}
"""
EXCHANGE_LINE = re.compile(r"\[\S+ r(\d+)\] averaged .*?(\d+) in-site, (\d+) cross-site")


def _final_digest(work: Path, host: str) -> str | None:
    found = sorted((work / host).rglob("final/model.safetensors"))
    return tensors_digest(found[0]) if found else None


def measure(mode: str, *, rounds: int, inner_steps: int, in_site_mbit: float, cross_site_mbit: float) -> dict:
    work = Path(tempfile.mkdtemp(prefix=f"bench-sites-{mode}-"))
    hosts = list(SITES)
    topology = make_topology(
        hosts=5, mbit=in_site_mbit, sites=["", *SITES.values()], cross_site_mbit=cross_site_mbit, prefix=PREFIX
    )
    config = SITES_RUN.format(
        inner_steps=inner_steps, rounds=rounds, hierarchical="true\ngroup_size = 2" if mode == "two_level" else "false"
    )
    with Testbed(topology) as bed:
        run_swarm(
            bed, work, config, hosts, peer_args=lambda host: ["--site", SITES[host], "--threads", "1"], timeout_s=900
        )
        wire = sum(bed.cross_site_bytes_sent(h) for h in hosts)
    logs = {h: (work / f"{h}.log").read_text(errors="replace") for h in hosts}
    exchanges = [(int(n), int(a), int(b)) for log in logs.values() for n, a, b in EXCHANGE_LINE.findall(log)]
    decided = [r for r in history(work).get("rounds", []) if r.get("outcome") == "committed"]
    digests = {h: _final_digest(work, h) for h in hosts}
    averaged = len({n for n, _, _ in exchanges}) or 1
    return {
        "rounds_committed": len(decided),
        "cross_site_bytes_per_round": sum(b for _, _, b in exchanges) // averaged,
        "in_site_bytes_per_round": sum(a for _, a, _ in exchanges) // averaged,
        "cross_site_wire_bytes": wire,
        "round_s": round(statistics.median(r["decided_at"] - r["opened_at"] for r in decided), 2) if decided else None,
        "exchange_s": round(statistics.median(r["exchange_s"] for r in decided), 2) if decided else None,
        "identical": len(set(digests.values())) == 1 and None not in digests.values(),
        "final_digest": {h: d or "missing" for h, d in digests.items()},
        "logs": str(work),
    }


def section_hierarchical(
    args: argparse.Namespace,
    *,
    rounds: int = 4,
    inner_steps: int = 20,
    in_site_mbit: float = 1000,
    cross_site_mbit: float = 20,
) -> dict:
    runs = {
        mode: measure(
            mode, rounds=rounds, inner_steps=inner_steps, in_site_mbit=in_site_mbit, cross_site_mbit=cross_site_mbit
        )
        for mode in ("flat", "two_level")
    }
    flat, two = runs["flat"], runs["two_level"]
    return {
        "sites": "2 x 2 peers",
        "in_site_mbit": in_site_mbit,
        "cross_site_mbit": cross_site_mbit,
        "cross_site_bytes_flat": flat["cross_site_bytes_per_round"],
        "cross_site_bytes_two_level": two["cross_site_bytes_per_round"],
        "ratio": round(two["cross_site_bytes_per_round"] / flat["cross_site_bytes_per_round"], 3)
        if flat["cross_site_bytes_per_round"]
        else None,
        "round_s_flat": flat["round_s"],
        "round_s_two_level": two["round_s"],
        "identical": flat["identical"] and two["identical"],
        "runs": runs,
    }
