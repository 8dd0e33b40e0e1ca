"""Stage 12: context parallelism: every sequence split over processes, attention computed by passing keys round a ring.

Stage 11's GPT reads 64 characters at once; a model that reads 100,000 cannot hold one sequence's attention on one
device. Context parallelism (cp) cuts every sequence into pieces, one per cp rank: each rank embeds, normalises and
runs the MLP on its own tokens alone, and only attention, where a token reads all the tokens before it, needs the
others'. Here the keys and values travel round a ring of the cp ranks, one block a hop, while each rank attends to
the block it holds (ring attention); the partial results merge exactly with the online softmax; the backward goes
round the ring again. The zigzag split gives every rank the same share of a causal mask's work. The rest is stage
11's: DDP or FSDP2 over dp x cp (every cp rank holds a replica or a shard, and a gradient of its own tokens), tensor
parallelism (--tp), accumulation, checkpoints that resume on any layout; and stage 10's pipelining (--pp), the
blocks cut into stages, so that the GPT runs on all four dimensions at once: dp x pp x cp x tp.

    torchrun --standalone --nproc_per_node=2 12_context_parallel/train.py --cp 2 --max-steps 100
    torchrun --standalone --nproc_per_node=4 12_context_parallel/train.py --cp 2 --parallel fsdp --max-steps 20
    torchrun --standalone --nproc_per_node=4 12_context_parallel/train.py --cp 4 --context 2048 --batch-size 2 \
        --max-steps 4 --eval-every 4 --sample 0    # windows of 2,048 characters, 512 on each process
    torchrun --standalone --nproc_per_node=8 12_context_parallel/train.py --pp 2 --cp 2 --tp 2 --parallel fsdp \
        --accumulate 2 --max-steps 20    # 2 pipeline stages, each 2 cp x 2 tp processes
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch

if torch.__version__ < (2, 6):  # fully_shard (FSDP2) is public from torch 2.6; older ones fail on the imports below
    print(f"12_context_parallel/train.py: error: needs torch 2.6 or newer, not {torch.__version__}", file=sys.stderr)
    sys.exit(2)

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel as DDP

STAGE = "12_context_parallel"
# tiny Shakespeare, stage 11's text (11_gpt/data/README.md)
DATA = Path(__file__).resolve().parent.parent / "11_gpt" / "data" / "input.txt"
HELD_OUT = 0.1  # the last tenth of the text is never trained on: the held-out loss is measured there
DTYPES = {"float32": torch.float32, "float64": torch.float64}  # --dtype
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # --pp-schedule (stage 10's)


# ─── The data: characters of a real text ───────────────────────────────────────────────────────────────────────────

class Corpus(NamedTuple):
    chars: str  # the vocabulary: every character the text uses, sorted; a token is an index into it
    train: torch.Tensor  # the first 90% of the text as token ids
    held_out: torch.Tensor  # the last 10%


def load_corpus(path: Path) -> Corpus:
    text = path.read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))  # of the whole text, so that every held-out character has an id
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(len(tokens) * (1 - HELD_OUT))
    return Corpus(chars, tokens[:split], tokens[split:])


def baselines(corpus: Corpus) -> dict[str, float]:
    """The held-out loss (nats per character) of three models that need no training: "it learned" is a comparison.

    uniform: every character equally likely (ln of the vocabulary's size). unigram: each character as frequent as
    in the training text. bigram: the next character given this one, counted in the training text. Counts start at
    1 (add-one smoothing), so no held-out character has probability 0. They predict what the model predicts: every
    held-out character but the first.
    """
    v, train, held = len(corpus.chars), corpus.train, corpus.held_out
    unigram = torch.bincount(train, minlength=v).double() + 1
    pairs = (torch.bincount(train[:-1] * v + train[1:], minlength=v * v).double() + 1).view(v, v)
    return {"uniform": math.log(v),
            "unigram": -(unigram / unigram.sum()).log()[held[1:]].mean().item(),
            "bigram": -(pairs / pairs.sum(1, keepdim=True)).log()[held[:-1], held[1:]].mean().item()}


def batch_of_windows(tokens: torch.Tensor, context: int, rows: int, seed: int, step: int):
    """Step `step`'s batch: `rows` windows of `context` characters at random places, and the same shifted by one.

    One order for every layout: drawn from a generator seeded with seed + step, the same on every rank, so the
    global batch of a step does not depend on how many processes share it (each takes its rows, in Trainer).
    """
    g = torch.Generator().manual_seed(seed + step)
    starts = torch.randint(len(tokens) - context, (rows, 1), generator=g)
    positions = starts + torch.arange(context)
    return tokens[positions], tokens[positions + 1]  # the input, and the next character at every position


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch from the CPU to the training device without waiting: copied from pinned (page-locked) memory, a
    copy runs on the GPU's queue while Python goes on; from ordinary memory it would wait for the GPU to catch up."""
    return batch.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batch.to(device)


# ─── The model: a decoder-only transformer ─────────────────────────────────────────────────────────────────────────

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
        # A dict by block number, not a list: a pipeline stage (--pp) keeps its blocks under their own numbers, so
        # that every layout names a weight alike (checkpoints resume on another one).
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)  # a score for every possible next character
        self.cp: ContextParallel | None = None  # --cp: set by parallelize(); the input then holds this rank's share
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:  # the blocks' last layers add to the residual stream: smaller, so that it stays ~1
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers) if name.endswith("proj.weight") else 0.02)

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


def parameters(cfg: Config) -> int:
    """The whole model's parameters, counted on the meta device (no memory): no rank may hold them all."""
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


# ─── Context parallelism: every sequence split over the cp ranks ──────────────────────────────────────────────────

# Two ways, both exact. ring_attention: the blocks of keys and values travel round the ring of cp ranks, one hop a
# step, while each rank attends with its own queries to the block it holds; the partial results merge with the online
# softmax. A rank holds its own block, the one it computes on and the one arriving, never the whole sequence's, and
# each hop's transfer overlaps the compute on the block already there. allgather_attention: every rank gathers the
# whole sequence's keys and values, then attends locally (what Llama 3 did: simpler, and cheap where keys and values
# are small next to the queries, as with grouped-query attention; its memory grows with the whole sequence). Under a
# causal mask a contiguous split gives the last rank the most work (its queries see every key) and the first the
# least; the zigzag split (2 cp chunks, rank r holding chunks r and 2 cp - 1 - r) evens it out.

# Who holds which tokens.

def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of the 2 * cp chunks of the sequence that `rank` holds: one early, one late, so equal causal work."""
    return rank, 2 * cp - 1 - rank


def held_chunks(cp: int, rank: int, zigzag: bool) -> tuple[int, ...]:
    """The chunks of the sequence `rank` holds, in the order it holds them: 2 cp chunks (zigzag) or cp (contiguous)."""
    return zigzag_chunks(cp, rank) if zigzag else (rank,)


def local_positions(t: int, cp: int, rank: int, zigzag: bool, device: torch.device | None = None) -> torch.Tensor:
    """The global positions (0..t-1) of the tokens `rank` holds, in the order it holds them, made on `device`."""
    pieces = 2 * cp if zigzag else cp
    if t % pieces:
        raise ValueError(f"a sequence of {t} tokens does not split into {pieces} equal pieces")
    size = t // pieces
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in held_chunks(cp, rank, zigzag)])


def split_sequence(x: torch.Tensor, cp: int, rank: int, zigzag: bool, dim: int = 1) -> torch.Tensor:
    """`rank`'s share of a whole sequence (token ids, targets) along `dim`."""
    return x.index_select(dim, local_positions(x.shape[dim], cp, rank, zigzag, x.device))


def visible_parts(q_chunks: tuple[int, ...], k_chunks: tuple[int, ...], size: int,
                  causal: bool) -> Iterator[tuple[slice, slice, bool]]:
    """(query rows, key columns, diagonal) of each pair of chunks worth computing, between a rank's queries and one
    block of keys, each chunk `size` tokens. A chunk's positions are consecutive, so under the causal mask a pair is
    all visible (the keys' chunk earlier), all hidden (later: skipped, nothing to compute) or the diagonal (the same
    chunk: every query sees itself and the keys before it, so only the diagonal pays for a mask). Decided from chunk
    numbers, Python integers: nothing here reads a tensor or waits for a device."""
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            if not causal or kc <= qc:
                yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), causal and kc == qc


@functools.cache
def causal_mask(rows: int, before: int, device: torch.device) -> torch.Tensor:
    """[rows, before + rows], True where a query sees a key: the queries are the last `rows` positions of a sequence
    of before + rows keys, so query i sees keys 0 .. before + i. Made on the training device once per shape (not per
    layer and step): a mask made on the CPU would be copied to the GPU every time, and the copy waits."""
    return torch.ones(rows, before + rows, dtype=torch.bool, device=device).tril(before)


# Ring attention.

def ring_hop(x: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, list]:
    """Send x to the next rank of the ring and receive the previous rank's into a new tensor (once the works are done).

    The send and the receive are posted together, as one batch: posted one after the other, each rank's send could
    wait for its neighbour to receive (NCCL's large sends do), while the neighbour waits on its own send: a deadlock.
    """
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(x)
    works = dist.batch_isend_irecv([  # P2POp wants the peers' global ranks, not their ranks within the group
        dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group)])
    return received, works


def wait(works: list) -> None:
    for work in works:
        work.wait()


