"""Opening a state dir's run: start a new one from the config (its model identity derived, its first join
token stored) or resume the kept one, whose config never changes."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Any, Optional

from coordinator import tokens
from coordinator.records import RunRecord
from coordinator.run_identity import expected_identity, with_data_fingerprint
from coordinator.store import Store
from swarm.config import ConfigError, RunConfig

logger = logging.getLogger(__name__)


def open_run(store: Store, given: Optional[RunConfig], *, check_config: bool, now: float) -> RunConfig:
    """Start a run with ``given`` when ``store`` holds none; else check ``given`` against the kept run's
    config and return the kept one (the run's config never changes, but for where it logs: ``[logging]``)."""
    run = store.get_run()
    if given is not None:
        given = with_data_fingerprint(given)  # every peer gets the spec with it and checks its own data
    if run is None:
        if given is None:
            raise ConfigError("this state directory holds no run yet; give --config to start one.")
        identity = expected_identity(given.to_json())
        run = RunRecord(run_id="run-" + secrets.token_hex(6), token=secrets.token_urlsafe(24),
                        run_spec_json=given.to_json(), created_at=now, model_fingerprint=identity.model_fingerprint,
                        initial_hash=identity.initial_hash, param_count=identity.param_count)
        store.put_run(run)
        store.put_token(tokens.default_token(run.token, now=now))  # the first join string's
        logger.info("run %s: started a new run", run.run_id)
        return given
    kept = RunConfig.from_json(run.run_spec_json)
    if given is not None and given.logging != kept.logging:  # where curves go is not part of the run: it may change
        kept = kept.replace(logging=given.logging)
        store.put_run(dataclasses.replace(run, run_spec_json=kept.to_json()))
        logger.info("run %s: logs now go where the new [logging] says", run.run_id)
    if given is not None and given != kept:
        where = _first_difference(kept.to_dict(), given.to_dict())
        if check_config:
            raise ConfigError(
                f"{store.path} holds run {run.run_id}, started with a different config ({where} differs); "
                "restart with the original --config, or use a new --state-dir to start a new run."
            )
        logger.warning("run %s: keeps its stored config; the settings given now differ in %s", run.run_id, where)
    logger.info("run %s: resumed from %s", run.run_id, store.path)
    return kept


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
    return prefix or "the config"
