"""The data fingerprint of text read as bytes: the coordinator pins it; a peer with other text is refused with a
sentence, and a peer whose built-in corpus (the standard library) comes from another Python build is warned."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from coordinator.store.run_identity import with_data_fingerprint
from swarm.config import ConfigError, RunConfig
from swarm.train.data.byte_corpus import _load_cached
from swarm.train.data.data import load_corpus

pytestmark = pytest.mark.timeout(60)


def _text_run(tmp_path: Path, text: str) -> RunConfig:
    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "a.txt").write_text(text)
    return RunConfig.from_dict({"data": {"source": str(tmp_path / "corpus"), "max_bytes": 100_000}})


def test_a_peer_whose_text_files_differ_from_the_coordinators_is_refused(tmp_path: Path) -> None:
    run = _text_run(tmp_path, "def f(x):\n    return x\n" * 5_000)
    spec = with_data_fingerprint(run)  # what every peer receives at join
    assert len(spec.data.fingerprint) == 64
    assert load_corpus(spec.data).train.numel() > 0  # the same files: accepted

    (tmp_path / "corpus" / "a.txt").write_text("def g(y):\n    return -y\n" * 5_000)  # this peer's copy differs
    _load_cached.cache_clear()  # as in another process: this one read the coordinator's copy already
    with pytest.raises(
        ConfigError,
        match=r"this peer's data \(fingerprint [0-9a-f]{16}\) differs from the run's"
        r" \([0-9a-f]{16}\); give it the same files as the coordinator's",
    ):
        load_corpus(spec.data)


def test_another_pythons_standard_library_is_warned_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    spec = with_data_fingerprint(RunConfig.from_dict({"data": {"max_bytes": 200_000}}))
    assert len(spec.data.fingerprint) == 64 and with_data_fingerprint(spec) == spec  # pinned, and it agrees
    other_build = dataclasses.replace(spec.data, fingerprint="0" * 64)  # as a coordinator on another Python has it
    with caplog.at_level(logging.WARNING, logger="swarm.train.data.data_fingerprint"):
        corpus = load_corpus(other_build)
    assert corpus.train.numel() > 0
    assert "built-in corpus (the standard library of Python" in caplog.text
    assert "give every machine the same text files ([data] source = PATH)" in caplog.text
