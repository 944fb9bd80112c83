"""The data fingerprint: a short hash of what a run trains on, so a peer with other data is refused.

Token files: each file's size and the SHA-256 of its first and last MiB (cheap on terabytes, and any
re-tokenization or reordering changes it), plus the token dtype. Text with a tokenizer: the hash of the text
and the tokenizer (the cache key of the tokenized file). Text as bytes: the hash of the bytes read (at most
``max_bytes``, 8 MB by default: ~10 ms), which the peer reads anyway.
The coordinator fills ``[data] fingerprint`` in from its copy of the files; each peer checks its own against it.
The built-in corpus (``source = "stdlib"``: the Python standard library's files) differs between Python builds
(3.11.7 and Debian's 3.11.2 hold different files), so a peer on another build is warned, not refused: it trains
on Python source all the same, but its shards and eval split are not the run's.

    python -m swarm.train.data.data_fingerprint RUN.toml    # print it (to pin it when the coordinator lacks the files)
"""

from __future__ import annotations

import hashlib
import logging
import platform
import sys
from pathlib import Path

from swarm.config import ConfigError, DataConfig, load_run_config

logger = logging.getLogger(__name__)

EDGE_BYTES = 1 << 20


def _file_digest(path: Path, digest: "hashlib._Hash") -> None:
    size = path.stat().st_size
    digest.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        digest.update(hashlib.sha256(f.read(EDGE_BYTES)).digest())
        f.seek(max(0, size - EDGE_BYTES))
        digest.update(hashlib.sha256(f.read(EDGE_BYTES)).digest())


def data_fingerprint(cfg: DataConfig) -> str:
    """The fingerprint of ``cfg``'s data as this machine has it."""
    from swarm.train.data.data_tokens import token_files

    digest = hashlib.sha256(f"swarm-data-v1:{cfg.kind}\0".encode())
    if cfg.kind == "bytes":
        from swarm.train.data.byte_corpus import ByteCorpus

        digest.update(ByteCorpus.load(cfg).digest.encode())
        return digest.hexdigest()
    if cfg.kind == "tokens":
        digest.update(cfg.token_dtype.encode())
        for path in token_files(cfg.tokens):
            _file_digest(path, digest)
        if cfg.eval_tokens:
            digest.update(b"eval\0")
            for path in token_files(cfg.eval_tokens):
                _file_digest(path, digest)
    else:
        from swarm.train.data.tokenized_text import cache_key, load_tokenizer, text_chunks

        load_tokenizer(cfg.tokenizer)  # a clear sentence when it is missing
        digest.update(cache_key(cfg, text_chunks(cfg)).encode())
    return digest.hexdigest()


def check_fingerprint(cfg: DataConfig) -> None:
    """ConfigError when the run pins a fingerprint and this machine's data has another (for the built-in
    corpus a warning: see the module's docstring)."""
    if not cfg.fingerprint:
        return
    mine = data_fingerprint(cfg)
    if mine != cfg.fingerprint and cfg.kind == "bytes" and cfg.source == "stdlib":
        logger.warning(
            "this peer's built-in corpus (the standard library of Python %s) differs from the run's"
            " (fingerprint %s, the run's %s): it trains on other shards and its eval losses are not"
            " comparable; for an exact run give every machine the same text files ([data] source = PATH).",
            platform.python_version(),
            mine[:16],
            cfg.fingerprint[:16],
        )
    elif mine != cfg.fingerprint:
        what = (
            f"[data] tokens {cfg.tokens!r}"
            if cfg.kind == "tokens"
            else f"[data] source {cfg.source!r}" + (f" with tokenizer {cfg.tokenizer!r}" if cfg.tokenizer else "")
        )
        raise ConfigError(
            f"this peer's data (fingerprint {mine[:16]}) differs from the run's ({cfg.fingerprint[:16]});"
            f" give it the same files as the coordinator's ({what})."
        )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m swarm.train.data.data_fingerprint RUN.toml", file=sys.stderr)
        return 2
    try:
        print(data_fingerprint(load_run_config(args[0]).data))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
