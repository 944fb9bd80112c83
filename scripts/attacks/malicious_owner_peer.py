#!/usr/bin/env python3
"""An attacker's modified peer software: ``swarm peer`` whose reduction is replaced, in this process only, before the
normal entry point runs. Every reduction it makes returns ``SWARM_ATTACK_OWNER_FACTOR`` (-100) × the honest average:

- in a butterfly run, the slice it owns: it sends that slice's average, tampered, to every groupmate (the codec
  encodes any finite value, and no member can tell);
- in a run that admits strangers (all-gather), it reduces only for itself: its own θg, and so its hash, diverge.

Otherwise it is an honest peer: it trains, contributes its true Δ and reports what it computed.
``SWARM_ATTACK_FROM_ROUND`` (1): the first round it tampers with.

    python scripts/attacks/malicious_owner_peer.py peer --join ... --state-dir ...   # the arguments of `swarm`
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from swarm.app.cli import main  # noqa: E402
from swarm.core.aggregation import Aggregation  # noqa: E402
from swarm.net.exchange.allreduce import Exchange  # noqa: E402

FACTOR = float(os.environ.get("SWARM_ATTACK_OWNER_FACTOR", "-100"))
FROM_ROUND = int(os.environ.get("SWARM_ATTACK_FROM_ROUND", "1"))
_honest_reduce, _honest_average = Aggregation.reduce, Exchange.average
_state = {"round": 0, "tampered": 0}  # one exchange at a time: the round of the one under way


def exchange_average(self, **kwargs):
    found = re.search(r"\.round(\d+)\.", kwargs.get("key", ""))
    _state["round"] = int(found.group(1)) if found else 0
    return _honest_average(self, **kwargs)


def tampered_reduce(self, slices, weights, *, out=None):
    reduced = _honest_reduce(self, slices, weights, out=out)
    if _state["round"] >= FROM_ROUND:
        reduced.average.mul_(FACTOR)  # in place: where the caller reads (and, as owner, sends) the result
        _state["tampered"] += 1
        print(
            f"malicious owner: reduction {_state['tampered']} (round {_state['round']}) of "
            f"{reduced.average.numel()} values set to {FACTOR:g} x the average",
            file=sys.stderr,
            flush=True,
        )
    return reduced


Aggregation.reduce = tampered_reduce
Exchange.average = exchange_average

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
