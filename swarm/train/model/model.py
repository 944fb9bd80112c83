"""The embedded default model: a small byte-level GPT in nanoGPT style (vocabulary = 256 bytes).

``build_model(cfg, seed=...)`` gives bit-identical parameters for the same seed on every machine, so
all peers of a run start from the same global parameters without transferring them.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from swarm.config import MODEL_PRESETS, ModelConfig

log = logging.getLogger(__name__)

VOCAB_SIZE = 256  # one token per byte: no tokenizer to ship or agree on


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    n_layer: int
    n_head: int
    d_model: int
    context: int
    vocab_size: int = VOCAB_SIZE
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.d_model % self.n_head != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head}).")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=False)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: fewer parameters to train and send

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, 256) and, given targets, the mean cross-entropy in nats."""
        _, t = idx.shape
        if t > self.cfg.context:
            raise ValueError(f"sequence length {t} exceeds the model context {self.cfg.context}.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def gpt_config(cfg: ModelConfig) -> GPTConfig:
    """The GPTConfig a run's ModelConfig describes (preset plus overrides)."""
    if cfg.preset not in MODEL_PRESETS:
        raise ValueError(f"model preset {cfg.preset!r} is unknown; choose one of {sorted(MODEL_PRESETS)}.")
    shape = dict(MODEL_PRESETS[cfg.preset])
    if cfg.context is not None:
        shape["context"] = cfg.context
    return GPTConfig(**shape, dropout=cfg.dropout, vocab_size=cfg.vocab_size or VOCAB_SIZE)


def build_model(cfg: ModelConfig, *, seed: int, draw: bool = True) -> GPT:
    """A GPT on the CPU whose parameters depend only on ``cfg`` and ``seed``, bit for bit (``draw=False``: not
    drawn, for a caller that overwrites every parameter next)."""
    gcfg = gpt_config(cfg)
    # Module constructors draw from the global RNG; fork it so callers' random streams are untouched.
    # Every parameter is overwritten below anyway.
    with torch.random.fork_rng(devices=[]):
        model = GPT(gcfg)
    if not draw:
        return model
    gen = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * gcfg.n_layer)  # GPT-2: scale residual projections by depth
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # LayerNorm gains
                p.fill_(1.0)
            elif name.endswith("proj.weight"):
                p.copy_(portable_normal(p.shape, std=residual_std, generator=gen))
            else:
                p.copy_(portable_normal(p.shape, std=0.02, generator=gen))
    log.debug("built %s model (%d parameters) from seed %d", cfg.preset, model.param_count(), seed)
    return model


def portable_normal(shape: torch.Size, *, std: float, generator: torch.Generator) -> torch.Tensor:
    """Approximately normal samples that are bit-identical on every CPU.

    torch's ``normal_`` takes a vectorised path on AVX2 machines with its own log/cos, so its bits can
    differ between machines.  Here the only random op is integer ``randint`` (exact everywhere); the
    sum of four uniform integers (Irwin-Hall, clipped at ±3.5 std) is exact, converts to fp32 exactly
    (< 2**24), and one correctly rounded multiply scales it.
    """
    n = 1 << 16
    draws = torch.randint(0, n, (4, *shape), generator=generator, dtype=torch.int32)
    centred = 2 * (draws[0] + draws[1] + draws[2] + draws[3]) - 4 * (n - 1)  # mean 0, |x| < 2**18
    unit_std = 4.0 * math.sqrt((n * n - 1) / 12.0)  # std of `centred`
    scale = torch.tensor(std / unit_std, dtype=torch.float32)
    return centred.to(torch.float32) * scale


