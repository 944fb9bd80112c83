"""bench_wan.py's `adaptation` section: a real 4-peer swarm with `[rounds] controller = "auto"` on the testbed,
one peer's link cut 10x while it runs and restored later; one row per round from the run's history, the
controller's choice as `swarm status --json` showed it, and the coordinator's log."""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from bench_wan_runs import PREFIX, _peer_times, history, run_swarm
from testbed import Testbed, make_topology

ADAPTATION_RUN = """
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
controller = "auto"
overlap_steps = {overlap}
"""
CHOICE_LINE = re.compile(r"round (\d+): (.*) \(shares (.*)\)$", re.M)


def _timeline(cut_after: int, restore_after: int):
    """on_status for run_swarm: cuts and restores the link as rounds commit, and keeps each round's choice."""
    state = {"choices": {}, "cut_at": None, "restore_at": None, "polls": []}

    def on_status(bed: Testbed, host: str, mbit: float, status: dict) -> None:
        state["polls"].append((time.time(), _peer_times(status)))
        run = status.get("run", {})
        choice = run.get("controller")
        if choice:
            state["choices"][int(choice.get("round", 0))] = choice
        committed = run.get("rounds_committed", 0)
        # when each change took effect: the first round opened after it is the first to run on the new link from
        # its start (``first_round_after``); the poll that sees a commit may land late in the next round
        if state["cut_at"] is None and committed >= cut_after:
            bed.set_rate(host, up_mbit=mbit / 10, down_mbit=mbit / 10)
            state["cut_at"] = time.time()
        elif state["cut_at"] is not None and state["restore_at"] is None and committed >= restore_after:
            bed.set_rate(host, up_mbit=mbit, down_mbit=mbit)
            state["restore_at"] = time.time()

    return state, on_status


def first_round_after(hist: dict, at: float | None) -> int | None:
    """The first round the coordinator opened after ``at`` (epoch seconds; this machine's clock)."""
    if at is None:
        return None
    return next((int(r["round"]) for r in hist.get("rounds", []) if r.get("opened_at", 0) >= at), None)


def busy_share(polls: list, start: float, end: float) -> float | None:
    """The peers' mean share of wall time in inner steps from the first status poll at or after ``start`` to the
    first at or after ``end`` (epoch seconds): each peer's live inner and wall seconds come from one heartbeat,
    so the share is exact for the window between the two polls (≤ one poll interval off the round's period)."""
    a = next((times for t, times in polls if t >= start), None)
    b = next((times for t, times in polls if t >= end), None)
    if a is None or b is None or a is b:
        return None
    shares = [(b[p][0] - a[p][0]) / (b[p][1] - a[p][1]) for p in a if p in b and b[p][1] > a[p][1]]
    return round(sum(shares) / len(shares), 3) if shares else None


def rows_by_round(hist: dict, choices: dict[int, dict], log: str, polls: list = ()) -> list[dict]:
    """One row per decided round: the controller's codec, fragments, recommended H and reason; ``busy``, the
    peers' live share of wall time in inner steps over the round's period (its opening to the next round's,
    ``busy_share``: what the recovery is counted on); the history's ``utilization`` (inner ÷ (inner + exchange),
    which counts an exchange hidden behind overlap as lost) and the compute share of the round's period (mean
    inner seconds ÷ seconds from its opening to the next round's)."""
    reasons = {int(n): reason for n, reason, _ in CHOICE_LINE.findall(log)}
    rounds = hist.get("rounds", [])
    rows = []
    for i, r in enumerate(rounds):
        n = int(r["round"])
        choice = choices.get(n, {})
        period = rounds[i + 1]["opened_at"] - r["opened_at"] if i + 1 < len(rounds) else None
        rows.append(
            {
                "round": n,
                "outcome": r.get("outcome"),
                "codec": r.get("codec"),
                "fragments": choice.get("fragments", r.get("fragments")),
                "H": choice.get("inner_steps", r.get("inner_steps")),
                "busy": busy_share(list(polls), r["opened_at"], rounds[i + 1]["opened_at"]) if period else None,
                "utilization": round(r.get("utilization") or 0.0, 3),
                "compute_share": round(r["inner_s"] / period, 3) if period else None,
                "exchange_s": round(r.get("exchange_s") or 0.0, 2),
                "predicted_exchange_s": choice.get("predicted_exchange_s"),
                "reason": reasons.get(n, choice.get("reason", "")),
            }
        )
    return rows


def summary(rows: list[dict], cut_round: int | None, restore_round: int | None) -> dict:
    """Rounds from each link change to the first round with another codec, and to a busy share ≥ 0.95 again."""

    def after(start: int | None, before_codec: str | None, key: str) -> dict:
        if start is None:
            return {"changed_after_rounds": None, "recovered_after_rounds": None}
        later = [r for r in rows if r["round"] >= start]
        changed = next((r["round"] - start + 1 for r in later if r["codec"] != before_codec), None)
        recovered = next((r["round"] - start + 1 for r in later if (r[key] or 0) >= 0.95), None)
        return {"changed_after_rounds": changed, "recovered_after_rounds": recovered}

    def codec_before(start: int | None) -> str | None:
        before = [r for r in rows if start is not None and r["round"] < start]
        return before[-1]["codec"] if before else None

    return {
        "cut": after(cut_round, codec_before(cut_round), "busy"),
        "restore": after(restore_round, codec_before(restore_round), "busy"),
    }


def section_adaptation(
    args: argparse.Namespace,
    *,
    mbit: float = 100,
    rounds: int = 12,
    inner_steps: int = 40,
    overlap: int = 4,
    cut_after: int = 3,
    restore_after: int = 7,
) -> dict:
    work = Path(tempfile.mkdtemp(prefix="bench-adapt-"))
    hosts, slow = ["h1", "h2", "h3", "h4"], "h2"
    state, on_status = _timeline(cut_after, restore_after)
    with Testbed(make_topology(hosts=5, mbit=mbit, prefix=PREFIX)) as bed:
        run_swarm(
            bed,
            work,
            ADAPTATION_RUN.format(inner_steps=inner_steps, rounds=rounds, overlap=overlap),
            hosts,
            peer_args=lambda host: ["--threads", "1"],
            on_status=lambda s: on_status(bed, slow, mbit, s),
            timeout_s=900,
        )
    hist = history(work)
    rows = rows_by_round(hist, state["choices"], (work / "coordinator.log").read_text(errors="replace"), state["polls"])
    cut_round, restore_round = first_round_after(hist, state["cut_at"]), first_round_after(hist, state["restore_at"])
    return {
        "peers": len(hosts),
        "mbit": mbit,
        "slow_host": slow,
        "cut_to_mbit": mbit / 10,
        "cut_from_round": cut_round,
        "restored_from_round": restore_round,
        "inner_steps": inner_steps,
        "overlap_steps": overlap,
        "rows": rows,
        **summary(rows, cut_round, restore_round),
        "logs": str(work),
    }
