"""A vote on disk: written over a pruned vote's file, hashed beside the writing, not fsynced. What it holds is the
state the round commits, bit for bit; a vote that a machine crash left torn, zeroed or without its manifest is
refused on resume (the peer downloads the state instead); a vote a killed process wrote is whole."""

import hashlib
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from peer.state.checkpoint import MANIFEST, TENSORS
from peer.state.resume import committed_on_disk
from peer.state.votes import prune_votes, save_vote, spare_vote, vote_dir
from swarm.config import RunConfig
from swarm.core import spans
from swarm.core import tentative as tentative_module
from swarm.core.outer import OuterOptimizer
from swarm.core.state import GlobalState, state_hash
from swarm.core.tentative import TentativeState

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(40, 30), (70,), (9, 4, 5), (130,)]


def _round(round_no: int, seed: int, which: str = "whole") -> tuple[TentativeState, GlobalState]:
    """A tentative state of ``round_no`` and the same state materialised (``spans.tentative_step``)."""
    g = torch.Generator().manual_seed(seed)
    outer = OuterOptimizer(RunConfig().outer, [torch.Size(s) for s in SHAPES])
    outer.load_state_tensors([torch.randn(s, generator=g) for s in SHAPES])
    base = GlobalState(round_no - 1, [torch.randn(s, generator=g) for s in SHAPES], outer.state_tensors())
    chosen = (
        spans.whole([torch.Size(s) for s in SHAPES], range(len(SHAPES)))
        if which == "whole"
        else [spans.Span(0, 5, 1000), spans.Span(2, 0, 17), spans.Span(3, 60, 130)]
    )
    deltas = [torch.randn(spans.gather(base.params, [s])[0].shape, generator=g) for s in chosen]
    params, momentum = spans.tentative_step(outer, base.params, deltas, chosen)
    return TentativeState(round_no, base, outer, deltas, chosen), GlobalState(round_no, params, momentum)


def _like() -> GlobalState:
    return GlobalState(0, [torch.zeros(s) for s in SHAPES], [torch.zeros(s) for s in SHAPES])


@pytest.mark.parametrize("which", ["whole", "parts of tensors"])
def test_a_vote_written_over_a_pruned_ones_file_is_the_committed_state(tmp_path, monkeypatch, which):
    monkeypatch.setattr(TentativeState, "CHUNK", 97)  # many pieces: each scratch slot stepped into again and again
    first, _ = _round(1, seed=0)
    save_vote(tmp_path, first, run_id="run-x")
    with open(vote_dir(tmp_path, 1) / TENSORS, "ab") as f:
        f.write(b"\xff" * 5000)  # a longer file to write over: what is left of it must go
    prune_votes(tmp_path, below=2)
    assert not vote_dir(tmp_path, 1).exists() and spare_vote(tmp_path).exists()

    tentative, materialised = _round(2, seed=1, which=which)
    save_vote(tmp_path, tentative, run_id="run-x")
    assert not spare_vote(tmp_path).exists(), "the pruned vote's file was not the one written over"
    assert tentative.state_hash == materialised.state_hash == state_hash(materialised.params, materialised.outer_state)
    save_vote(tmp_path / "fresh", materialised, run_id="run-x")
    assert (vote_dir(tmp_path, 2) / TENSORS).read_bytes() == (vote_dir(tmp_path / "fresh", 2) / TENSORS).read_bytes()

    found = committed_on_disk(tmp_path, run_id="run-x", round_no=2, state_hash=tentative.state_hash, like=_like())
    committed = tentative.commit_in_place()
    assert found is not None and found.source == "vote"
    assert all(
        torch.equal(a, b)
        for a, b in zip(found.state.params + found.state.outer_state, committed.params + committed.outer_state)
    )


def _truncated(path):
    os.truncate(path / TENSORS, os.path.getsize(path / TENSORS) // 2)


def _zeroed(path):  # its blocks allocated, their data never written
    size = os.path.getsize(path / TENSORS)
    os.truncate(path / TENSORS, 0)
    os.truncate(path / TENSORS, size)


def _manifest_empty(path):
    os.truncate(path / MANIFEST, 0)


def _tensors_missing(path):
    os.unlink(path / TENSORS)


@pytest.mark.parametrize(
    "damage",
    [_truncated, _zeroed, _manifest_empty, _tensors_missing],
    ids=["truncated", "zeroed", "empty manifest", "no tensor file"],
)
def test_a_vote_a_machine_crash_left_torn_is_refused_and_the_peer_downloads(tmp_path, caplog, damage):
    tentative, _ = _round(1, seed=2)
    save_vote(tmp_path, tentative, run_id="run-x")
    voted = tentative.state_hash
    assert committed_on_disk(tmp_path, run_id="run-x", round_no=1, state_hash=voted, like=_like()) is not None
    damage(vote_dir(tmp_path, 1))
    assert committed_on_disk(tmp_path, run_id="run-x", round_no=1, state_hash=voted, like=_like()) is None
    assert "downloading the state from peers instead" in caplog.text


@pytest.mark.slow
def test_a_vote_written_by_a_process_killed_right_after_is_whole(tmp_path):
    """kill -9 once the vote is written (its hash about to be reported): the vote, never fsynced, is resumed from."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_vote_on_disk import _round
        from peer.state.votes import save_vote
        tentative, _ = _round(1, seed=3)
        save_vote({str(tmp_path)!r}, tentative, run_id="run-x")
        print(tentative.state_hash, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    assert done.returncode == -9, done.stderr
    voted = done.stdout.strip()
    _, materialised = _round(1, seed=3)
    assert voted == materialised.state_hash
    found = committed_on_disk(tmp_path, run_id="run-x", round_no=1, state_hash=voted, like=_like())
    assert found is not None and found.state.state_hash == voted


class _SlowSha256:
    """SHA-256 that lags behind the writer: a scratch slot's bytes must stay until they are hashed."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, data) -> None:
        time.sleep(0.002)
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def test_a_hash_that_lags_behind_the_writing_hashes_the_bytes_written(tmp_path, monkeypatch):
    monkeypatch.setattr(TentativeState, "CHUNK", 97)
    monkeypatch.setattr(tentative_module, "hashlib", types.SimpleNamespace(sha256=_SlowSha256))
    tentative, materialised = _round(1, seed=4)
    save_vote(tmp_path, tentative, run_id="run-x")
    assert tentative.state_hash == materialised.state_hash
    assert (
        committed_on_disk(tmp_path, run_id="run-x", round_no=1, state_hash=materialised.state_hash, like=_like())
        is not None
    )