def float32_at_least(dtype: torch.dtype) -> torch.dtype:
    """What the ring computes and sums in: float32 for bfloat16 or float16 inputs (--amp), else the inputs' own.
    A bfloat16 sum keeps 8 bits: over many blocks and ranks its rounding adds up (FlashAttention, and torch's own
    context parallelism, likewise keep the softmax's statistics, the output's sum and the gradients in float32)."""
    return torch.promote_types(dtype, torch.float32)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, causal: bool,
                zigzag: bool) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = held_chunks(cp, rank, zigzag)
        size, scale, wide = q.shape[2] // len(mine), 1 / math.sqrt(q.shape[-1]), float32_at_least(q.dtype)
        # The online softmax keeps, for every query row, over the keys seen so far: the largest score m, the sum
        # total = sum_j exp(s_j - m), and acc = sum_j exp(s_j - m) v_j. Once every key is seen, output = acc / total.
        m = q.new_full(q.shape[:-1], -math.inf, dtype=wide)
        total = q.new_zeros(q.shape[:-1], dtype=wide)
        acc = torch.zeros_like(q, dtype=wide)
        q_wide = q.to(wide)  # the scores in float32 at least (a bfloat16 matmul's result would be rounded to bf16)
        kv = torch.stack([k, v])  # keys and values in one tensor, in the inputs' dtype: one send and receive a hop
        for step in range(cp):
            origin = (rank - step) % cp  # the rank whose keys and values we hold at this step
            if step < cp - 1:  # post the next block's transfer first: it travels while we compute on this one
                kv_next, works = ring_hop(kv, group)
            kv_wide = kv.to(wide)
            for rows, cols, diagonal in visible_parts(mine, held_chunks(cp, origin, zigzag), size, causal):
                s = q_wide[..., rows, :] @ kv_wide[0][..., cols, :].transpose(-2, -1) * scale
                if diagonal:  # exp(-inf) = 0: a key after the query adds nothing
                    s = s.masked_fill(~causal_mask(size, 0, s.device), -math.inf)
                m_new = torch.maximum(m[..., rows], s.amax(-1))
                # Exact, not approximate: exp(s - m_new) = exp(s - m) * exp(m - m_new), so multiplying the old sums
                # by alpha = exp(m - m_new) re-expresses them relative to the new maximum (alpha = 0 while m = -inf;
                # m_new is finite: every query row of a visible part sees at least one key).
                alpha = torch.exp(m[..., rows] - m_new)
                p = torch.exp(s - m_new[..., None])  # <= 1: the largest is exp(0), nothing overflows
                total[..., rows] = total[..., rows] * alpha + p.sum(-1)
                acc[..., rows, :] = acc[..., rows, :] * alpha[..., None] + p @ kv_wide[1][..., cols, :]
                m[..., rows] = m_new
            if step < cp - 1:
                wait(works)
                kv = kv_next
        out = acc / total[..., None]
        lse = m + torch.log(total)  # log sum_j exp(s_j): all the backward needs to recompute any probability exactly
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.zigzag = group, causal, zigzag
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, zigzag = ctx.group, ctx.causal, ctx.zigzag
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = held_chunks(cp, rank, zigzag)
        size, scale, wide, dtype = q.shape[2] // len(mine), 1 / math.sqrt(q.shape[-1]), out.dtype, q.dtype
        q, dout = q.to(wide), dout.to(wide)
        # Softmax's backward is dS = P * (dP - rowsum(dP * P)), and rowsum(dP * P) = rowsum(dO * O): one number per
        # query row, computed once here from the output instead of from every block's probabilities.
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        # The block's gradient travels in float32 at least: every rank of the ring adds its part to it on the way.
        dkv, dkv_works = torch.zeros_like(kv, dtype=wide), []  # before the first step, nobody has added to our block
        for step in range(cp):
            origin = (rank - step) % cp
            if step < cp - 1:
                kv_next, kv_works = ring_hop(kv, group)
            kv_wide = kv.to(wide)
            part = torch.zeros_like(kv_wide)  # this rank's part of the gradient of the block it holds (keys, values)
            for rows, cols, diagonal in visible_parts(mine, held_chunks(cp, origin, zigzag), size, causal):
                k_blk, v_blk = kv_wide[0][..., cols, :], kv_wide[1][..., cols, :]
                s = q[..., rows, :] @ k_blk.transpose(-2, -1) * scale
                if diagonal:
                    s = s.masked_fill(~causal_mask(size, 0, s.device), -math.inf)
                p = torch.exp(s - lse[..., rows, None])  # the forward's probabilities, recomputed from its lse
                dp = dout[..., rows, :] @ v_blk.transpose(-2, -1)
                ds = p * (dp - delta[..., rows, None])
                dq[..., rows, :] += ds @ k_blk * scale
                part[0][..., cols, :] += ds.transpose(-2, -1) @ q[..., rows, :] * scale
                part[1][..., cols, :] += p.transpose(-2, -1) @ dout[..., rows, :]
            wait(dkv_works)  # what the ranks that held this block before us added up: it came after the block
            part += dkv
            # On to the next rank with the block; after the last step that is the block's own rank: home.
            dkv, dkv_works = ring_hop(part, group)
            if step < cp - 1:
                wait(kv_works)
                kv = kv_next
        wait(dkv_works)
        dk, dv = dkv  # our own block's gradient, summed over every rank's queries
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, causal: bool,
                   zigzag: bool) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence's keys and values; q, k, v: [b, heads, t_local, d],
    this rank's tokens as local_positions(t, cp, rank, zigzag) lists them. causal: a token sees those up to itself."""
    # Autocast (--amp bf16) off: the ring chooses its own dtypes (float32_at_least), and autocast would run its
    # matrix products in bfloat16 again. (Its backward runs where .backward() is called: outside autocast.)
    with torch.autocast(q.device.type, enabled=False) if torch.amp.is_autocast_available(q.device.type) \
            else nullcontext():  # (autocast exists on CPUs and GPUs)
        return RingAttention.apply(q, k, v, group, causal, zigzag)


# All-gather attention.

class GatherSequence(torch.autograd.Function):
    """All ranks' shares of x, joined along the time dimension (dim 2), in rank order."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Every rank used our keys, so their gradient is the sum of every rank's part for our share: reduce-scatter,
        # summed in float32 at least, as the ring's.
        wide = float32_at_least(grad.dtype)
        parts = [part.to(wide).contiguous() for part in grad.chunk(dist.get_world_size(ctx.group), dim=2)]
        mine = torch.empty_like(parts[0])
        dist.reduce_scatter(mine, parts, group=ctx.group)
        return mine.to(grad.dtype), None


def in_sequence_order(x: torch.Tensor, cp: int, zigzag: bool) -> torch.Tensor:
    """Every rank's share of x [b, heads, t, d], gathered in rank order, put back in the sequence's order: each rank's
    share is its chunks, in the order held_chunks lists them."""
    per_rank = len(held_chunks(cp, 0, zigzag))
    pieces = x.chunk(cp * per_rank, dim=2)
    at = {c: pieces[r * per_rank + i] for r in range(cp) for i, c in enumerate(held_chunks(cp, r, zigzag))}
    return torch.cat([at[c] for c in sorted(at)], dim=2)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup, causal: bool,
                        zigzag: bool) -> torch.Tensor:
    """The same attention as ring_attention, by gathering the keys and values of the whole sequence first."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    keys, values = (in_sequence_order(GatherSequence.apply(x, group), cp, zigzag) for x in (k, v))
    if not causal:
        return F.scaled_dot_product_attention(q, keys, values)
    # The queries of chunk c see the keys of chunks 0 .. c, the last of those up to each query's own position.
    mine = held_chunks(cp, rank, zigzag)
    size = q.shape[2] // len(mine)
    return torch.cat([F.scaled_dot_product_attention(q[..., i * size:(i + 1) * size, :], keys[..., :(c + 1) * size, :],
                                                     values[..., :(c + 1) * size, :],
                                                     attn_mask=causal_mask(size, c * size, q.device))
                      for i, c in enumerate(mine)], dim=2)


class ContextParallel:
    """This rank's place in its cp group: which part of every sequence it holds, and how its attention reaches the
    rest. cp = 1 (no group) holds the whole sequence: the same code then runs as stage 11's."""

    def __init__(self, group: dist.ProcessGroup | None, impl: str = "ring", zigzag: bool = True) -> None:
        self.group, self.impl, self.zigzag = group, impl, zigzag
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of x [b, t, ...]: its part of every sequence (zigzag: chunks r and 2cp-1-r of 2cp)."""
        return x if self.size == 1 else split_sequence(x, self.size, self.rank, self.zigzag, dim=1)

    def positions(self, t: int, device: torch.device) -> torch.Tensor:
        """Where in a sequence of t tokens this rank's tokens are (for the position embedding), made on `device`."""
        return torch.arange(t, device=device) if self.size == 1 else \
            local_positions(t, self.size, self.rank, self.zigzag, device)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.impl == "allgather":
            return allgather_attention(q, k, v, self.group, causal=True, zigzag=self.zigzag)
        return ring_attention(q, k, v, self.group, causal=True, zigzag=self.zigzag)

    def gather(self, x: torch.Tensor, t: int) -> torch.Tensor:
        """Every rank's share of x [b, t / cp, ...] put back in sequence order: [b, t, ...] (for sampling)."""
        if self.size == 1:
            return x
        shares = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(shares, x.contiguous(), group=self.group)
        whole = torch.empty(x.shape[0], t, *x.shape[2:], dtype=x.dtype, device=x.device)
        for r, share in enumerate(shares):
            whole[:, local_positions(t, self.size, r, self.zigzag, x.device)] = share
        return whole

    def multiple(self) -> int:
        """A sequence's length must be a multiple of this to split evenly (zigzag: 2cp chunks)."""
        return 2 * self.size if self.zigzag and self.size > 1 else self.size


# ─── Pipeline parallelism: the blocks cut into stages ──────────────────────────────────────────────────────────────

# Stage 10's pipelining on the GPT: the pp ranks of a pipeline each hold a run of consecutive blocks, the first also
# the embeddings, the last also the final norm and the head (so the loss is computed there). A step's rows are cut
# into --accumulate micro-batches that follow one another through the stages, so that the stages work at once, each
# on another micro-batch; torch's schedule sends the activations forward and their gradients back (GPipe: every
# forward, then every backward; 1F1B: a backward as soon as one can start, so a stage holds the activations of at most
# pp micro-batches). The pp dimension is the outermost of the grid: a stage's ranks are consecutive (one node), and
# the pipeline's sends, the least traffic of all, are what crosses nodes.

