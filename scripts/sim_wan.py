#!/usr/bin/env python3
"""How Swarm's round scales on a model of the network (swarm/train/simulator/network_model.py; no real traffic): 16 to
10,000 peers in up to 16 sites, flat butterfly against two-level averaging (sub-groups of a site of at most
``--group-size``, as ``[rounds] group_size`` cuts them), each with the controller's rule (the least lossy codec
whose exchange hides behind compute, else int4 and a larger H). Peers of a site share its uplink; with
``--sites 0`` every peer has a link of its own.

    .venv/bin/python scripts/sim_wan.py                         # the table in docs/BENCHMARKS.md
    .venv/bin/python scripts/sim_wan.py --peers 10000 --sites 0 16 --group-size 0 64 --params 1e9
    .venv/bin/python scripts/sim_wan.py --params 1e8 --mbit 20 --one-way-ms 80 --json

The per-byte costs default to what scripts/bench_wan.py's sim_wan_calibration measured on the testbed
(fp32's codec cost per encoded byte is used for every codec, which understates int8/int4: their numpy
block quantization measured ~12x fp32's per encoded byte, ~1.7x per parameter). ``p_commit`` is the chance that no member of the
group that must complete together fails during a round, at ``--fail-per-hour`` per peer: the whole
flat group, or (two-level) the representatives, a sub-group with a failed member being left out of level 2;
``kept``: the chance that a peer's sub-group has no failed member (two-level; 1 for flat); ``useful`` is
utilization × p_commit × kept, the share of compute that ends up in committed rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.train.simulator.network_model import Costs, controlled_round, make_peers  # noqa: E402

GB = 1e9


def scenario(peers: int, sites: int, mode: str, group_size: int, args: argparse.Namespace) -> dict:
    nodes = make_peers(
        peers,
        sites=sites or None,
        up_mbit=args.mbit,
        one_way_ms=args.one_way_ms,
        step_s=args.step_s,
        slow_every=args.slow_every,
        slow_factor=args.slow_factor,
    )
    costs = Costs(
        codec_s_per_byte=args.codec_s_per_byte,
        transport_s_per_byte=args.transport_s_per_byte,
        per_stream_s=args.per_stream_s,
        lan_mbit=args.lan_mbit,
        site_mbit=args.site_mbit,
        link_efficiency=args.link_efficiency,
    )
    r = controlled_round(
        mode, params=int(args.params), inner_steps=args.inner_steps, peers=nodes, costs=costs, group_size=group_size
    )
    # failures arrive at a rate per peer-hour; a voided round's inner steps are lost, and so are those of a
    # sub-group left out of level 2
    per_peer = args.fail_per_hour * r.round_s / 3600
    p_commit = math.exp(-per_peer * r.exchange.must_complete)
    kept = math.exp(-per_peer * (r.exchange.largest_subgroup - 1)) if mode == "two_level" else 1.0
    return {
        "peers": peers,
        "sites": sites or "own",
        "mode": mode,
        "group_size": group_size or "site",
        "subgroups": r.exchange.must_complete if mode == "two_level" else 1,
        "codec": r.codec,
        "H": r.inner_steps,
        "exchange_s": round(r.exchange.seconds, 1),
        "round_s": round(r.round_s, 1),
        "utilization": round(r.utilization, 3),
        "upload_gb_per_peer": round(r.exchange.bytes_per_peer / GB, 2),
        "cross_site_gb": round(r.exchange.cross_site_bytes / GB, 1),
        "p_commit": round(p_commit, 3),
        "kept": round(kept, 3),
        "useful": round(r.utilization * p_commit * kept, 3),
        "reason": r.reason,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument(
        "--sites",
        type=int,
        nargs="+",
        default=[0, 4, 16],
        help="sites (at most 16; 0: every peer on a link of its own, as volunteers are)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        nargs="+",
        default=[0],
        help="two-level sub-groups of at most this many peers of a site (0: one per site)",
    )
    parser.add_argument("--params", type=float, default=1e9, help="model parameters")
    parser.add_argument("--inner-steps", type=int, default=500, help="H the controller starts from")
    parser.add_argument("--step-s", type=float, default=1.0, help="seconds per inner step")
    parser.add_argument("--mbit", type=float, default=100.0, help="every peer's own link, upload and download")
    parser.add_argument("--one-way-ms", type=float, default=50.0, help="WAN one-way latency")
    parser.add_argument("--lan-mbit", type=float, default=10_000.0, help="links between the peers of a site")
    parser.add_argument("--site-mbit", type=float, default=1000.0, help="each site's uplink, shared by its peers")
    parser.add_argument("--slow-every", type=int, default=0, help="every Nth peer is slower to compute (0: none)")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument(
        "--codec-s-per-byte",
        type=float,
        default=6.8e-9,
        help="CPU-s of encode+reduce+decode per encoded byte (fp32; calibrated on the testbed)",
    )
    parser.add_argument(
        "--transport-s-per-byte",
        type=float,
        default=5.1e-9,
        help="transport CPU-s per byte sent or received (calibrated on the testbed, unshaped)",
    )
    parser.add_argument(
        "--link-efficiency",
        type=float,
        default=0.96,
        help="payload share of a link's rate (0.96: headers only; the testbed's 4-peer butterfly got ~0.7)",
    )
    parser.add_argument("--per-stream-s", type=float, default=0.002, help="CPU per stream (one slice, one groupmate)")
    parser.add_argument(
        "--fail-per-hour",
        type=float,
        default=0.01,
        help="failures per peer-hour (0.01: a peer fails once in 100 hours)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON list as the last line")
    args = parser.parse_args()
    if any(not 0 <= s <= 16 for s in args.sites):
        parser.error(f"--sites must be between 0 and 16, got {args.sites}")
    if any(g < 0 for g in args.group_size):
        parser.error(f"--group-size must be 0 (one sub-group per site) or positive, got {args.group_size}")
    if any(p < 2 for p in args.peers):
        parser.error(f"--peers must be at least 2, got {args.peers}")
    if min(args.params, args.mbit, args.step_s, args.link_efficiency) <= 0 or args.fail_per_hour < 0:
        parser.error("--params, --mbit, --step-s and --link-efficiency must be positive, --fail-per-hour not negative")
    rows = [
        scenario(p, s, mode, g, args)
        for p in args.peers
        for s in args.sites
        if s <= p
        for mode in (("flat",) if s in (0, 1) else ("flat", "two_level"))
        for g in (args.group_size if mode == "two_level" else [0])
    ]
    if args.json:
        print(json.dumps(rows))
        return 0
    cols = [
        "peers",
        "sites",
        "mode",
        "group_size",
        "subgroups",
        "codec",
        "H",
        "exchange_s",
        "round_s",
        "utilization",
        "upload_gb_per_peer",
        "cross_site_gb",
        "p_commit",
        "kept",
        "useful",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