class PortableNormals:
    """``portable_normal``'s distribution (the sum of four uniform 16-bit integers, scaled once) from one
    stream of PCG64's raw 64-bit outputs, each split into its four 16-bit fields: exact integer work and one
    correctly rounded multiply, so bit-identical on every CPU, and about 30x faster than four ``randint``
    draws per element (a 350M-parameter model: ~4 s on one core). The stream continues across ``fill``
    calls, so a model's tensors drawn in order get the same bits however the stream is cut into chunks."""

    CHUNK = 1 << 18  # 2 MB of raw draws and 1 MB of sums: they stay in a core's cache

    def __init__(self, seed: int) -> None:
        self._bits = np.random.PCG64(seed)  # its raw output is fixed by the algorithm (not by numpy's version)

    @torch.no_grad()
    def fill(self, out: torch.Tensor, *, std: float) -> None:
        """Overwrite the fp32 CPU tensor ``out`` (contiguous) with draws of standard deviation ``std``."""
        self._fill(self._bits, out.detach().view(-1).numpy(), std)

    @torch.no_grad()
    def fill_all(self, tensors: list[torch.Tensor], *, std: float, threads: int = 1) -> None:
        """``fill`` each of ``tensors`` in order, the stream cut into ``threads`` stretches drawn at once (PCG64 jumps
        ahead exactly: the same bits as one thread)."""
        flats = [t.detach().view(-1).numpy() for t in tensors]
        total = sum(f.size for f in flats)
        threads = max(1, min(threads, total // self.CHUNK))
        if threads == 1:
            for flat in flats:
                self._fill(self._bits, flat, std)
            return
        bounds = [total * i // threads for i in range(threads + 1)]
        stretches: list[list[np.ndarray]] = [[] for _ in range(threads)]
        offset = 0
        for flat in flats:  # each tensor's elements, cut where a stretch ends
            for i in range(threads):
                lo, hi = max(bounds[i], offset), min(bounds[i + 1], offset + flat.size)
                if lo < hi:
                    stretches[i].append(flat[lo - offset : hi - offset])
            offset += flat.size
        streams = []
        for i in range(threads):
            bits = np.random.PCG64()
            bits.state = self._bits.state
            streams.append(bits.advance(bounds[i]))
        with concurrent.futures.ThreadPoolExecutor(threads - 1, thread_name_prefix="swarm-theta0") as pool:
            # numpy leaves the GIL while it draws and adds
            drawn = [pool.submit(self._fill_each, streams[i], stretches[i], std) for i in range(1, threads)]
            self._fill_each(streams[0], stretches[0], std)
            for future in drawn:
                future.result()
        self._bits.advance(total)

    def _fill_each(self, bits: np.random.PCG64, flats: list[np.ndarray], std: float) -> None:
        for flat in flats:
            self._fill(bits, flat, std)

    def _fill(self, bits: np.random.PCG64, flat: np.ndarray, std: float) -> None:
        n = 1 << 16
        unit_std = 4.0 * math.sqrt((n * n - 1) / 12.0)
        # 2·(sum − 2(n − 1)) · scale, computed as (sum − 2(n − 1)) · (2·scale): the same real product (a
        # power of two moves across), so the same correctly rounded fp32 bits
        twice_scale = np.float32(2 * float(torch.tensor(std / unit_std, dtype=torch.float32)))
        sums = np.empty(min(self.CHUNK, flat.size), dtype=np.int32)
        for start in range(0, flat.size, self.CHUNK):
            k = min(self.CHUNK, flat.size - start)
            fields = bits.random_raw(k).view(np.uint16).reshape(k, 4)  # each output's four 16-bit fields
            s = sums[:k]
            np.add(fields[:, 0], fields[:, 1], out=s, dtype=np.int32)
            np.add(s, fields[:, 2], out=s)
            np.add(s, fields[:, 3], out=s)
            s -= 2 * (n - 1)  # |s| < 2**17: exact in fp32
            np.multiply(s, twice_scale, out=flat[start : start + k], dtype=np.float32, casting="unsafe")


def model_fingerprint(model: nn.Module) -> str:
    """sha256 hex of parameter names, shapes and dtypes (not values): "same architecture" check."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
    return h.hexdigest()
