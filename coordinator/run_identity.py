"""What the run's model is, decided by the coordinator from the run config: the model fingerprint and θ0's
hash, computed with the very functions a peer's trainer uses (``swarm.train.initial_state``). A peer whose
model or initial state differs is evicted at its first heartbeat; no peer's word sets them."""

from __future__ import annotations

import functools
import logging

from swarm.config import RunConfig
from swarm.train.initial_state import RunIdentity, run_identity

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def expected_identity(run_spec_json: str) -> RunIdentity:
    """The identity of the run with this config (built once per config: a model build takes a while)."""
    identity = run_identity(RunConfig.from_json(run_spec_json))
    logger.info("run model: fingerprint %s, initial state %s, %d parameters", identity.model_fingerprint[:16],
                identity.initial_hash, identity.param_count)
    return identity
