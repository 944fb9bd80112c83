"""The embedded corpus, its splits and shards, the batch sampler and the evaluation windows."""

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from swarm.config import DataConfig, ModelConfig
from swarm.train.data.data import (
    BatchSampler,
    ByteCorpus,
    eval_loss,
    eval_windows,
    shard,
    shard_index_for_peer,
    stdlib_files,
)
from swarm.train.model.model import build_model

pytestmark = pytest.mark.timeout(60)

SMALL = DataConfig(max_bytes=300_000, eval_fraction=0.05)


def test_stdlib_files_are_sorted_and_exclude_third_party():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    rel = [f.relative_to(root).as_posix() for f in files]
    assert len(files) > 500 and rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any(part in ("site-packages", "dist-packages") for r in rel for part in r.split("/"))
    assert "os.py" in rel


def test_stdlib_corpus_is_the_files_in_order_with_the_eval_split_at_the_end():
    corpus = ByteCorpus.load(SMALL)
    raw = b"".join(f.read_bytes() for f in stdlib_files()[:200])[:300_000]
    assert len(raw) == 300_000
    assert corpus.train.dtype == torch.uint8 and corpus.eval.dtype == torch.uint8
    assert corpus.train.numel() + corpus.eval.numel() == 300_000
    assert corpus.eval.numel() == 15_000
    assert bytes(corpus.train.numpy()) == raw[:285_000]
    assert bytes(corpus.eval.numpy()) == raw[285_000:]


def test_corpus_is_cached_per_source_and_size():
    a = ByteCorpus.load(SMALL)
    assert ByteCorpus.load(DataConfig(max_bytes=300_000, eval_fraction=0.05, batch_size=3)) is a
    assert ByteCorpus.load(DataConfig(max_bytes=200_000, eval_fraction=0.05)) is not a


def test_directory_source_reads_files_recursively_in_sorted_order_skipping_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"ZZ")
    (tmp_path / "a.txt").write_bytes(b"AAAA")
    (tmp_path / "c.txt").write_bytes(b"CCCCCCCCCC")
    (tmp_path / ".hidden").write_bytes(b"nope")
    (tmp_path / ".git" / "HEAD").write_bytes(b"nope")
    corpus = ByteCorpus.load(DataConfig(source=str(tmp_path), max_bytes=None, eval_fraction=0.25))
    assert bytes(corpus.train.numpy()) + bytes(corpus.eval.numpy()) == b"AAAAZZCCCCCCCCCC"
    assert bytes(corpus.eval.numpy()) == b"CCCC"
    capped = ByteCorpus.load(DataConfig(source=str(tmp_path), max_bytes=5, eval_fraction=0.2))
    assert bytes(capped.train.numpy()) + bytes(capped.eval.numpy()) == b"AAAAZ"


def test_missing_or_empty_source_says_so(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ByteCorpus.load(DataConfig(source=str(tmp_path / "nothing-here")))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no bytes"):
        ByteCorpus.load(DataConfig(source=str(tmp_path)))


def test_shards_are_disjoint_equal_and_assigned_round_robin():
    split = torch.arange(1003)
    parts = [shard(split, shard_index=i, num_shards=4) for i in range(4)]
    assert [p.numel() for p in parts] == [250] * 4
    assert torch.equal(torch.cat(parts), split[:1000])  # contiguous, in order, no overlap
    assert [shard_index_for_peer(i, 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError):
        shard(split, shard_index=4, num_shards=4)


def _sampler(split, **overrides):
    kwargs = dict(shard_index=1, num_shards=4, batch_size=4, seq_len=16, seed=0) | overrides
    return BatchSampler(split, **kwargs)


def test_batches_come_from_the_own_shard_only():
    # Shard i holds only byte value i, so any byte from another shard would show.
    split = torch.arange(4).repeat_interleave(500).to(torch.uint8)
    for i in range(4):
        x, y = _sampler(split, shard_index=i).next_batch()
        assert bool((x == i).all()) and bool((y == i).all())


def test_batches_are_deterministic_shifted_by_one_and_differ_between_seeds():
    split = torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a, b = _sampler(split), _sampler(split)
    for _ in range(3):
        (xa, ya), (xb, yb) = a.next_batch(), b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.dtype == torch.int64 and xa.shape == (4, 16)
        assert torch.equal(xa[:, 1:], ya[:, :-1])
    x_other, _ = _sampler(split, seed=1).next_batch()
    assert not torch.equal(x_other, _sampler(split).next_batch()[0])


def test_sampler_resumes_from_its_json_state():
    split = torch.randint(0, 256, (20_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a = _sampler(split)
    for _ in range(3):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next_batch() for _ in range(2)]
    b = _sampler(split)
    b.load_state_dict(state)
    for (xe, ye), (xb, yb) in zip(expected, [b.next_batch() for _ in range(2)]):
        assert torch.equal(xe, xb) and torch.equal(ye, yb)
    with pytest.raises(ValueError):
        _sampler(split, shard_index=2).load_state_dict(state)


def test_sampler_refuses_a_shard_shorter_than_a_window():
    with pytest.raises(ValueError, match="fewer than"):
        _sampler(torch.zeros(40, dtype=torch.uint8), seq_len=16)


def test_eval_windows_span_the_eval_split():
    starts = eval_windows(torch.zeros(1000), batch_size=4, seq_len=10, num_batches=2)
    assert starts[0] == 0 and starts[-1] == 1000 - 11 and starts == sorted(starts) and len(starts) == 8


def test_eval_loss_is_deterministic_and_restores_the_mode():
    corpus = ByteCorpus.load(SMALL)
    model = build_model(ModelConfig(preset="tiny"), seed=0)
    model.train()
    first = eval_loss(model, corpus, batch_size=4, seq_len=64, num_batches=2)
    assert model.training
    assert first == eval_loss(model, corpus, batch_size=4, seq_len=64, num_batches=2)
    assert 4.0 < first < 6.5
