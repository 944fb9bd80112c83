"""slice_owner: one peer runs modified software (``malicious_owner_peer.py``: ``swarm peer`` with its reduction
replaced in-process) that sets every average it computes to -100 × the honest one, in runs of the same honest peers
plus that attacker:

- ``admits_strangers = true`` (the all-gather: every member averages all contributions itself), the attacker
  tampering in every round. The guarantee: the honest members' θg is what they computed from the contributions. A
  breach if the honest peers' final models differ or a round commits a state no honest peer holds. The attacker's
  own θg diverges: its hash loses the vote (a breach if it holds a committed round).
- the same, the attacker tampering in the last round only: before it, the attacker is an honest peer in every round
  (once its θg diverged it would resync and train fewer steps, an honest contribution of its own that no simulator
  run has), so the honest final model must be the simulator's run of the same config without any tampering, bit for
  bit: a breach if not.
- a butterfly run without ``admits_strangers``, tampering in every round: the documented hole, reported, not counted
  as a breach: the attacker owns 1/K of the coordinates and every member applies what it sends, so its tampered
  slices commit; how far the final model is from the simulator's untampered run.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from attacks.harness import Swarm, rounds_config, verdicts

WRAPPER = Path(__file__).resolve().parent / "malicious_owner_peer.py"
ATTACKER = "owner"


def run(args: argparse.Namespace, workdir: Path) -> dict:
    runs = {
        "all_gather": one_run(args, workdir / "all_gather", admits_strangers=True, compare=False),
        "all_gather_last_round": one_run(
            args, workdir / "all_gather_last_round", admits_strangers=True, from_round=args.rounds
        ),
        "butterfly": one_run(args, workdir / "butterfly", admits_strangers=False),
    }
    breaches = [f"{name}: {why}" for name, r in runs.items() for why in r["breaches"]]
    result = {**runs, "breaches": breaches, "wall_s": round(sum(r["wall_s"] for r in runs.values()), 1)}
    result["ok"] = (
        not breaches
        and all(
            runs[n]["finished"] and runs[n]["identical_final_models"] for n in ("all_gather", "all_gather_last_round")
        )
        and runs["all_gather_last_round"]["equal_to_untampered_run"] is True
    )
    return result


def one_run(
    args: argparse.Namespace, workdir: Path, *, admits_strangers: bool, from_round: int = 1, compare: bool = True
) -> dict:
    honest = max(2, args.peers)  # the attacker is under half of the group
    extra = "straggler_slack_s = 600.0\n" + ("admits_strangers = true\n" if admits_strangers else "")
    swarm = Swarm(
        workdir,
        rounds_config(
            inner_steps=args.inner_steps, rounds=args.rounds, min_peers=honest + 1, round_timeout_s=90.0, extra=extra
        ),
    )
    swarm.start()
    names = [f"peer-{i}" for i in range(honest)]
    try:
        for name in names:
            swarm.peer(name)
        swarm.peer(ATTACKER, program=WRAPPER, env={"SWARM_ATTACK_FROM_ROUND": str(from_round)})
        finished = swarm.watch(args.timeout_s)
        ids = {name: peer_id for peer_id, name in swarm.names_by_id().items()}
    finally:
        swarm.stop()
    history = swarm.history()
    rounds = verdicts(history)
    attacker_id = ids.get(ATTACKER, "")
    rows: dict[int, dict[str, dict]] = {}
    for row in history["peer_rounds"]:
        rows.setdefault(int(row["round"]), {})[row["peer_id"]] = row
    committed = sorted(n for n, r in rounds.items() if r["outcome"] == "committed")
    attacker_held = [n for n in committed if rows.get(n, {}).get(attacker_id, {}).get("holder")]
    no_honest_holder = [
        n for n in committed if not any(row["holder"] for pid, row in rows.get(n, {}).items() if pid != attacker_id)
    ]
    contributed_every_round = bool(committed) and all(rows.get(n, {}).get(attacker_id, {}).get("ok") for n in committed)
    models = swarm.final_models(names)
    identical = len(models) == honest and len(set(models.values())) == 1
    untampered = (
        compare_with_simulator(swarm, names[0], peers=honest + 1, rounds=len(committed))
        if identical and finished and compare
        else None
    )
    log = workdir / f"{ATTACKER}.log"
    result = {
        "admits_strangers": admits_strangers,
        "exchange": "all_gather" if admits_strangers else "butterfly",
        "tampering_from_round": from_round,
        "honest_peers": honest,
        "tampered_reductions": log.read_text(errors="replace").count("malicious owner: reduction")
        if log.exists()
        else 0,
        "rounds_committed": len(committed),
        "rounds_voided": sum(r["outcome"] == "voided" for r in rounds.values()),
        "rounds_the_attacker_holds": attacker_held,
        "attacker_contributed_every_round": contributed_every_round,
        "finished": finished,
        "identical_final_models": identical,
        "equal_to_untampered_run": None if untampered is None else untampered["equal"],
        "max_abs_diff_from_untampered": None if untampered is None else untampered["max_abs_diff"],
        "final_eval_loss": swarm.final_eval(names),
        "coordinator_unanswered": swarm.unanswered,
        "wall_s": swarm.elapsed_s(),
    }
    breaches = [f"INTERNAL: {why}" for why in swarm.internal]
    if admits_strangers:  # the guarantee holds for runs that admit strangers
        if not identical:
            breaches.append(f"the honest peers' final models differ: {models}")
        breaches += [f"round {n} committed a state no honest peer holds" for n in no_honest_holder]
        breaches += [
            f"round {n}: the attacker holds the committed state its tampered reduction made"
            for n in attacker_held
            if n >= from_round
        ]
        if untampered is not None and contributed_every_round and not untampered["equal"]:
            breaches.append("the honest final model is not the untampered run's (the simulator's, same config)")
        if not finished:
            breaches.append(f"the run did not finish within {args.timeout_s:.0f}s")
    else:
        result["hole"] = (
            "documented, not covered: the attacker's tampered slices are in every committed state"
            if untampered is not None and not untampered["equal"]
            else "the tampering did not show in the final model"
        )
    result["breaches"] = breaches
    return result


def compare_with_simulator(swarm: Swarm, name: str, *, peers: int, rounds: int) -> Optional[dict]:
    """The final model of peer ``name`` against the simulator's run of the same config with no tampering (every peer
    trains its full steps: ``straggler_slack_s`` keeps the real run's budgets full too)."""
    import torch
    from safetensors.torch import load_file

    from swarm.config.run import load_run_config
    from swarm.train.model.model import build_model
    from swarm.train.simulator.sim import simulate

    run = load_run_config(swarm.config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the peers train single-threaded; GEMM bits depend on the thread count
    try:
        sim = simulate(run, peers=peers, rounds=rounds)
    finally:
        torch.set_num_threads(threads)
    final = load_file(str(swarm.workdir / name / "final" / "model.safetensors"))
    names = [n for n, _ in build_model(run.model, seed=run.seed).named_parameters()]
    diff = max(float((final[n] - expected).abs().max()) for n, expected in zip(names, sim.final_params))
    return {"equal": all(torch.equal(final[n], e) for n, e in zip(names, sim.final_params)), "max_abs_diff": diff}
