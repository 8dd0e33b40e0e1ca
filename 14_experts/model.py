"""Stage 14's model: stage 13's GPT with a mixture of experts (experts.py) where each block's MLP was: embeddings,
causal self-attention, experts, pre-norm blocks, a head that scores every next character. Under --cp a rank holds its
share of every sequence, and its attention reaches the others' (context_parallel.py, stage 12); under --pp a stage of
the pipeline holds some of the parts only (pipeline.py), so the blocks are numbered by a dict."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from context_parallel import ContextParallel
from experts import MoE

DTYPES = {"float32": torch.float32, "float64": torch.float64}  # --dtype: the weights'


class Config(NamedTuple):
    vocab: int  # characters in the vocabulary (65 in tiny Shakespeare)
    context: int = 64  # the longest sequence the model reads: its positions
    layers: int = 4  # transformer blocks
    heads: int = 4  # attention heads per block
    width: int = 128  # the residual stream's size; each head gets width // heads of it
    experts: int = 4  # E: experts per block, each an MLP of stage 11's size
    top_k: int = 2  # k: the experts each token goes to


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: each position mixes in what the positions before it hold."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(cfg.width, cfg.width) for _ in range(3))  # heads side by side
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.head_size = cfg.width // cfg.heads
        self.cp: ContextParallel | None = None  # --cp: set by parallelize(); x then holds this rank's share of t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # [b, t, heads * head_size] -> [b, heads, t, head_size]. "-1 heads": under --tp this rank holds only its
        # heads' rows of q, k and v (see TP_PLAN), so the same line computes its share of the heads.
        q, k, v = (f(x).view(b, t, -1, self.head_size).transpose(1, 2) for f in (self.q, self.k, self.v))
        if self.cp is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # position i sees positions 0..i only
        else:  # this rank's queries against every rank's keys and values: the one place the cp ranks talk
            y = self.cp.attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm: each part reads a normalised copy of the residual stream and adds its result back to it."""

    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(cfg.width), SelfAttention(cfg)
        self.norm2, self.moe = nn.LayerNorm(cfg.width), MoE(cfg.width, cfg.experts, cfg.top_k)  # was the MLP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.moe(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)  # what each character is
        self.positions = nn.Embedding(cfg.context, cfg.width)  # where it is
        # A dict by block number, not a list: a pipeline stage (--pp) keeps its blocks under their own numbers, so
        # that every layout names a weight alike (checkpoints resume on another one).
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)  # a score for every possible next character
        self.cp: ContextParallel | None = None  # --cp: set by parallelize(); the input then holds this rank's share
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() >= 2:  # the blocks' last layers add to the residual stream: smaller, so that it stays ~1
                last = name.endswith(("proj.weight", "proj_weight"))  # (an expert's: [E, width, 4 width])
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers) if last else 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids [b, t] -> logits [b, t, vocab]: at every position, the scores for the character after it.
        Under --cp, x is this rank's share of every sequence. Under --pp a stage holds some of the parts only
        (pipeline_stage): the first embeds, the last predicts, the others take and give the residual stream."""
        if self.tokens is not None:
            t = x.shape[1] * (1 if self.cp is None else self.cp.size)  # the whole sequence's length
            # Where this rank's tokens are, made on the device: never copied from the host in a step.
            where = torch.arange(t, device=x.device) if self.cp is None else self.cp.positions(t, x.device)
            x = self.tokens(x) + self.positions(where)
        for block in self.blocks.values():
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))


def parameters(cfg: Config) -> tuple[int, int]:
    """The whole model's parameters, and those a token uses (k of the E experts), counted on the meta device (no
    memory): no rank may hold them all."""
    with torch.device("meta"):
        model = GPT(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return total, total - experts + experts * cfg.top_k // cfg.experts

