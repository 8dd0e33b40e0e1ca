"""Stage 11's model: a decoder-only transformer (GPT-2's shape, small), written out: embeddings, causal
self-attention, an MLP, pre-norm blocks, a head that scores every next character."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"float32": torch.float32, "float64": torch.float64}  # --dtype: the weights'


class Config(NamedTuple):
    vocab: int  # characters in the vocabulary (65 in tiny Shakespeare)
    context: int = 64  # the longest sequence the model reads: its positions
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads per block
    width: int = 128  # the residual stream's size; each head gets width // heads of it


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: each position mixes in what the positions before it hold."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(cfg.width, cfg.width) for _ in range(3))  # heads side by side
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.head_size = cfg.width // cfg.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # [b, t, heads * head_size] -> [b, heads, t, head_size]. "-1 heads": under --tp this rank holds only its
        # heads' rows of q, k and v (see TP_PLAN), so the same line computes its share of the heads.
        q, k, v = (f(x).view(b, t, -1, self.head_size).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # position i sees positions 0..i only
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(cfg.width, 4 * cfg.width), nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm: each part reads a normalised copy of the residual stream and adds its result back to it."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.width), SelfAttention(cfg)
        self.norm2, self.mlp = nn.LayerNorm(cfg.width), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)  # what each character is
        self.positions = nn.Embedding(cfg.context, cfg.width)  # where it is
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)  # a score for every possible next character
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # the blocks' last layers add to the residual stream: smaller, so that it stays ~1
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] -> logits [b, t, vocab]: at every position, the scores for the character after it."""
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

