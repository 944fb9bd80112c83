"""What the run's model and data are, decided by the coordinator from the run config: the model fingerprint and
θ0's hash, computed with the very functions a peer's trainer uses (``swarm.train.initial_state``), and the data
fingerprint (``swarm.train.data_fingerprint``) pinned into the run spec every peer receives. A peer whose model
or initial state differs is evicted at its first heartbeat; one whose data differs refuses to start with the
spec's fingerprint. No peer's word sets them."""

from __future__ import annotations

import dataclasses
import functools
import logging

from swarm.config import ConfigError, RunConfig
from swarm.train.data_fingerprint import data_fingerprint
from swarm.train.initial_state import RunIdentity, run_identity

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def expected_identity(run_spec_json: str) -> RunIdentity:
    """The identity of the run with this config (built once per config: a model build takes a while)."""
    identity = run_identity(RunConfig.from_json(run_spec_json))
    logger.info("run model: fingerprint %s, initial state %s, %d parameters", identity.model_fingerprint[:16],
                identity.initial_hash, identity.param_count)
    return identity


def with_data_fingerprint(run: RunConfig) -> RunConfig:
    """``run`` with ``[data] fingerprint`` computed from the coordinator's copy of the data; a pinned one is kept
    when the coordinator lacks the files, and must agree when it has them."""
    try:
        mine = data_fingerprint(run.data)
    except (ConfigError, OSError, ValueError) as e:  # ValueError: text files that are gone or empty
        if run.data.fingerprint:
            logger.info("data: the coordinator cannot read it (%s); peers must match the pinned fingerprint %s",
                        e, run.data.fingerprint[:16])
            return run
        raise ConfigError(f"the coordinator cannot read the run's data ({e}); give it the files, or pin [data]"
                          " fingerprint (python -m swarm.train.data_fingerprint RUN.toml prints it).") from None
    if run.data.fingerprint and run.data.fingerprint != mine:
        raise ConfigError(f"[data] fingerprint {run.data.fingerprint[:16]} does not match the coordinator's copy of"
                          f" the data ({mine[:16]}); fix the pinned value or the files.")
    logger.info("data fingerprint %s", mine[:16])
    return run.replace(data=dataclasses.replace(run.data, fingerprint=mine))
