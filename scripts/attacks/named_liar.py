"""named_liar: a member that never trains reports a hash of its own with a group of itself and every other participant
of the round (honest members it never averaged with), in EVERY round: in odd rounds the moment it is planned, in even
ones once an honest member is exchanging (matching by a plan that still lists the liar). It never posts to the
round's group. The honest members must not wait for it (it leaves the plan they match by once
it has reported), so each round commits the honest result and the run finishes: one stranger does not stall it.
Judged from ``swarm history`` (outcomes, reasons, how long each attacked round took) and the final models."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from attacks.harness import Swarm, rounds_config, verdicts
from attacks.identities import Identity

LIAR_HASH = "1" * 16


def run(args: argparse.Namespace, workdir: Path) -> dict:
    honest = max(2, args.peers)  # a majority of the plan needs two honest members against one liar
    timeout_s = args.liar_round_timeout_s
    swarm = Swarm(
        workdir,
        rounds_config(
            inner_steps=args.inner_steps, rounds=args.rounds, min_peers=honest + 1, round_timeout_s=timeout_s
        ),
    )
    swarm.start()
    names = [f"peer-{i}" for i in range(honest)]
    liar = None
    lied: dict[int, list[str]] = {}  # round -> the group the liar named
    late: dict[int, float] = {}  # even rounds: the liar reports once an honest member is exchanging (or by then)
    while_matching: set[int] = set()  # the rounds it lied in while an honest member was exchanging
    try:
        for name in names:
            swarm.peer(name)
        liar = Identity(swarm.state_dir, workdir, "named-liar")

        def lie(number: int) -> None:
            plan = swarm.answered("GetRound", lambda: liar.client.get_round(liar.peer_id, number))
            if plan is None:  # (a heartbeat's answer names only the asker of the participants)
                return
            group = [liar.peer_id, *(p for p in plan.participants if p != liar.peer_id)]
            swarm.answered(
                "ReportRound",
                lambda: liar.client.report_round(
                    liar.peer_id, number, ok=True, state_hash=LIAR_HASH, group=group, samples=1
                ),
            )
            lied[number] = group

        def attack(status: dict) -> None:
            """Odd rounds: the lie goes out as the round opens, before the honest members match. Even rounds: once
            one of them is exchanging (matching, holding its matchmaking for the planned liar, which never posts),
            so the honest members must drop it from the plan they are already matching by."""
            number = swarm.answered("Heartbeat", lambda: liar.planned_round(status["run"]))
            if number and number % 2:
                lie(number)
            elif number:
                late[number] = time.monotonic() + 30.0
            for n, until in list(late.items()):
                matching = any(
                    p["state"] == "exchanging" and p["metrics"]["round"] == n
                    for p in status["peers"]
                    if p["name"] in names
                )
                if matching or time.monotonic() > until:
                    del late[n]
                    lie(n)
                    if matching:
                        while_matching.add(n)

        finished = swarm.watch(args.timeout_s, attack)
    finally:
        if liar is not None:
            liar.close()
        swarm.stop()
    whole = swarm.history()
    history = verdicts(whole)
    holders_by_round: dict[int, set[str]] = {}
    for row in whole["peer_rounds"]:
        if row["holder"]:
            holders_by_round.setdefault(int(row["round"]), set()).add(row["peer_id"])
    attacked = sorted(n for n in lied if n in history)
    committed = [n for n in attacked if history[n]["outcome"] == "committed"]
    seconds = [history[n]["decided_at"] - history[n]["opened_at"] for n in attacked]
    liar_id = liar.peer_id if liar is not None else ""
    breaches = (
        [f"round {n} committed the liar's hash" for n, r in history.items() if r.get("committed_hash") == LIAR_HASH]
        + [
            f"round {n}: the liar holds the committed state"
            for n in committed
            if liar_id in holders_by_round.get(n, ())
        ]
        + [f"INTERNAL: {why}" for why in swarm.internal]
    )
    if not finished:
        breaches.append(
            f"the run stalled: it did not finish within {args.timeout_s:.0f}s (rounds committed: "
            f"{(swarm.status or {}).get('run', {}).get('rounds_committed')}, voided: "
            f"{(swarm.status or {}).get('run', {}).get('rounds_voided')})"
        )
    models = swarm.final_models(names)
    result = {
        "honest_peers": honest,
        "rounds_lied_in": attacked,
        "lied_while_the_honest_matched": sorted(while_matching),
        "committed_despite_the_liar": committed,
        "first_reason": history[attacked[0]]["reason"] if attacked else None,
        "voided_reasons": {n: history[n]["reason"] for n in attacked if history[n]["outcome"] != "committed"},
        "attacked_round_s": {"max": round(max(seconds), 1), "mean": round(sum(seconds) / len(seconds), 1)}
        if seconds
        else None,
        "round_timeout_s": timeout_s,
        "rounds_committed": sum(r["outcome"] == "committed" for r in history.values()),
        "rounds_voided": sum(r["outcome"] == "voided" for r in history.values()),
        "finished": finished,
        "coordinator_unanswered": swarm.unanswered,
        "identical_final_models": len(models) == honest and len(set(models.values())) == 1,
        "final_eval_loss": swarm.final_eval(names),
        "breaches": breaches,
        "wall_s": swarm.elapsed_s(),
    }
    result["ok"] = (
        not breaches and bool(attacked) and len(committed) == len(attacked) and result["identical_final_models"]
    )
    return result