def stage_blocks(layers: int, pp: int, rank: int) -> range:
    """The blocks stage `rank` of `pp` holds: consecutive, as many on each stage as can be (the first ones one more)."""
    size, extra = divmod(layers, pp)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


def pipeline_stage(model: GPT, pp: int, rank: int) -> GPT:
    """The model cut down to stage `rank` of `pp`: the other stages' parts removed (None: forward skips them)."""
    mine = stage_blocks(len(model.blocks), pp, rank)
    for i in [i for i in model.blocks if int(i) not in mine]:
        del model.blocks[i]
    if rank > 0:
        model.tokens = model.positions = None
    if rank < pp - 1:
        model.norm = model.head = None
    return model


def next_char_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss over the positions of logits [b, t, vocab], given the next characters y [b, t]."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Pipeline:
    """This rank's place in its pipeline. pp = 1 (no group) holds the whole model: the code then runs as without."""

    def __init__(self, group: dist.ProcessGroup | None, width: int, dtype: torch.dtype) -> None:
        self.group, self.width, self.dtype = group, width, dtype  # what passes between stages: [b, t, width], dtype
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.first, self.last = self.rank == 0, self.rank == self.size - 1

    @torch.no_grad()
    def forward(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor | None:
        """The logits for token ids idx [b, t] without a backward (evaluation, sampling): the whole batch through
        the stages one after another (micro-batches would only add steps: there is no backward to overlap with).
        The logits on the last stage, None on the others. Every stage is given idx: the shape of what it receives."""
        if self.size == 1:
            return model(idx)
        x = idx
        if not self.first:
            x = torch.empty(*idx.shape, self.width, dtype=self.dtype, device=idx.device)
            dist.recv(x, group=self.group, group_src=self.rank - 1)
        out = model(x)
        if self.last:
            return out
        dist.send(out.to(self.dtype).contiguous(), group=self.group, group_dst=self.rank + 1)  # (--amp: from bf16)
        return None

    def from_last(self, x: torch.Tensor) -> torch.Tensor:
        """x as the last stage holds it, on every stage of the pipeline (in place)."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=self.size - 1)
        return x


def load_train_objs(args: argparse.Namespace, corpus: Corpus, device: torch.device, mesh: DeviceMesh,
                    cp: ContextParallel, pipe: Pipeline):
    cfg = Config(len(corpus.chars), args.context, args.layers, args.heads, args.width)
    torch.manual_seed(args.seed)  # every rank draws the same initial weights (in float32, then cast)
    # --pp: every rank draws the whole model's, as one process does, and keeps its stage's part.
    model = parallelize(pipeline_stage(GPT(cfg), pipe.size, pipe.rank).to(device, DTYPES[args.dtype]), mesh, cp, args)
    # AdamW, as transformers are trained; created after parallelize, so that it holds this rank's pieces. Weight
    # decay pulls the matrices towards zero; not the biases and norms (a scale and a shift, nothing to regularise),
    # nor the embeddings (a character's row only learns when it appears: decay would erase the rare ones).
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay = [p for p in model.parameters() if p.dim() == 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if p.dim() < 2 or id(p) in embeddings]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.99))
    return cfg, model, optimizer


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """The rate of step `step` (from 0): up linearly for --warmup-steps (AdamW's first steps divide by moments
    estimated from a handful of gradients: full-size steps then can throw the weights off), then down along half a
    cosine to a tenth of --lr at --decay-steps (large steps while far from a minimum, small ones to settle into it),
    and a tenth after. A function of the step alone: a resumed run needs no scheduler state to carry on exactly."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    done = min(1.0, (step - args.warmup_steps) / max(1, args.decay_steps - args.warmup_steps))
    return args.lr / 10 + (args.lr - args.lr / 10) * 0.5 * (1 + math.cos(math.pi * done))


def clip_gradients(model: nn.Module, max_norm: float, pipe: Pipeline) -> torch.Tensor:
    """Scale the gradients down so that their norm, over the whole model, is at most max_norm (0: never); return
    the norm before. One rare large gradient then cannot undo many steps. The norm is of the whole gradient, as one
    process would compute it, however it is split: DDP's gradients are whole on every rank (already averaged), but
    a DTensor's (FSDP2's shards, tp's slices) is this rank's piece, and its norm a collective over the piece's mesh:
    DTensor sums the pieces' squares there (an all-reduce, inside get_total_norm). The embeddings and norms lie on
    the dp mesh, tp's layers on dp x tp: one norm per mesh (torch's clip_grad_norm_ refuses a mix), then the total,
    over the stages of the pipeline (--pp: each holds the gradient of its blocks only)."""
    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for params in by_mesh.values():  # the same meshes in the same order on every rank (the model's order)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)  # (already whole: a copy)
    total = torch.stack(squares).sum()
    if pipe.size > 1:
        dist.all_reduce(total, group=pipe.group)
    total = total.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.detach()


# ─── What the stages taught: who holds and computes what ───────────────────────────────────────────────────────────

def make_mesh(device: torch.device, shape: tuple[int, ...], names: tuple[str, ...], timeout: float) -> DeviceMesh:
    """Stage 09's grid, in as many dimensions as `shape` (the last one's ranks consecutive: one node), and along each
    dimension a process group for every line of ranks that differ in that coordinate alone, every one waiting
    --timeout like the world's: init_device_mesh would give them the backend's default, 30 minutes, so a stalled rank
    would hang the job."""
    grid = torch.arange(dist.get_world_size()).reshape(shape)
    wait = timedelta(seconds=timeout)
    groups = [dist.new_subgroups_by_enumeration(grid.movedim(d, -1).reshape(-1, n).tolist(), timeout=wait)[0]
              for d, n in enumerate(shape)]  # every rank makes every group, in the same order
    # On the training device explicitly: the default is cuda wherever a GPU is visible (pytorch#132471).
    return DeviceMesh.from_group(groups, device.type, mesh=grid, mesh_dim_names=names)


def make_cp_group(cp: int, tp: int, timeout: float) -> dist.ProcessGroup | None:
    """The cp ranks that split the same sequences: consecutive rows of a stage's (dp x cp, tp) grid, the same tp
    column. Rank r is (pp stage and dp row, cp rank, tp rank) = r // (cp tp), r // tp % cp, r % tp."""
    if cp == 1:
        return None
    grid = torch.arange(dist.get_world_size()).reshape(-1, cp, tp)
    group, _ = dist.new_subgroups_by_enumeration(grid.transpose(1, 2).reshape(-1, cp).tolist(),
                                                 timeout=timedelta(seconds=timeout))  # every rank makes every group
    return group


# Stage 09's pairing, on a transformer block: q, k and v split column-wise (each tp rank computes whole heads, its
# share of them, without talking), the attention's output projection row-wise (partial sums, all-reduced over tp);
# the MLP's first layer column-wise, its second row-wise. Per block, two all-reduces forward and four backward (the
# gradient of each column-wise layer's input is a sum over tp: q, k, v and the MLP's first layer).
# Embeddings, norms and the head stay whole on every tp rank (they are small here); FSDP2 shards them over dp.
TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.proj": RowwiseParallel(), "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}


def parallelize(model: GPT, mesh: DeviceMesh, cp: ContextParallel, args: argparse.Namespace) -> nn.Module:
    """The model as this rank trains it: its attention over cp (--cp), split over tp (--tp), compiled (--compile),
    then DDP or FSDP2 over dp x cp: every cp rank holds the whole model (or a shard of it, as a dp rank does) and
    computes a gradient of its own tokens' loss; averaged over dp x cp, that is the gradient of the global batch."""
    if cp.size > 1:
        model.cp = cp  # (for the positions its tokens are at)
        for block in model.blocks.values():
            block.attn.cp = cp
    if args.tp > 1:  # every rank built the same weights (the same seed): each keeps its slice, no broadcast
        for block in model.blocks.values():
            parallelize_module(block, mesh["tp"], TP_PLAN)
        # Gathering a weight split over tp and sharded over dp takes two all-gathers: torch warns, on every rank.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if args.compile:  # each block compiled on its own, in place (the parameters keep their names)
        for block in model.blocks.values():
            block.compile()
    if args.parallel == "fsdp":  # stage 08: each block a unit, gathered whole only while it computes
        # --amp bf16: the shards stay float32 (the optimizer's), gathered as bfloat16 (half the bytes) for the
        # forward and backward; the gradients are reduce-scattered in float32, so the average rounds as without it.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.amp == "bf16" \
            else MixedPrecisionPolicy()
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh["dp_cp"], mp_policy=mp)
        return fully_shard(model, mesh=mesh["dp_cp"], mp_policy=mp)  # the rest (embeddings, norm, head): the root
    # Stages 03-06: a replica per rank; the constructor broadcasts rank 0's weights, backward averages gradients.
    device = next(model.parameters()).device
    return DDP(model, device_ids=[device] if device.type == "cuda" else None, process_group=mesh.get_group("dp_cp"))


def full_model(model: nn.Module, cfg: Config, pipe: Pipeline) -> GPT | None:
    """The whole model as a plain GPT on rank 0's CPU, None on the other ranks (every rank calls this): the pieces
    are sent unit by unit and only rank 0 keeps them (full_state_dict with cpu_offload), as when saving one file.
    --pp: each stage's ranks gather its part so, and the stages send theirs to the first stage."""
    if pipe.size == 1:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:  # (cpu_offload keeps the state on global rank 0 only, which holds the first stage alone)
        part = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        parts = [{} for _ in range(pipe.size)] if pipe.first else None
        dist.gather_object({k: v.cpu() for k, v in part.items()}, parts, group=pipe.group, group_dst=0)
        state = {k: v for part in parts for k, v in part.items()} if pipe.first else {}
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):  # no memory and no random draws: the weights come from `state`
        full = GPT(cfg)
    full.load_state_dict(state, assign=True)  # (no "module." prefix: get_model_state_dict drops DDP's)
    return full


# ─── Training ──────────────────────────────────────────────────────────────────────────────────────────────────────

