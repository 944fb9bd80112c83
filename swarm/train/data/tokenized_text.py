"""Text with a Hugging Face tokenizer (``[data] source`` + ``tokenizer``): tokenized once and cached as a token
file named by the hash of the text and the tokenizer, so a second start (and every peer with the same files)
reads the cache. ``tokenizers`` is an optional dependency (``pip install 'swarm-train[hf]'``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from swarm.config import ConfigError, DataConfig
from swarm.train.data.text_files import source_files

log = logging.getLogger(__name__)

TOKENIZERS_MISSING = "[data] tokenizer needs Hugging Face tokenizers; install it with: pip install 'swarm-train[hf]'."


def load_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(TOKENIZERS_MISSING) from None
    if not Path(path).is_file():
        raise ConfigError(
            f"[data] tokenizer {path!r} does not exist; give a tokenizer.json (scripts/train_tokenizer.py makes one)."
        )
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the Rust library raises plain Exception for a malformed file
        raise ConfigError(
            f"[data] tokenizer {path!r} is not a tokenizer.json Hugging Face tokenizers reads ({e})."
        ) from None


def text_chunks(cfg: DataConfig) -> list[bytes]:
    """The source's files in sorted order, up to ``max_bytes`` in all (as the byte corpus reads them)."""
    chunks: list[bytes] = []
    total = 0
    for path in source_files(cfg.source):
        if cfg.max_bytes is not None and total >= cfg.max_bytes:
            break
        data = path.read_bytes()
        if cfg.max_bytes is not None:
            data = data[: cfg.max_bytes - total]
        chunks.append(data)
        total += len(data)
    if not total:
        raise ConfigError(f"[data] source {cfg.source!r} holds no text; point it at non-empty text files.")
    return chunks


def cache_key(cfg: DataConfig, chunks: list[bytes]) -> str:
    """SHA-256 of the tokenizer file and the text: equal keys, equal tokens."""
    digest = hashlib.sha256(b"swarm-tokenized-v1\0")
    digest.update(hashlib.sha256(Path(cfg.tokenizer).read_bytes()).digest())
    for chunk in chunks:
        digest.update(len(chunk).to_bytes(8, "little"))
        digest.update(chunk)
    return digest.hexdigest()


def cache_dir(cfg: DataConfig) -> Path:
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "swarm" / "tokens"


def token_dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenized_file(cfg: DataConfig) -> tuple[Path, str, int]:
    """The cached token file of ``cfg``'s text (made now when missing), its dtype and the tokenizer's vocab size."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype_for(vocab)
    chunks = text_chunks(cfg)
    path = cache_dir(cfg) / f"{cache_key(cfg, chunks)[:32]}.{dtype}.bin"
    if path.is_file():
        return path, dtype, vocab
    texts = [chunk.decode("utf-8", errors="replace") for chunk in chunks]
    ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in tokenizer.encode_batch(texts)])
    if ids.size < 2:
        raise ConfigError(f"[data] source {cfg.source!r} tokenizes to fewer than 2 tokens; give more text.")
    path.parent.mkdir(parents=True, exist_ok=True)
    # A private temporary name: peers on one machine may tokenize the same text at once; the last rename wins.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    os.replace(tmp, path)
    log.info("tokenized %s with %s: %d tokens cached in %s", cfg.source, cfg.tokenizer, ids.size, path)
    return path, dtype, vocab
