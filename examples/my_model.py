"""An example ``[model] factory``: a small causal Transformer any run can train (docs/TRAINING.md).

[model]
factory = "examples.my_model:build"      # importable from the peer's and the coordinator's PYTHONPATH
loss = "examples.my_model:loss"          # optional: without it, model(x) must return logits
options = { vocab_size = 256, width = 32, layers = 2, heads = 4, context = 128 }
"""

from __future__ import annotations

import torch
from torch import nn

from swarm.train.model.model import portable_normal


class TinyCausalLM(nn.Module):
    def __init__(self, *, vocab_size: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=x.device)
        h = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))


def build(model_table: dict) -> nn.Module:
    """The factory: the run's whole [model] table in, the module out. Swarm seeds torch's global generator with
    the run's seed before calling it; drawing the weights with ``portable_normal`` (from an integer taken off that
    generator: integers are exact everywhere) makes θ0 bit-identical on every CPU, not only on alike ones."""
    o = model_table["options"]
    model = TinyCausalLM(
        vocab_size=o.get("vocab_size", 256),
        width=o.get("width", 32),
        layers=o.get("layers", 2),
        heads=o.get("heads", 4),
        context=o.get("context", 128),
    )
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(portable_normal(p.shape, std=0.02, generator=gen))
    return model


def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss hook: ``batch`` is (x, y), int64 (B, T), y the next token of x."""
    x, y = batch
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