PROGRESS = "progress.json"  # beside the shards: steps done, losses, and the settings the checkpoint was made with
CHECKPOINT = re.compile(r"step_(\d{6,})")  # a complete checkpoint; "step_NNNNNN.tmp" is one being written
# AdamW's state and settings saved under each parameter's name, not per param group: a checkpoint then names every
# value alike whichever parameters a rank's groups hold (stage 12's pipeline stages hold some blocks only).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    found = [p for p in directory.iterdir() if CHECKPOINT.fullmatch(p.name)] if directory.is_dir() else []
    return sorted(found, key=lambda p: int(CHECKPOINT.fullmatch(p.name).group(1)))


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, corpus: Corpus, cfg: Config,
                 args: argparse.Namespace, mesh: DeviceMesh, cp: ContextParallel, pipe: Pipeline,
                 device: torch.device, snapshot: dict | None) -> None:
        self.model, self.optimizer, self.corpus, self.cfg, self.args = model, optimizer, corpus, cfg, args
        self.mesh, self.cp, self.pipe, self.device = mesh, cp, pipe, device
        self.schedule = None
        if pipe.size > 1:  # --pp: runs a step's micro-batches through the stages, forward and backward
            stage = PipelineStage(model, pipe.rank, pipe.size, device, group=pipe.group)
            # Each micro-batch's loss is its mean; divided by their number (scale_grads), the gradients are of the
            # step's mean, as --accumulate's loss / len(micro) computes them without --pp.
            self.schedule = SCHEDULES[args.pp_schedule](stage, n_microbatches=args.accumulate,
                                                        loss_fn=next_char_loss, scale_grads=True)
        # The dp x cp ranks of a tp column: dp rows of cp ranks, each row the same windows, each rank its share.
        self.dp_rank, self.dp = mesh.get_local_rank("dp_cp") // cp.size, mesh["dp_cp"].size() // cp.size
        self.master_process = dist.get_rank() == 0  # rank 0 alone logs and writes the progress file
        self.global_batch = self.dp * args.accumulate * args.batch_size  # windows per optimizer step
        self.steps, self.losses, self.curve = 0, [], []  # per step; per log line [step, train, held-out, tokens/s]
        self.grad_norms: list[float] = []  # per step, before clipping (the global batch's gradient: every rank's)
        self.pending: list[torch.Tensor] = []  # [loss, gradient norm] of each step not yet in the lists above
        self.train_seconds = 0.0  # in this run's training steps (not the evaluations, not the checkpoints)
        self.trajectory: list[dict] = []  # --out: the state at the start, at each checkpoint and at the end
        # A fixed handful of held-out windows, scored every --eval-every steps for the curve (the same on every rank).
        starts = torch.linspace(0, len(corpus.held_out) - cfg.context - 1, 16).long()[:, None]
        positions = starts + torch.arange(cfg.context)
        self.curve_windows = (corpus.held_out[positions], corpus.held_out[positions + 1])
        if snapshot is not None:
            self._load_snapshot(snapshot)
        self.resumed_at = self.steps

    def _load_snapshot(self, snapshot: dict) -> None:
        # Stage 08's: dcp.load fills this run's pieces (on any number of ranks, any layout) from whichever files hold
        # them. No random state to restore: the data of step s depends on --seed and s alone.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FLAT)  # (AdamW's zeros)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=snapshot["path"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=FLAT)
        self.steps, self.losses, self.curve = snapshot["steps"], list(snapshot["losses"]), list(snapshot["curve"])
        self.grad_norms = list(snapshot["grad_norms"])

    def _save_snapshot(self) -> None:
        # Every rank writes its own pieces (dcp.save), rank 0 the metadata; then an atomic rename, as in stage 08.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FLAT)
        final = self.args.snapshot / f"step_{self.steps:06d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        except (Exception, dcp.CheckpointException) as e:  # raised on every rank if any rank failed to write
            if self.master_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise failed_save(e, tmp, self.args.snapshot) from None
        if self.master_process:
            progress = {"steps": self.steps, "losses": self.losses, "curve": self.curve, "seed": self.args.seed,
                        "grad_norms": self.grad_norms, "schedule": schedule(self.args),
                        "global_batch": self.global_batch, "dtype": self.args.dtype, "model": self.cfg._asdict(),
                        "world_size": dist.get_world_size()}
            (tmp / PROGRESS).write_text(json.dumps(progress) + "\n")
            os.replace(tmp, final)  # a directory named step_N is complete; only then is the previous one removed
            for old in checkpoints(self.args.snapshot)[:-1]:
                shutil.rmtree(old)

    def syncing(self, last: bool):
        """--accumulate: average the gradients over the dp ranks once per step, in the last micro-batch's backward."""
        if isinstance(self.model, DDP):
            return nullcontext() if last else self.model.no_sync()  # inside no_sync, backward only adds to .grad
        self.model.set_requires_gradient_sync(last)  # FSDP2: no reduce-scatter until the last micro-batch
        return nullcontext()

    def _run_step(self) -> torch.Tensor:
        x, y = batch_of_windows(self.corpus.train, self.cfg.context, self.global_batch, self.args.seed, self.steps)
        # This dp rank's rows: r, r + dp, ... (the tp ranks of a row take the same ones: they compute one forward
        # together), cut into --accumulate micro-batches. W ranks of batch b see the windows one process of W*b sees.
        # Of each window, this cp rank's share of the positions (its cp group's ranks take the rest). The stages of a
        # pipeline (--pp) take the same rows: each computes its blocks' part of them.
        mine = slice(self.dp_rank, None, self.dp)
        x, y = (to_device(self.cp.share(t[mine]), self.device) for t in (x, y))  # the step's one copy from the host
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        # --amp bf16: the forward's matmuls in bfloat16, the weights and the loss in float32 (recipes/).
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.amp == "bf16")
        if self.schedule is not None:  # the first stage is given the inputs, the last the targets, and the losses
            losses: list[torch.Tensor] = []
            with amp:  # sync points: the stages' sends and receives; FSDP2's reduce-scatter after the last backward
                self.schedule.step(*([x] if self.pipe.first else []), target=y if self.pipe.last else None,
                                   losses=losses if self.pipe.last else None)
            if self.pipe.last:
                total += torch.stack(losses).detach().sum()
        else:
            micro = list(zip(x.split(self.args.batch_size), y.split(self.args.batch_size), strict=True))
            for i, (xb, yb) in enumerate(micro):
                with self.syncing(last=i == len(micro) - 1):
                    with amp:
                        # The mean over this rank's tokens: each cp rank holds as many, so the cp ranks' mean loss is
                        # the windows' loss, and their averaged gradient (DDP's, FSDP2's) the windows' gradient.
                        loss = next_char_loss(self.model(xb), yb)
                    # Sync point (the last micro-batch): DDP all-reduces the gradients, FSDP2 reduce-scatters them.
                    (loss / len(micro)).backward()
                total += loss.detach()
        norm = clip_gradients(self.model, self.args.clip, self.pipe)  # a collective under FSDP2, tp and pp
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.steps, self.args)
        self.optimizer.step()  # on this rank's pieces: no communication
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([total / self.args.accumulate, norm.to(total.dtype)])  # the step's loss, gradient norm

    @torch.no_grad()
    def estimate_held_out(self) -> float:
        """The loss on the fixed held-out windows (16 x --context characters): a point of the curve."""
        self.model.eval()
        x, y = (self.cp.share(t).to(self.device) for t in self.curve_windows)  # every cp group: the same windows
        logits = self.pipe.forward(self.model, x)  # None but on the last stage
        loss = torch.zeros((), dtype=torch.float64, device=self.device) if logits is None else \
            F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum")
        if self.cp.size > 1:  # each cp rank scored its share of the positions
            dist.all_reduce(loss, group=self.cp.group)
        self.pipe.from_last(loss)
        loss = loss.item() / y.numel() / self.cp.size
        if not isinstance(self.model, DDP):  # FSDP2 keeps the root unit gathered after a forward, for the backward
            self.model.reshard()  # that follows in training; none follows here
        self.model.train()
        return loss

    def train(self, max_steps: int) -> None:
        self.record()
        if self.steps >= max_steps and self.master_process:  # a finished checkpoint: say so, do not look stuck
            print(f"nothing to train: the checkpoint is at step {self.steps} and --max-steps is {max_steps}; "
                  f"pass --max-steps {self.steps + 100} --decay-steps {self.args.decay_steps} to train 100 more at "
                  f"the schedule's last rate, or another --snapshot to start afresh")
        since, seconds, tokens_per_step = 0, 0.0, self.global_batch * self.cfg.context
        while self.steps < max_steps:
            start = clock(self.device)  # (a GPU runs ahead of Python: the clock waits for its queued work)
            self.pending.append(self._run_step())  # tensors: reading them now would wait for the GPU every step
            self.steps += 1
            since += 1
            seconds += clock(self.device) - start
            log = self.steps % self.args.eval_every == 0 or self.steps == max_steps
            save = self.args.snapshot is not None and self.steps % self.args.save_every == 0
            if log or save:  # the checkpoint keeps every step's numbers: settle them first
                self._settle()
            if log:
                speed = since * tokens_per_step / seconds
                self.curve.append([self.steps, sum(self.losses[-since:]) / since, self.estimate_held_out(), speed])
                if self.master_process:
                    print(f"step {self.steps:>5}/{max_steps} | train loss {self.curve[-1][1]:.4f} | held-out "
                          f"{self.curve[-1][2]:.4f} | lr {learning_rate(self.steps - 1, self.args):.2e} | grad norm "
                          f"{self.grad_norms[-1]:.2f} | {speed:,.0f} tokens/s")
                self.train_seconds += seconds
                since, seconds = 0, 0.0
            if save:
                self._save_snapshot()
                dist.barrier()  # sync point: past it, the checkpoint of this step is complete on every rank
                self.record()
        if self.trajectory and self.trajectory[-1]["step"] != self.steps:
            self.record()

    def _settle(self) -> None:
        """The steps' losses and gradient norms since the last call, from tensors to the lists: the loss averaged
        over the dp x cp ranks is the global batch's (the tp ranks of a row hold the same), one all_reduce for all."""
        losses, norms = torch.stack(self.pending).T.contiguous()  # (a collective needs contiguous memory)
        dist.all_reduce(losses, group=self.mesh.get_group("dp_cp"))
        self.pipe.from_last(losses)  # --pp: the last stage computed them
        self.losses += (losses / (self.dp * self.cp.size)).tolist()
        self.grad_norms += norms.tolist()  # the same on every rank: the whole gradient's
        self.pending = []

    def record(self) -> None:
        """--out: keep the whole state (gathered: every rank calls this), for the tests to compare runs step by step."""
        if self.args.out is not None:
            self.trajectory.append(state_at(self.model, self.optimizer, self.steps, self.pipe))


