"""tie: as many attacker identities as there are honest peers report, the moment they are planned, one hash of their
own with a group of all of them: the same support as the honest group's hash. The round must void with the reason
("a tie"), never commit the attacker's hash; once the attackers leave, the honest result commits in the following
rounds and the run finishes. Judged from ``swarm history`` (each round's outcome and reason), the status polls and
the final models."""

from __future__ import annotations

import argparse
from pathlib import Path

from attacks.harness import Swarm, rounds_config, verdicts
from attacks.identities import Identity

TIE_HASH = "0" * 16  # the smallest hash: it would win a tie broken by the hash; a tie is void whatever the hashes


def run(args: argparse.Namespace, workdir: Path) -> dict:
    honest = max(1, args.peers)
    swarm = Swarm(workdir, rounds_config(inner_steps=args.inner_steps, rounds=args.rounds, min_peers=2 * honest))
    swarm.start()
    names = [f"peer-{i}" for i in range(honest)]
    attackers: list[Identity] = []
    attacked: dict[int, list[str]] = {}  # round -> the attacker ids that reported it
    left_after = [0]  # the last round attacked, once the attackers left
    try:
        for name in names:
            swarm.peer(name)
        attackers = [Identity(swarm.state_dir, workdir, f"tie-{i}") for i in range(honest)]

        def attack(status: dict) -> None:
            if left_after[0]:
                return
            run_ = status["run"]
            planned = {a.peer_id: swarm.answered("Heartbeat", lambda a=a: a.planned_round(run_)) for a in attackers}
            number = max((n for n in planned.values() if n), default=0)
            if not number:
                return
            asker = next(a for a in attackers if planned[a.peer_id] == number)
            plan = swarm.answered("GetRound", lambda: asker.client.get_round(asker.peer_id, number))
            if plan is None:  # (a heartbeat's answer names only the asker of the participants)
                return
            group = sorted(a.peer_id for a in attackers if a.peer_id in plan.participants)
            for a in attackers:
                if a.peer_id in group:
                    swarm.answered(
                        "ReportRound",
                        lambda a=a: a.client.report_round(
                            a.peer_id, number, ok=True, state_hash=TIE_HASH, group=group, samples=1
                        ),
                    )
            attacked[number] = group
            if len(attacked) >= args.tie_rounds:  # the attacker stops: its identities leave the run
                for a in attackers:
                    swarm.answered("Leave", lambda a=a: a.client.leave(a.peer_id, "the attack is over"))
                left_after[0] = number

        finished = swarm.watch(args.timeout_s, attack)
    finally:
        for a in attackers:
            a.close()
        swarm.stop()
    history = verdicts(swarm.history())
    ties = sorted(
        n for n in attacked if history.get(n, {}).get("outcome") == "voided" and "a tie" in history[n].get("reason", "")
    )
    committed_tie = sorted(n for n, r in history.items() if r.get("committed_hash") == TIE_HASH)
    committed_after = sorted(n for n, r in history.items() if r["outcome"] == "committed" and n > left_after[0])
    models = swarm.final_models(names)
    breaches = [f"round {n} committed the attackers' hash" for n in committed_tie] + [
        f"INTERNAL: {why}" for why in swarm.internal
    ]
    if not finished:
        breaches.append(
            f"the run did not finish within {args.timeout_s:.0f}s (rounds committed: "
            f"{(swarm.status or {}).get('run', {}).get('rounds_committed')})"
        )
    result = {
        "honest_peers": honest,
        "attacker_identities": honest,
        "rounds_attacked": sorted(attacked),
        "voided_as_a_tie": ties,
        "reasons": {n: history[n]["reason"] for n in sorted(attacked) if n in history},
        "committed_after_the_attack": committed_after,
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
        not breaches
        and bool(ties)
        and ties == sorted(attacked)
        and bool(committed_after)
        and result["identical_final_models"]
    )
    return result
