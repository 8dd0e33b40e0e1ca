"""Context parallelism: every sequence split over the cp ranks, each holding its share of the tokens, and attention,
the one place a token reads the others, computed exactly across them: the keys and values passed round a ring (ring
attention, with the online softmax, forward and backward by hand) or all gathered at once; the zigzag split that
evens out the causal mask's work."""
from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

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
        held = held_chunks(cp, rank, zigzag)
        size, scale, wide = q.shape[2] // len(held), 1 / math.sqrt(q.shape[-1]), float32_at_least(q.dtype)
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
            for rows, cols, diagonal in visible_parts(held, held_chunks(cp, origin, zigzag), size, causal):
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
        held = held_chunks(cp, rank, zigzag)
        size, scale, wide, dtype = q.shape[2] // len(held), 1 / math.sqrt(q.shape[-1]), out.dtype, q.dtype
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
            for rows, cols, diagonal in visible_parts(held, held_chunks(cp, origin, zigzag), size, causal):
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
        shard = torch.empty_like(parts[0])
        dist.reduce_scatter(shard, parts, group=ctx.group)
        return shard.to(grad.dtype), None


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
    held = held_chunks(cp, rank, zigzag)
    size = q.shape[2] // len(held)
    return torch.cat([F.scaled_dot_product_attention(q[..., i * size:(i + 1) * size, :], keys[..., :(c + 1) * size, :],
                                                     values[..., :(c + 1) * size, :],
                                                     attn_mask=causal_mask(size, c * size, q.device))
                      for i, c in enumerate(held)], dim=2)


class ContextParallel:
    """This rank's place in its cp group: which part of every sequence it holds, and how its attention reaches the
    rest. cp = 1 (no group) holds the whole sequence: the same code then runs as stage 11's."""

    def __init__(self, group: dist.ProcessGroup | None, impl: str = "ring", zigzag: bool = True,
                 split: int = 1) -> None:
        self.group, self.impl, self.zigzag = group, impl, zigzag
        self.split = split  # --sp: each rank's share is cut again into tp contiguous parts (parallelize.SP_AROUND)
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
        """A sequence's length must be a multiple of this to split evenly (zigzag: 2cp chunks; --sp: each rank's share,
        t / cp, a multiple of tp too)."""
        return math.lcm(2 * self.size if self.zigzag and self.size > 1 else self.size, self.size * self.split)

    def pad(self, x: torch.Tensor, fill: int) -> torch.Tensor:
        """x [b, n] with `fill` appended up to a length this group can split. At the end: under the causal mask no
        real position reads them, so they change nothing before them."""
        return F.pad(x, (0, -x.shape[1] % self.multiple()), value=fill)