def padded(window: torch.Tensor, multiple: int, fill: int) -> torch.Tensor:
    """window [b, n] with `fill` appended up to a length cp can split. At the end: under the causal mask no real
    position reads them, so they change nothing before them."""
    return F.pad(window, (0, -window.shape[1] % multiple), value=fill)


@torch.no_grad()
def held_out_loss(model: nn.Module, tokens: torch.Tensor, context: int, mesh: DeviceMesh, cp: ContextParallel,
                  pipe: Pipeline, device: torch.device) -> tuple[float, int]:
    """Sum of the losses on every held-out character but the first, in windows of `context`, with the model as it
    trains (sharded, split: no rank holds it whole). The dp rows share the windows (row r scores r, r+dp, ...: each
    once; a row's tp ranks score the same ones together, its cp ranks each their share of the positions); every rank
    runs as many batches (FSDP's forward is a collective: each unit all-gathers), some maybe empty; one all_reduce
    over dp x cp adds the sums (--pp: the last stage's, then sent to the other stages)."""
    model.eval()
    dp_rank, dp = mesh.get_local_rank("dp_cp") // cp.size, mesh["dp_cp"].size() // cp.size
    starts = torch.arange(0, len(tokens) - 1, context)
    whole, tail = starts[starts + context + 1 <= len(tokens)], starts[starts + context + 1 > len(tokens)]
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for chunk in whole[dp_rank::dp].tensor_split(-(-len(whole) // (dp * 32))):  # batches of up to 32 windows
        windows = tokens[chunk[:, None] + torch.arange(context + 1)]
        x, y = cp.share(windows[:, :-1]).to(device), cp.share(windows[:, 1:]).to(device)
        logits = pipe.forward(model, x)
        if logits is not None:
            totals += torch.tensor([F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum")
                                    .item(), y.numel()], dtype=torch.float64, device=device)
    for start in tail.tolist():  # the text's last window is shorter: every rank computes it, dp row 0 counts it
        window = tokens[start:][None]
        x, y = padded(window[:, :-1], cp.multiple(), 0), padded(window[:, 1:], cp.multiple(), -100)  # -100: ignored
        x, y = cp.share(x).to(device), cp.share(y).to(device)
        logits = pipe.forward(model, x)
        if dp_rank == 0 and logits is not None:
            totals += torch.tensor([F.cross_entropy(logits[0].double(), y[0], reduction="sum").item(),
                                    (y != -100).sum().item()], dtype=torch.float64, device=device)
    if hasattr(model, "reshard"):  # FSDP2 keeps the root unit gathered after a forward, for a backward: none follows
        model.reshard()
    model.train()
    dist.all_reduce(totals, group=mesh.get_group("dp_cp"))
    pipe.from_last(totals)
    return totals[0].item(), int(totals[1].item())


@torch.no_grad()
def sample(model: nn.Module, chars: str, length: int, context: int, seed: int, cp: ContextParallel, pipe: Pipeline,
           device: torch.device, temperature: float = 0.8) -> str:
    """`length` characters, each drawn from the model's prediction given those before it (its last `context`).
    Every rank runs it with the model as it trains (its forward is a collective): the same seed, the same logits
    (every rank computes them whole, or, under --cp, gathers them from its cp group; under --pp, the last stage sends
    them to the others), so the same characters."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([[chars.find("\n") if "\n" in chars else 0]])  # start as a line starts
    for _ in range(length):
        n = idx[:, -context:].shape[1]
        x = padded(idx[:, -context:], cp.multiple(), 0)  # cp splits a multiple of cp.multiple() positions
        logits = pipe.forward(model, cp.share(x).to(device))
        row = torch.empty(len(chars), dtype=torch.float64, device=device) if logits is None else \
            cp.gather(logits, x.shape[1])[0, n - 1].double()
        logits = pipe.from_last(row).cpu()
        next_char = torch.multinomial((logits / temperature).softmax(-1), 1, generator=g)
        idx = torch.cat([idx, next_char[None]], dim=1)
    if hasattr(model, "reshard"):
        model.reshard()
    model.train()
    return "".join(chars[i] for i in idx[0, 1:].tolist())


def replica_max_abs_diff(model: nn.Module, group: dist.ProcessGroup) -> float:
    """DDP's replicas over `group` (dp): gather every rank's parameters (with --tp, its own slices, which its dp
    replicas hold too); return the largest difference from the first's."""
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in local])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # ArgumentParser and positive() are defined below the line: a bad value is one line of error and exit 2.
    p = ArgumentParser(prog=f"{STAGE}/train.py", description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=positive(int), default=800,
                   help="optimizer steps in all (the length of training: a text has no epochs here; a resumed "
                        "run goes on to it)")
    p.add_argument("--batch-size", type=positive(int), default=16, help="windows per micro-batch per dp rank")
    p.add_argument("--lr", type=positive(float), default=6e-3, help="AdamW's top learning rate (see --warmup-steps)")
    p.add_argument("--warmup-steps", type=positive(int),
                   help="steps of the rate's linear rise to --lr (default: a twentieth of --decay-steps)")
    p.add_argument("--decay-steps", type=positive(int),
                   help="the step where the rate's cosine decay reaches --lr / 10 (default: --max-steps)")
    p.add_argument("--clip", type=float, default=1.0, help="the largest gradient norm a step takes (0: no clipping)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="float64 rounds 5e8 times finer than float32: for checking results, not for speed")
    p.add_argument("--out", type=Path, help="write summary.json, model.pt and trajectory.pt here")
    p.add_argument("--timeout", type=positive(float), default=60.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    p.add_argument("--snapshot", type=Path,
                   help="checkpoint directory: resumed from if it holds one, written during training")
    p.add_argument("--save-every", type=positive(int), default=100, help="steps between checkpoints")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                   help="over the dp ranks: a replica each (DDP) or a shard each (FSDP2, every block a unit)")
    p.add_argument("--tp", type=positive(int), default=1,
                   help="tensor-parallel degree: processes that split every block (with --parallel fsdp)")
    p.add_argument("--cp", type=positive(int), default=1,
                   help="context-parallel degree: processes that split every sequence (--context must be a multiple "
                        "of 2 x cp)")
    p.add_argument("--cp-impl", choices=["ring", "allgather"], default="ring",
                   help="how a cp rank's queries reach the others' keys and values: passed round a ring, one block "
                        "a hop (memory of a few blocks), or all gathered at once (memory of the whole sequence)")
    p.add_argument("--no-zigzag", action="store_true",
                   help="give each cp rank one contiguous piece of the sequence (the later pieces then do more of "
                        "the causal attention's work) instead of chunks r and 2cp-1-r")
    p.add_argument("--pp", type=positive(int), default=1,
                   help="pipeline-parallel degree: processes that split the blocks into stages, one after another "
                        "(--layers at least pp; --accumulate micro-batches go through them)")
    p.add_argument("--pp-schedule", choices=list(SCHEDULES), default="1f1b",
                   help="the order of the micro-batches' forwards and backwards on a stage (stage 10)")
    p.add_argument("--accumulate", type=positive(int), default=1,
                   help="micro-batches of --batch-size per step (under --pp, the pipeline's micro-batches)")
    p.add_argument("--amp", choices=["bf16"], help="autocast the forward to bfloat16 (the weights stay float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    p.add_argument("--data", type=Path, default=DATA, help="a UTF-8 text to learn (default: tiny Shakespeare)")
    p.add_argument("--context", type=positive(int), default=64, help="characters the model reads at once")
    p.add_argument("--layers", type=positive(int), default=4, help="transformer blocks")
    p.add_argument("--heads", type=positive(int), default=4, help="attention heads per block")
    p.add_argument("--width", type=positive(int), default=128, help="size of the residual stream")
    p.add_argument("--eval-every", type=positive(int), default=50, help="steps between log lines (and curve points)")
    p.add_argument("--sample", type=int, default=500, help="characters to generate at the end (0: none)")
    return check_gpt_args(p, check_checkpoint_arg(p, check_args(p, p.parse_args(argv))))


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def clock(device: torch.device) -> float:
    """Seconds on a steady clock, read once the GPU has finished its queued work: CUDA runs asynchronously, so a
    clock read without waiting would time the kernels' launches, not the kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def restart_safe_store(timeout: float) -> dist.Store | None:
    """torchrun's store, with a key prefix of its own for each restart of the group.

    torchrun keeps one store across restarts, while torch assumes a fresh one per attempt
    (pytorch/pytorch#135712): restarted workers can then read the previous attempt's addresses
    and fail ("Gloo connectFullMesh failed ... Connection refused") or hang.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # not under torchrun's agent: init_process_group makes its own store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def ddp_setup(ddp: bool, device: torch.device, timeout: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank also allocates on GPU 0
    # (torchrun already set OMP_NUM_THREADS=1, so the ranks do not oversubscribe the CPU cores.)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if ddp:  # sync point: init reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun's env
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout), store=restart_safe_store(timeout),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:  # plain `python train.py`: a group of one, kept in memory, so the rest runs unchanged
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, mesh: DeviceMesh,
          cp: ContextParallel, pipe: Pipeline, snapshot: dict | None) -> None:
    master_process = rank == 0
    corpus = load_corpus(args.data)
    cfg, model, optimizer = load_train_objs(args, corpus, device, mesh, cp, pipe)
    trainer = Trainer(model, optimizer, corpus, cfg, args, mesh, cp, pipe, device, snapshot)
    dp = trainer.dp
    floor = baselines(corpus)
    if master_process:
        fallback = " (no GPU visible: using the CPU)" if args.device == "auto" and device.type == "cpu" else ""
        options = ", ".join(o for o in [f"--accumulate {args.accumulate}" if args.accumulate > 1 else "",
                                        f"--amp {args.amp}" if args.amp else "", "--compile" if args.compile else ""]
                            if o)
        how = f" ({args.cp_impl}{', zigzag' if cp.zigzag else ', contiguous'})" if cp.size > 1 else ""
        stages = f"pp {pipe.size} ({args.pp_schedule}, {args.accumulate} micro-batch" \
            f"{'es' if args.accumulate > 1 else ''}) x " if pipe.size > 1 else ""
        print(f"[{STAGE}] world size {world_size} = dp {dp} x {stages}cp {cp.size}{how} x tp {args.tp} | "
              f"{args.parallel} | backend {dist.get_backend()} | device {device.type}{fallback} | {args.dtype}"
              + (f" | {options}" if options else ""))
        print(f"data: {args.data.name}, {len(corpus.train) + len(corpus.held_out):,} characters ({len(corpus.chars)} "
              f"distinct): {len(corpus.train):,} to train on, the last {len(corpus.held_out):,} held out")
        print(f"model: {cfg.layers} blocks, {cfg.heads} heads, width {cfg.width}, context {cfg.context}: "
              f"{parameters(cfg):,} parameters | batch {args.batch_size} x "
              f"{args.accumulate} windows per dp rank, {trainer.global_batch} global = "
              f"{trainer.global_batch * cfg.context:,} tokens a step | {args.max_steps} steps"
              + (f" | {cfg.context // cp.size} positions of each window per cp rank" if cp.size > 1 else ""))
        print(f"AdamW: learning rate up to {args.lr:g} in {args.warmup_steps} steps, then a cosine down to "
              f"{args.lr / 10:g} at step {args.decay_steps} | weight decay 0.1 on the matrices | "
              + (f"gradient norm clipped to {args.clip:g}" if args.clip else "no clipping"))
        print("baselines, held-out loss in nats per character: " + " | ".join(f"{k} {v:.3f}" for k, v in floor.items()))
        if trainer.steps:
            ranks = snapshot["world_size"]
            print(f"resumed from {snapshot['path']} (written by {ranks} rank{'s' if ranks > 1 else ''}) at step "
                  f"{trainer.steps}")
    start = clock(device)
    trainer.train(args.max_steps)
    seconds = clock(device) - start

    loss_sum, count = held_out_loss(model, corpus.held_out, cfg.context, mesh, cp, pipe, device)
    # DDP's replicas must agree; FSDP has none to compare (each rank holds other shards): no gather of the model.
    max_diff = replica_max_abs_diff(model, mesh.get_group("dp_cp")) if args.parallel == "ddp" else None
    memory = peak_memory(model, optimizer, device)  # every rank's, gathered (below the line)
    peak = machine_peak(device, args)  # the FLOP/s the MFU is of: measured on a CPU, every rank at once (below)
    text = sample(model, corpus.chars, args.sample, cfg.context, args.seed, cp, pipe, device) if args.sample else ""
    if master_process:
        loss = loss_sum / count
        print(f"held-out loss {loss:.4f} nats/char over {count:,} characters | bigram {floor['bigram']:.3f}, "
              f"unigram {floor['unigram']:.3f}, uniform {floor['uniform']:.3f}")
        speed = report_speed(trainer, cfg, device, peak)
        print(f"peak memory per rank ({memory['how']}): " + " | ".join(
            f"rank {r} {m / 2**20:,.0f} MiB" for r, m in enumerate(memory["peak"])) + " | model state per rank "
            "(weights, gradients, AdamW's moments): " + " | ".join(f"{b / 2**20:.2f} MiB" for b in memory["state"]))
        if text:
            print(f"sample ({args.sample} characters, temperature 0.8):\n{text}")
    if args.out is not None:  # model.pt: the whole model, gathered once at the end, onto rank 0's CPU only
        full = full_model(model, cfg, pipe)
        if master_process:
            write_run(args, trainer, full, floor, (loss, count), seconds, speed, memory, max_diff, text)
    if max_diff:  # every rank of a dp group computed the same max_diff (all_gather), so they stop here together
        raise RuntimeError(f"DDP's replicas diverged (max |difference| {max_diff:.3g})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if pick_device(args.device).type == "cuda" else torch.device("cpu")
    try:  # check the checkpoint before joining the group: a bad one is one line and exit 2 on every rank
        snapshot = None if args.snapshot is None else load_snapshot(args, world_size // (args.pp * args.tp * args.cp))
    except SnapshotError as e:
        print(f"{STAGE}/train.py: error: argument --snapshot: {e}", file=sys.stderr)
        sys.exit(2)
    if rank == 0 and args.snapshot is not None:  # a save cut short by a crash: never loaded, so never needed
        for stale in args.snapshot.glob("step_*.tmp"):  # (no other rank writes before the group is joined)
            shutil.rmtree(stale)
    ddp_setup(ddp, device, args.timeout)
    try:
        # The grid (pp, dp x cp, tp): a stage of the pipeline is a (dp x cp, tp) grid of consecutive ranks, DDP or
        # FSDP2 over its columns, tp over its rows, the cp groups within a column; the pipelines run across the stages.
        mesh = make_mesh(device, (args.pp, world_size // (args.pp * args.tp), args.tp), ("pp", "dp_cp", "tp"),
                         args.timeout)
        cp = ContextParallel(make_cp_group(args.cp, args.tp, args.timeout), args.cp_impl, zigzag=not args.no_zigzag)
        pipe = Pipeline(mesh.get_group("pp") if args.pp > 1 else None, args.width, DTYPES[args.dtype])
        train(rank, world_size, device, args, mesh, cp, pipe, snapshot)
    except RuntimeError as e:  # gloo raises a peer's death or stall here, as a timeout or a closed connection
        if (hint := explain_peer_failure(e, args.timeout)) is not None:
            print(f"[{STAGE}] rank {rank}: {hint}", file=sys.stderr)
        raise
    finally:
        # On success train() has returned and its model is gone: destroying the group while a DDP
        # model still holds it can hang a gloo process at exit (pytorch/pytorch#75097).
        dist.destroy_process_group()
    exit_without_teardown()  # skips Python's teardown, which a gloo thread can crash (below the line)


# ═══ The lesson ends here ═══════════════════════════════════════════════════════════════════════════════════════
# Below: what only the tour and the tests need, the same in every stage (tests/test_repo.py checks it); leave it out
# of your own project. Flag values refused in one line (check_args), the run's files for --out (state_of, save_run),
# one line on how another rank failed (explain_peer_failure), and a clean exit past a gloo bug.

import pickle
import resource
import tempfile


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2 (no usage dump)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def ensure_writable(directory: Path) -> None:
    """Create `directory` if needed and write a file there: mkdir alone succeeds on a read-only disk."""
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()


# The torch each folder needs: the release that made its APIs public (fully_shard, which 08, 09, 11 and 12 use, and
# pipelining as 10 uses it: 2.6; register_post_accumulate_grad_hook: 2.1). 08-12 also check it at their top.
NEEDS_TORCH = {"08_fsdp": (2, 6), "09_tensor_parallel": (2, 6), "10_pipeline_parallel": (2, 6), "11_gpt": (2, 6),
               "12_context_parallel": (2, 6), "ddp_by_hand": (2, 1)}


def check_args(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse now, in one line, what would otherwise fail later, on one rank only, or in a traceback."""
    needs = NEEDS_TORCH.get(STAGE.split("/")[0], (2, 0))
    if torch.__version__ < needs:
        p.error(f"torch {torch.__version__} is too old for {STAGE}: it needs {needs[0]}.{needs[1]} or newer "
                f"(the tutorial is tested with 2.13); see 'Using another torch' in README.md")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda asked but no GPU is visible; use --device cpu (or auto)")
    gpus = torch.cuda.device_count() if pick_device(args.device).type == "cuda" else 0
    spawned = getattr(args, "world_size", None)  # stage 03 starts its processes itself
    if gpus and spawned and spawned > gpus:
        p.error(f"argument --world-size: {spawned} processes but {gpus} GPU(s) visible; "
                f"use --world-size {gpus} or fewer (or --device cpu)")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes torchrun started on this node
    if gpus and local_world_size > gpus:
        p.error(f"torchrun --nproc_per_node: {local_world_size} processes but {gpus} GPU(s) visible; "
                f"use --nproc_per_node={gpus} or fewer (or --device cpu)")
    if "world_size" in args and "MASTER_PORT" in os.environ:  # stage 03, with a port of yours: check it now
        port = os.environ["MASTER_PORT"]
        if not (port.isdigit() and 0 < int(port) < 65536):
            p.error(f"MASTER_PORT={port} is not a port number; unset it (a free port is picked) or use 1-65535")
        if not port_is_free(int(port)):
            p.error(f"MASTER_PORT={port} is in use by another process; unset it (a free port is picked) "
                    f"or choose another")
    if args.out is not None:
        try:  # fail now, not after training
            ensure_writable(args.out)
        except OSError as e:
            p.error(f"argument --out: cannot write to {args.out} ({e.strerror}); choose a writable directory")
    return args


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as rank 0's store does
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> dict:
    """Weights and momentum after `epoch` epochs, whole and on the CPU: tour.py replays each epoch from them."""
    def whole(t: torch.Tensor) -> torch.Tensor:  # a DTensor (08, 09) is all-gathered: every rank calls this
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    params = list(model.parameters())
    return {"epoch": epoch, "params": [whole(p) for p in params],
            "momentum": [whole(optimizer.state[p]["momentum_buffer"]) if p in optimizer.state else None
                         for p in params]}


class Trajectory(list):
    """--out: state_of() at the start and after every epoch, which tour.py replays. Made only with --out: each entry
    copies the whole model (in 08 and 09 an all-gather of it), which a run that does not keep it must not pay for."""

    def __init__(self, trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self(getattr(trainer, "epochs_run", 0))  # a resumed run (06-09) records from the epoch it resumed at

    def __call__(self, epoch: int) -> None:  # Trainer.train calls it after every epoch
        self.append(self.state(epoch))

    def state(self, epoch: int) -> dict:
        return state_of(self.trainer.model, self.trainer.optimizer, epoch)


def save_run(args: argparse.Namespace, trainer, trajectory: list[dict], model: nn.Module, device: torch.device,
             evaluation: tuple, seconds: float, world_size: int = 1, max_diff: float | None = 0.0, **facts) -> None:
    """--out: summary.json (the run in numbers), model.pt (the plain model) and trajectory.pt (for the replay)."""
    loss_sum, correct, count = evaluation
    global_batch = facts.pop("global_batch", args.batch_size * world_size)
    epochs_here = len(trajectory) - 1  # trained by this run: a resumed one records from where it resumed
    summary = {
        "stage": STAGE, "world_size": world_size, "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": device.type, "global_batch": global_batch, "batch_size": args.batch_size, "epochs": args.epochs,
        "lr": args.lr, "dtype": args.dtype, "seed": args.seed, "steps": trainer.steps, "losses": trainer.losses,
        "eval_loss": loss_sum / count, "eval_accuracy": correct / count, "eval_count": count,
        "replica_max_abs_diff": max_diff, "seconds": seconds,
        "samples_per_s": epochs_here * len(trainer.train_loader) * global_batch / seconds,
        # Samples an epoch trains on: more than the data where DistributedSampler pads (tour.replay_error follows it).
        "epoch_samples": getattr(trainer.train_loader.sampler, "total_size", len(trainer.train_loader.dataset)),
        **facts,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save(model.state_dict(), args.out / "model.pt")
    torch.save(list(trajectory), args.out / "trajectory.pt")


def explain_peer_failure(error: RuntimeError, timeout: float) -> str | None:
    """One line for the two ways another rank's failure reaches this one; None for any other error."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return (f"waited more than --timeout {timeout:g}s for another rank: it stalled, died or skipped a "
                f"collective this rank called; raise --timeout only if a rank legitimately works alone that long")
    if "connection closed by peer" in text or "connection reset by peer" in text:
        return "another rank closed its connection (it died): its own error, or its launcher's, says why"
    return None


def exit_without_teardown() -> None:
    """Leave without Python's interpreter teardown: a gloo worker thread may still be releasing the last
    collective, which needs the GIL, and teardown aborts it ("terminate called without an active exception":
    5 of 22 runs here; 0 of 60 with this exit). Nothing is left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ─── This stage's own checks and reports ──────────────────────────────────────────────────────────────────────────
# Settings and files refused in one line (the model's shape, --tp, the corpus, a checkpoint directory); a failed save
# says why; the whole state for the trajectory; memory, speed and the files of --out.


def check_checkpoint_arg(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.snapshot is not None:
        if args.snapshot.exists() and not args.snapshot.is_dir():
            p.error(f"argument --snapshot: {args.snapshot} is a file; give a directory (each rank writes its own "
                    f"shards)")
        try:  # fail now, not at the first save
            ensure_writable(args.snapshot)
        except OSError as e:
            p.error(f"argument --snapshot: cannot write to {args.snapshot} ({e.strerror}); "
                    f"choose a writable directory")
    return args


def check_gpt_args(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The model's shape, the mesh and the corpus: refused now, in one line, rather than in a traceback on a rank."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.width % args.heads:
        p.error(f"argument --heads: {args.heads} does not divide --width {args.width} (each head takes an equal "
                f"part of the width)")
    if args.tp > 1 and args.parallel != "fsdp":
        p.error("argument --tp: tensor parallelism is combined with FSDP2 over dp here (stage 09); add "
                "--parallel fsdp")
    if world_size % args.tp:
        p.error(f"argument --tp: {args.tp} does not divide the world size {world_size} (the mesh is dp x cp x tp "
                f"processes); use a divisor of {world_size}")
    if world_size % (args.cp * args.tp):
        p.error(f"argument --cp: {args.cp} x --tp {args.tp} does not divide the world size {world_size} (the mesh is "
                f"dp x cp x tp processes); use a cp that divides {world_size // args.tp}")
    if world_size % (args.pp * args.cp * args.tp):
        p.error(f"argument --pp: {args.pp} x --cp {args.cp} x --tp {args.tp} does not divide the world size "
                f"{world_size} (the mesh is dp x pp x cp x tp processes); use a pp that divides "
                f"{world_size // (args.cp * args.tp)}")
    if args.pp > 1 and args.parallel != "fsdp":
        p.error("argument --pp: pipelining is combined with FSDP2 over dp here (DDP's reducer fails an internal "
                "assert when a schedule runs several backwards a step, torch 2.13); add --parallel fsdp")
    if args.pp > args.layers:
        p.error(f"argument --pp: {args.pp} stages need at least {args.pp} blocks (each stage holds whole blocks), "
                f"not --layers {args.layers}; use --pp {args.layers} or fewer")
    if args.pp > 1 and args.pp_schedule == "1f1b" and args.accumulate < args.pp:
        p.error(f"argument --accumulate: 1F1B needs at least one micro-batch per stage, {args.pp}, not "
                f"{args.accumulate}; use --accumulate {args.pp} or more (or --pp-schedule gpipe)")
    multiple, why = (args.cp, "cp") if args.no_zigzag else (2 * args.cp, "2 x cp: zigzag cuts it into 2 cp chunks")
    if args.cp > 1 and args.context % multiple:
        p.error(f"argument --context: {args.context} is not a multiple of {multiple} ({why}); use --context "
                f"{max(multiple, args.context // multiple * multiple)}")
    if args.cp > 1 and args.compile:
        p.error("argument --compile: the ring's sends and receives run between the compiled parts; compile with --cp 1")
    if args.heads % args.tp:
        p.error(f"argument --tp: {args.tp} does not divide --heads {args.heads} (each tp rank computes whole heads); "
                f"use one of {[d for d in range(1, args.heads + 1) if args.heads % d == 0]}")
    if args.amp and args.dtype == "float64":
        p.error("argument --amp: autocast leaves float64 alone, so nothing would run in bfloat16; use --dtype float32")
    if args.clip < 0:
        p.error(f"argument --clip: must be 0 (no clipping) or a positive norm, got {args.clip}")
    if args.decay_steps is None:
        args.decay_steps = args.max_steps
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.decay_steps // 20)
    if args.warmup_steps > args.decay_steps:
        p.error(f"argument --warmup-steps: {args.warmup_steps} is past --decay-steps {args.decay_steps} (the decay "
                f"starts when the warm-up ends); use {args.decay_steps} or less")
    if args.sample < 0:
        p.error(f"argument --sample: must be 0 or more characters, got {args.sample}")
    try:
        corpus = load_corpus(args.data)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).split(":")[0]
        p.error(f"argument --data: cannot read {args.data} as UTF-8 text ({why})")
    shortest = min(len(corpus.train), len(corpus.held_out))
    if args.context >= shortest:
        p.error(f"argument --context: {args.context} characters is longer than the text allows: it holds "
                f"{len(corpus.held_out):,} held-out characters after {len(corpus.train):,} to train on; "
                f"use --context {max(shortest - 1, 1)} or less, or a longer text (--data)")
    return args


class SnapshotError(Exception):
    """A --snapshot directory that cannot be resumed from: reported in one line, exit status 2."""


class MetadataUnpickler(pickle.Unpickler):
    """Reads a checkpoint's .metadata, which dcp.load unpickles as it is: only what metadata is made of passes."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        # The metadata's own classes (dataclasses, an enum); not its module's functions, which a pickle could call.
        metadata_class = module == "torch.distributed.checkpoint.metadata" and \
            isinstance(getattr(dcp.metadata, name, None), type)
        if (module, name) in self.ALLOWED or dtype or metadata_class:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata (a pickle that runs "
                                     f"code?)")


def load_snapshot(args: argparse.Namespace, dp: int) -> dict | None:
    """Check the newest checkpoint in --snapshot without reading its shards; None if there is none yet."""
    directory = args.snapshot
    strangers = [p.name for p in directory.iterdir() if not CHECKPOINT.fullmatch(p.name.removesuffix(".tmp"))] \
        if directory.is_dir() else []
    if strangers:
        raise SnapshotError(f"{directory} is not a checkpoint directory of this stage (it holds {strangers[0]}); "
                            f"give a new or empty directory")
    if not (found := checkpoints(directory)):
        return None
    path = found[-1]
    try:
        progress = json.loads((path / PROGRESS).read_text())
        with open(path / ".metadata", "rb") as f:  # what was saved, and where each piece lies
            metadata = MetadataUnpickler(f).load()
    except Exception as e:  # a file missing or unreadable
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SnapshotError(f"cannot load {path}: {first_line}") from e
    keys = {"steps", "losses", "curve", "grad_norms", "seed", "global_batch", "dtype", "model", "world_size",
            "schedule"}
    if not isinstance(progress, dict) or not keys <= progress.keys():
        raise SnapshotError(f"{path / PROGRESS} is not this stage's (expected the keys {sorted(keys)})")
    cfg = Config(len(set(args.data.read_text(encoding="utf-8"))), args.context, args.layers, args.heads, args.width)
    with torch.device("meta"):
        expected = {f"model.{k}": list(v.shape) for k, v in GPT(cfg).state_dict().items()}
    found_shapes = {k: list(getattr(metadata.state_dict_metadata.get(k), "size", [])) for k in expected}
    if found_shapes != expected or progress["model"] != cfg._asdict():
        made = progress["model"]
        raise SnapshotError(f"{path} holds another model: context {made.get('context')}, {made.get('layers')} blocks, "
                            f"{made.get('heads')} heads, width {made.get('width')}, vocabulary {made.get('vocab')} "
                            f"(this run: context {cfg.context}, {cfg.layers} blocks, {cfg.heads} heads, width "
                            f"{cfg.width}, vocabulary {cfg.vocab}); resume with the same, or use another --snapshot")
    for piece in metadata.storage_data.values():  # a shard file missing or cut short: found now, not mid-load
        file = path / piece.relative_path
        if not file.exists() or file.stat().st_size < piece.offset + piece.length:
            raise SnapshotError(f"{file} is {'truncated' if file.exists() else 'missing'}; that checkpoint is "
                                f"incomplete")
    global_batch = dp * args.accumulate * args.batch_size
    made_with = (progress["seed"], progress["global_batch"], progress["dtype"])
    if made_with != (args.seed, global_batch, args.dtype):
        raise SnapshotError(f"{path} was made with --seed {made_with[0]}, global batch {made_with[1]} and "
                            f"--dtype {made_with[2]}; resume with the same, or use another --snapshot")
    if progress["schedule"] != schedule(args):  # the rate of every step to come depends on all three
        made = progress["schedule"]
        raise SnapshotError(f"{path} was made with --lr {made.get('lr')} --warmup-steps {made.get('warmup_steps')} "
                            f"--decay-steps {made.get('decay_steps')}; resume with the same (a longer run: a larger "
                            f"--max-steps, the same --decay-steps), or use another --snapshot")
    return {"path": path, **progress}


def schedule(args: argparse.Namespace) -> dict:
    """What learning_rate() reads besides the step: saved with a checkpoint, checked when resuming."""
    return {"lr": args.lr, "warmup_steps": args.warmup_steps, "decay_steps": args.decay_steps}


def failed_save(error: Exception, tmp: Path, directory: Path) -> OSError:
    """One line for a save that failed on some rank (dcp names each failure), and what is still there."""
    causes = "; ".join(f"rank {r}: {exc}" for r, (exc, _) in error.failures.items()) \
        if isinstance(error, dcp.CheckpointException) else str(error)
    free = shutil.disk_usage(directory).free
    kept = f"{checkpoints(directory)[-1]} is still the last checkpoint" if checkpoints(directory) \
        else "there is no earlier checkpoint"
    return OSError(f"writing the checkpoint {tmp} failed ({causes}; {free} bytes free on that disk); {kept}")


def state_at(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, pipe: Pipeline) -> dict:
    """Weights and AdamW's two moments after `step` steps, whole, on the CPU, by parameter name (state_of above is
    for SGD's momentum). DTensors (FSDP2's shards, tp's slices) are all-gathered, and the stages' parts (--pp)
    exchanged: every rank calls this."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    named = [(name.removeprefix("module."), p) for name, p in model.named_parameters()]
    moments = {key: {n: whole(optimizer.state[p][key]) for n, p in named if p in optimizer.state}
               for key in ("exp_avg", "exp_avg_sq")}
    state = {"params": {n: whole(p) for n, p in named}, **moments}
    if pipe.size > 1:
        parts: list[dict] = [{} for _ in range(pipe.size)]
        dist.all_gather_object(parts, state, group=pipe.group)
        state = {key: {n: t for part in parts for n, t in part[key].items()} for key in state}
    return {"step": step, **state}


def peak_memory(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """Every rank's peak memory, and the bytes of the training state it holds (its pieces of the weights, gradients
    and AdamW's moments: what DDP replicates and FSDP2 and tp split). On the CPU the peak is the process's largest
    resident set (getrusage's ru_maxrss), torch's own code and buffers included; on a GPU, the most that torch had
    allocated on it (torch.cuda.max_memory_allocated)."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    # A gradient is as large as its weight (and is freed between steps); each of AdamW's moments too.
    state = sum(2 * local(p) + sum(local(m) for m in optimizer.state[p].values() if m.dim())
                for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    mine = torch.tensor([peak, state], dtype=torch.float64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"how": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss, the whole process",
            "peak": [int(m[0]) for m in every], "state": [int(m[1]) for m in every]}


# Dense peaks of a few GPUs in FLOP/s (bfloat16, float32 without TF32), from NVIDIA's data sheets: for the MFU.
PEAK_FLOPS = {"H100 PCIe": (756e12, 51e12), "H100": (989e12, 67e12), "H200": (989e12, 67e12),
              "A100": (312e12, 19.5e12), "L40S": (362e12, 91.6e12), "L4": (121e12, 30.3e12)}


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token (forward and backward): 6 per weight of every matmul (PaLM's 6N; the embeddings are
    look-ups, not matmuls), plus the attention's scores and weighted sums, 12 x layers x context x width (PaLM,
    appendix B; the causal mask's skipped half counted, as there)."""
    matmul_weights = cfg.layers * 12 * cfg.width ** 2 + cfg.width * cfg.vocab  # q, k, v, proj: 4w^2; MLP: 8w^2; head
    return 6 * matmul_weights + 12 * cfg.layers * cfg.context * cfg.width


def machine_peak(device: torch.device, args: argparse.Namespace) -> dict:
    """The peak the MFU is of, for the world. On a GPU, its data sheet's (PEAK_FLOPS: bf16 with --amp bf16, else
    float32 without TF32), times the world size. On a CPU there is no data sheet to trust: every rank multiplies
    512 x 512 matrices at the weights' dtype and its thread count for 0.1 s, all ranks at once, as they shared the
    cores in training; the world's peak is the FLOPs of all of them over the time the slowest took (so that ranks
    sharing a core, W above the cores, count the core once), the best of 3 rounds. With --amp bf16 in bfloat16 too,
    and the faster of the two counts (a CPU without bf16 units multiplies bfloat16 far slower than float32; one
    with them, faster). Every rank calls this (collectives)."""
    world_size = dist.get_world_size()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((p for key, p in PEAK_FLOPS.items() if key in name), None)
        if peak is None:
            return {"flops": None, "how": f"the peak of a {name} is not in PEAK_FLOPS"}
        flops = peak[0] if args.amp == "bf16" else peak[1]
        return {"flops": world_size * flops, "how": f"{world_size} x {flops / 1e12:g} TFLOP/s ({name}, data sheet)"}
    n, measured = 512, {}
    for dtype in [DTYPES[args.dtype]] + ([torch.bfloat16] if args.amp == "bf16" else []):
        a, b = (torch.randn(n, n, dtype=dtype) for _ in range(2))
        a @ b  # once first: the first call allocates and picks its kernel
        rounds = []
        for _ in range(3):
            dist.barrier()  # start together
            start, count = clock(device), 0
            while clock(device) - start < 0.1:  # as many as fit
                a @ b
                count += 1
            done = torch.tensor([count * 2 * n ** 3, clock(device) - start], dtype=torch.float64)
            every = [torch.zeros_like(done) for _ in range(world_size)]
            dist.all_gather(every, done)  # the world's matmuls are done when the slowest rank's are
            rounds.append(sum(d[0].item() for d in every) / max(d[1].item() for d in every))
        measured[str(dtype).removeprefix("torch.")] = max(rounds)
    fastest = max(measured, key=measured.get)
    threads = torch.get_num_threads()
    return {"flops": measured[fastest], "how": f"{world_size} rank{'s' if world_size > 1 else ''} x {threads} "
                                               f"thread{'s' if threads > 1 else ''}: "
                                               f"{measured[fastest] / 1e9:.1f} GFLOP/s, a {fastest} matmul measured "
                                               f"now" + "".join(f" ({k}: {v / 1e9:.1f})" for k, v in measured.items()
                                                                if k != fastest)}


def report_speed(trainer: Trainer, cfg: Config, device: torch.device, peak: dict) -> dict:
    """Tokens per second of the training steps (evaluation and checkpoints left out), and the model FLOPs
    utilisation: the FLOPs the model needs per token (flops_per_token), times tokens/s, over the world's peak
    (machine_peak: a GPU's data sheet, a CPU's measured matmul)."""
    steps_here = trainer.steps - trainer.resumed_at
    tokens_per_s = steps_here * trainer.global_batch * cfg.context / trainer.train_seconds if steps_here else 0.0
    speed = {"tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token(cfg), "mfu": None,
             "peak_flops": peak["flops"], "peak": peak["how"]}
    line = f"tokens/s {tokens_per_s:,.0f} over {steps_here} steps ({trainer.train_seconds:.1f}s of training)"
    if peak["flops"] is None:
        line += f" | MFU: {peak['how']}"
    else:
        speed["mfu"] = tokens_per_s * speed["flops_per_token"] / peak["flops"]
        line += f" | {speed['flops_per_token'] / 1e6:.2f} MFLOP/token | MFU {speed['mfu']:.1%} of {peak['how']}"
    print(line)
    return speed


def write_run(args: argparse.Namespace, trainer: Trainer, model: GPT, floor: dict, evaluation: tuple, seconds: float,
              speed: dict, memory: dict, max_diff: float, text: str) -> None:
    """--out: summary.json (the run in numbers), model.pt (the plain GPT's weights), trajectory.pt (state_at's)."""
    loss, count = evaluation
    summary = {
        "stage": STAGE, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": trainer.device.type, "dtype": args.dtype, "parallel": args.parallel, "dp": trainer.dp,
        "tp": args.tp, "pp": args.pp, "pp_schedule": args.pp_schedule, "cp": args.cp, "cp_impl": args.cp_impl,
        "zigzag": not args.no_zigzag,
        "accumulate": args.accumulate, "amp": args.amp, "compile": args.compile,
        "batch_size": args.batch_size, "global_batch": trainer.global_batch, "max_steps": args.max_steps,
        **schedule(args), "clip": args.clip, "seed": args.seed, "model": model.cfg._asdict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": trainer.steps, "resumed_at": trainer.resumed_at, "losses": trainer.losses,
        "grad_norms": trainer.grad_norms,
        "curve": trainer.curve, "eval_loss": loss, "eval_count": count, "baselines": floor,
        "replica_max_abs_diff": max_diff, "seconds": seconds, "train_seconds": trainer.train_seconds, **speed,
        "memory": memory, "sample": text,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save(model.state_dict(), args.out / "model.pt")
    torch.save(trainer.trajectory, args.out / "trajectory.pt")


if __name__ == "__main__":
    main()
