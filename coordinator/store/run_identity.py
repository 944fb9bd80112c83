"""What the run's model and data are, decided by the coordinator from the run config: the model fingerprint and
θ0's hash, computed with the very functions a peer's trainer uses (``swarm.train.model.initial_state``), and the data
fingerprint (``swarm.train.data.data_fingerprint``) pinned into the run spec every peer receives. A peer whose model
or initial state differs is evicted at its first heartbeat; one whose data differs refuses to start with the
spec's fingerprint. No peer's word sets them."""

from __future__ import annotations

import dataclasses
import functools
import logging

from swarm.config import ConfigError, RunConfig
from swarm.train.data.data import data_vocab_size
from swarm.train.data.data_fingerprint import data_fingerprint
from swarm.train.model.initial_state import RunIdentity, run_identity
from swarm.train.model.run_model import checked_vocab_size

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=8)
def expected_identity(run_spec_json: str) -> RunIdentity:
    """The identity of the run with this config (built once per config: a model build takes a while)."""
    identity = run_identity(RunConfig.from_json(run_spec_json))
    logger.info(
        "run model: fingerprint %s, initial state %s, %d parameters",
        identity.model_fingerprint[:16],
        identity.initial_hash,
        identity.param_count,
    )
    return identity


def check_model(run: RunConfig) -> None:
    """What would make every peer's model build or first step fail, found from the config alone and before the
    data is read (which takes seconds): the model's config (``checked_vocab_size``) and its vocabulary against the
    data's. A factory model's vocabulary is known once it is built: ``check_vocab_fits`` after ``expected_identity``."""
    check_vocab_fits(checked_vocab_size(run.model), run)


def check_vocab_fits(model_vocab: int | None, run: RunConfig) -> None:
    """ConfigError when the model embeds fewer token ids than the data is drawn from: each peer would refuse to
    train it (``swarm.train.data.data.check_vocab``), so the coordinator refuses to serve it."""
    data_vocab = data_vocab_size(run.data)
    if model_vocab is None or data_vocab is None or model_vocab >= data_vocab:
        return
    change = {
        "hf": "the hf_config's vocab_size",
        "factory": "the factory model's embedding size",
        "preset": "[model] vocab_size",
    }[run.model.kind]
    if run.data.kind == "tokenized":
        raise ConfigError(
            f"the model's vocabulary ({model_vocab} ids) is smaller than the tokenizer's ({data_vocab}"
            f" ids, [data] tokenizer {run.data.tokenizer}), so no peer could train it; set {change} to at"
            f" least {data_vocab}, or use a tokenizer of at most {model_vocab} ids."
        )
    raise ConfigError(
        f"the model's vocabulary ({model_vocab} ids) is smaller than the {data_vocab} byte values the"
        f" data is read as, so no peer could train it; set {change} to at least {data_vocab}, or give"
        f" [data] a tokenizer of at most {model_vocab} ids."
    )


def with_data_fingerprint(run: RunConfig) -> RunConfig:
    """``run`` with ``[data] fingerprint`` computed from the coordinator's copy of the data; a pinned one is kept
    when the coordinator lacks the files, and must agree when it has them."""
    try:
        mine = data_fingerprint(run.data)
    except (ConfigError, OSError, ValueError) as e:  # ValueError: text files that are gone or empty
        if run.data.fingerprint:
            logger.info(
                "data: the coordinator cannot read it (%s); peers must match the pinned fingerprint %s",
                e,
                run.data.fingerprint[:16],
            )
            return run
        raise ConfigError(
            f"the coordinator cannot read the run's data ({e}); give it the files, or pin [data]"
            " fingerprint (python -m swarm.train.data.data_fingerprint RUN.toml prints it)."
        ) from None
    if run.data.fingerprint and run.data.fingerprint != mine:
        raise ConfigError(
            f"[data] fingerprint {run.data.fingerprint[:16]} does not match the coordinator's copy of"
            f" the data ({mine[:16]}); fix the pinned value or the files."
        )
    logger.info("data fingerprint %s", mine[:16])
    return run.replace(data=dataclasses.replace(run.data, fingerprint=mine))
