"""Opening a state dir's run: start a new one from the config (its model identity derived, its first join
token stored) or resume the kept one, whose config never changes."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from typing import Any, Optional

from coordinator.api import tokens
from coordinator.store.database import Store
from coordinator.store.records import COMMITTED, RunRecord
from coordinator.store.run_identity import check_model, check_vocab_fits, expected_identity, with_data_fingerprint
from swarm.config import ConfigError, RunConfig

logger = logging.getLogger(__name__)


def open_run(
    store: Store, given: Optional[RunConfig], *, check_config: bool, now: float, max_rounds: Optional[int] = None
) -> RunConfig:
    """Start a run with ``given`` when ``store`` holds none; else check ``given`` against the kept run's
    config and return the kept one (the run's config never changes, but for where it logs: ``[logging]``, and
    how long it runs: ``[rounds] max_rounds``, which a restart may raise to extend a run, finished or not).
    ``max_rounds``: the command line's ``--max-rounds``, which applies to a kept run even without ``--config``
    (``check_config`` False)."""
    run = store.get_run()
    if given is not None:
        check_model(given)  # a mistake in [model] is reported before the data is read (seconds)
        given = with_data_fingerprint(given)  # every peer gets the spec with it and checks its own data
        _warn_special_tokens(given)
    if run is None:
        if given is None:
            raise ConfigError("this state directory holds no run yet; give --config to start one.")
        identity = expected_identity(given.to_json())
        check_vocab_fits(identity.vocab_size, given)  # a factory model's, known once it is built
        run = RunRecord(
            run_id="run-" + secrets.token_hex(6),
            token=secrets.token_urlsafe(24),
            run_spec_json=given.to_json(),
            created_at=now,
            model_fingerprint=identity.model_fingerprint,
            initial_hash=identity.initial_hash,
            param_count=identity.param_count,
        )
        store.put_run(run)
        store.put_token(tokens.default_token(run.token, now=now))  # the first join string's
        logger.info("run %s: started a new run", run.run_id)
        return given
    kept = RunConfig.from_json(run.run_spec_json)
    if given is not None and given.logging != kept.logging:  # where curves go is not part of the run: it may change
        kept = kept.replace(logging=given.logging)
        store.put_run(dataclasses.replace(run, run_spec_json=kept.to_json()))
        logger.info("run %s: logs now go where the new [logging] says", run.run_id)
    wanted = (given.rounds.max_rounds if check_config else max_rounds) if given is not None else None
    if given is not None and (check_config or max_rounds is not None) and wanted != kept.rounds.max_rounds:
        # with --config, only when nothing else differs; without, the default config says nothing about the run
        only_change = not check_config or given == _with_rounds(kept, wanted)
        kept = _with_max_rounds(store, kept, wanted, now=now, only_change=only_change)
        if not check_config:
            given = _with_rounds(given, wanted)
    if given is not None and given != kept:
        # max_rounds alone may change: the first difference named is one that may not
        where = _first_difference(_with_rounds(kept, given.rounds.max_rounds).to_dict(), given.to_dict())
        if check_config:
            raise ConfigError(
                f"{store.path} holds run {run.run_id}, started with a different config ({where} differs); "
                "restart with the original --config, or use a new --state-dir to start a new run."
            )
        logger.warning("run %s: keeps its stored config; the settings given now differ in %s", run.run_id, where)
    logger.info("run %s: resumed from %s", run.run_id, store.path)
    return kept


def _warn_special_tokens(run: RunConfig) -> None:
    """An hf_config whose bos/eos/pad ids lie outside its vocabulary trains, but its export cannot generate():
    say so at the start, when it is still cheap to fix."""
    if run.model.kind != "hf":
        return
    from swarm.train.model.hf_model import hf_auto_config, special_ids_outside_vocab

    problem = special_ids_outside_vocab(hf_auto_config(run.model.hf_config))
    if problem:
        logger.warning("[model] hf_config: %s", problem)


def _with_max_rounds(
    store: Store, kept: RunConfig, wanted: Optional[int], *, now: float, only_change: bool
) -> RunConfig:
    """``kept`` with ``[rounds] max_rounds`` set to ``wanted`` (None: no end), stored; a finished run that may now
    commit more rounds is open again, and continues from its last committed round. Not when it is not the only
    change (``only_change`` False: the caller refuses the config), nor below the rounds already committed."""
    if not only_change:
        return kept
    run = store.get_run()
    committed = store.count_rounds(COMMITTED)
    if wanted is not None and wanted < committed:
        raise ConfigError(
            f"run {run.run_id} has committed {committed} rounds already, more than max_rounds {wanted};"
            f" give --max-rounds {committed} or more (more extends the run)."
        )
    extended = _with_rounds(kept, wanted).validate()
    more = wanted is None or wanted > committed
    finished_at = None if more else run.finished_at if run.finished_at is not None else now
    store.put_run(dataclasses.replace(run, run_spec_json=extended.to_json(), finished_at=finished_at))
    was = kept.rounds.max_rounds
    logger.info(
        "run %s: max_rounds %s -> %s; %s",
        run.run_id,
        "none" if was is None else was,
        "none" if wanted is None else wanted,
        f"rounds continue after the {committed} committed" if more else "the run is finished",
    )
    return extended


def _with_rounds(config: RunConfig, max_rounds: Optional[int]) -> RunConfig:
    return config.replace(rounds=dataclasses.replace(config.rounds, max_rounds=max_rounds))


def _first_difference(a: Any, b: Any, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
    return prefix or "the config"
