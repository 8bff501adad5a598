"""A small decoder-only transformer over bytes: the character LM of the convergence harness.

Pre-LayerNorm blocks (causal self-attention through
``torch.nn.functional.scaled_dot_product_attention``, then a GELU MLP of 4x the width), learned
positions, a final LayerNorm, and the output projection tied to the token embedding. No dropout:
a step depends only on the weights and the batch.

The default (:data:`DEFAULT_SIZE`: 3 layers, width 96, 4 heads, context 128) has 372,576
parameters: one training step of AdamW on a batch of 16 x 128 bytes (forward, backward, clipping
and the step) takes 0.15-0.18 s of CPU time on one core here (``torch.set_num_threads(1)``), so
that four workers and their servers can share a small machine. The cost grows with the
parameters: 4 layers of width 128 (0.84M) take about 0.3 s a step, 4 layers of width 256 (3.3M)
about 0.85 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelSize:
    """The shape of the model: ``width`` must be a multiple of ``heads``."""

    layers: int = 3
    width: int = 96
    heads: int = 4
    context: int = 128
    vocabulary: int = 256

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "context", "vocabulary"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not a multiple of heads {self.heads}")


DEFAULT_SIZE = ModelSize()


class Block(nn.Module):
    """``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=2)
        # (batch, heads, length, width / heads) for the attention kernel
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.projection(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class CharTransformer(nn.Module):
    """Next-byte logits ``(batch, length, vocabulary)`` from byte ids ``(batch, length)``,
    ``length <= size.context``."""

    def __init__(self, size: ModelSize = DEFAULT_SIZE) -> None:
        super().__init__()
        self.size = size
        self.embedding = nn.Embedding(size.vocabulary, size.width)
        self.positions = nn.Parameter(torch.zeros(size.context, size.width))
        self.blocks = nn.ModuleList(Block(size.width, size.heads) for _ in range(size.layers))
        self.final_norm = nn.LayerNorm(size.width)
        self._initialise()

    def _initialise(self) -> None:
        """GPT-2's: normal(0, 0.02) weights, zero biases, and the projections that write into
        the residual stream scaled by ``1/sqrt(2 * layers)``."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.01)
        residual_std = 0.02 / math.sqrt(2 * self.size.layers)
        for block in self.blocks:
            assert isinstance(block, Block)
            nn.init.normal_(block.projection.weight, std=residual_std)
            last = block.mlp[2]
            assert isinstance(last, nn.Linear)
            nn.init.normal_(last.weight, std=residual_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.size.context:
            raise ValueError(f"{length} tokens, more than the context of {self.size.context}")
        x = self.embedding(tokens) + self.positions[:length]
        for block in self.blocks:
            x = block(x)
        # Tied: the output projection is the token embedding's transpose.
        return F.linear(self.final_norm(x), self.embedding.weight)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters' elements (the tied embedding counted once)."""
    return sum(p.numel() for p in model.parameters())


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) over every position of the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
