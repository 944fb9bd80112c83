"""The embedded corpus: bytes of the Python standard library (or the user's text files), a held-out
evaluation split, disjoint per-peer training shards and a resumable, deterministic batch sampler.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn

from swarm.config import ConfigError, DataConfig
from swarm.train.data.byte_corpus import ByteCorpus
from swarm.train.data.text_files import stdlib_files  # noqa: F401  (callers' import)

if TYPE_CHECKING:
    from swarm.train.data.data_tokens import TokenCorpus


def load_corpus(cfg: DataConfig) -> "ByteCorpus | TokenCorpus":
    """The run's corpus: text as bytes (the default), token files, or text through a tokenizer; checked against
    ``cfg.fingerprint`` when the run pins one."""
    from swarm.train.data.data_fingerprint import check_fingerprint
    from swarm.train.data.data_tokens import load_token_corpus

    check_fingerprint(cfg)
    if cfg.kind == "tokens":
        return load_token_corpus(cfg)
    if cfg.kind == "tokenized":
        from swarm.train.data.tokenized_text import tokenized_file

        path, dtype, vocab = tokenized_file(cfg)
        return load_token_corpus(
            dataclasses.replace(cfg, token_dtype=dtype, eval_tokens=""), tokens=str(path), vocab_size=vocab
        )
    return ByteCorpus.load(cfg)


def check_vocab(model_vocab: int | None, corpus: "ByteCorpus | TokenCorpus") -> None:
    """ConfigError when the model embeds fewer token ids than the data uses."""
    if model_vocab is None:
        return
    if corpus.vocab_size is not None and model_vocab < corpus.vocab_size:
        raise ConfigError(
            f"the model's vocabulary ({model_vocab} ids) is smaller than the data's tokenizer's"
            f" ({corpus.vocab_size}); set the model's vocab_size to at least {corpus.vocab_size}."
        )
    if model_vocab < corpus.min_vocab_size:
        raise ConfigError(
            f"the data holds token id {corpus.min_vocab_size - 1}, beyond the model's vocabulary of"
            f" {model_vocab} ids; set the model's vocab_size to at least {corpus.min_vocab_size}."
        )


def data_vocab_size(cfg: DataConfig) -> int | None:
    """The number of token ids the data is drawn from, known without reading it: 256 for text read as bytes, the
    tokenizer's vocabulary for text through one; None for token files (only reading them tells)."""
    if cfg.kind == "bytes":
        return ByteCorpus.vocab_size
    if cfg.kind == "tokenized":
        from swarm.train.data.tokenized_text import load_tokenizer

        return load_tokenizer(cfg.tokenizer).get_vocab_size(with_added_tokens=True)
    return None


def shard_index_for_peer(peer_index: int, num_shards: int) -> int:
    return peer_index % num_shards


def shard(split: torch.Tensor, *, shard_index: int, num_shards: int) -> torch.Tensor:
    """Contiguous shard ``shard_index`` of ``num_shards`` equal shards (the remainder is dropped, so
    shards never overlap)."""
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index must be in [0, {num_shards}), got {shard_index}.")
    size = split.numel() // num_shards
    return split[shard_index * size : (shard_index + 1) * size]


class BatchSampler:
    """Deterministic (x, y) int64 batches of random windows from one shard; y is x shifted by one.

    Batch k is drawn from a generator seeded by (seed, shard_index, k), so resuming needs only k.
    """

    def __init__(
        self,
        corpus_split: torch.Tensor,
        *,
        shard_index: int,
        num_shards: int,
        batch_size: int,
        seq_len: int,
        seed: int,
    ) -> None:
        self.data = shard(corpus_split, shard_index=shard_index, num_shards=num_shards)
        if self.data.numel() < seq_len + 1:
            raise ValueError(
                f"shard {shard_index} of {num_shards} holds {self.data.numel()} tokens, fewer than"
                f" seq_len + 1 = {seq_len + 1}; use fewer shards, a shorter seq_len or more data."
            )
        self.shard_index = shard_index
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.batches_drawn = 0
        self._window = torch.arange(seq_len + 1)

    def _generator(self, batch: int) -> torch.Generator:
        key = f"swarm-batch:{self.seed}:{self.shard_index}:{batch}".encode()
        return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        gen = self._generator(self.batches_drawn)
        self.batches_drawn += 1
        starts = torch.randint(0, self.data.numel() - self.seq_len, (self.batch_size, 1), generator=gen)
        windows = self.data[starts + self._window].long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def peek_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch, left to be drawn again."""
        batch = self.next_batch()
        self.batches_drawn -= 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"batches_drawn": self.batches_drawn, "shard_index": self.shard_index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("shard_index", self.shard_index) != self.shard_index or state.get("seed", self.seed) != self.seed:
            raise ValueError("sampler state belongs to another shard or seed; it cannot be resumed here.")
        self.batches_drawn = int(state["batches_drawn"])


def eval_windows(split: torch.Tensor, *, batch_size: int, seq_len: int, num_batches: int) -> list[int]:
    """Start offsets of ``batch_size * num_batches`` evenly spaced windows over ``split``."""
    last = split.numel() - seq_len - 1
    if last < 0:
        raise ValueError(f"the eval split ({split.numel()} bytes) is shorter than seq_len + 1; use more data.")
    total = batch_size * num_batches
    return [(k * last) // max(1, total - 1) for k in range(total)]


@torch.no_grad()
def eval_loss(
    model: nn.Module,
    corpus: "ByteCorpus | TokenCorpus",
    *,
    batch_size: int,
    seq_len: int,
    num_batches: int,
    loss: Optional[Callable] = None,
) -> float:
    """Mean loss (nats per token) over fixed windows of the eval split; the model's train/eval mode is
    restored afterwards. ``loss(model, (x, y))`` defaults to the built-in GPT's ``model(x, y)[1]``."""
    starts = torch.tensor(eval_windows(corpus.eval, batch_size=batch_size, seq_len=seq_len, num_batches=num_batches))
    device = next(model.parameters()).device
    windows = corpus.eval[starts[:, None] + torch.arange(seq_len + 1)].long()
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for b in range(num_batches):
            w = windows[b * batch_size : (b + 1) * batch_size].to(device)
            batch = (w[:, :-1], w[:, 1:])
            total += (loss(model, batch) if loss is not None else model(*batch)[1]).item()
    finally:
        model.train(was_training)
    return total / num_batches
