"""All-reduce written from scratch on torch.distributed point-to-point messages (isend / irecv).

Three versions of the same collective: afterwards every rank holds the element-wise sum of
every rank's tensor, like dist.all_reduce(tensor) (op SUM).

- ring_all_reduce_simple: the textbook ring, written to be read. The tensor is cut into W chunks;
  W-1 scatter-reduce steps leave each rank with one fully summed chunk, W-1 all-gather steps pass
  the summed chunks round the ring until every rank has all of them.
- ring_all_reduce: the same messages, written to be fast (the one the benchmark measures). Each chunk
  is cut into pieces that flow through the ring one after another, so the add of one piece, the
  sending of the previous one and the receiving of the next one overlap; receive buffers are
  allocated once and reused; pieces of the all-gather land directly in the output tensor.
- ps_all_reduce: the parameter-server baseline. Every rank sends its whole tensor to rank 0, which
  adds them up and sends the sum back to every rank.

Traffic per rank, for a tensor of N bytes on W ranks:
  ring: every rank sends (and receives) 2 * (W-1)/W * N bytes, less than 2N whatever W is;
  parameter server: rank 0 receives (W-1) * N and sends (W-1) * N, growing with W; the others wait.

The ring functions work for any W >= 1, any number of elements (0 included, not only multiples of
W) and any dtype torch can add. They must be called by every rank of the default process group, in
the same order, like any collective.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

# Pieces of ~1 MiB: big enough that the Python cost of an isend/irecv/wait (tens of µs) is small next
# to moving the piece (~1 ms at 1 GB/s), small enough that a 16 MB tensor on 2 ranks still has 8
# pieces per chunk to overlap. benchmark.py --piece-bytes tries other values.
PIECE_BYTES = 1 << 20


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Cut range(numel) into `parts` contiguous (start, end) ranges whose sizes differ by at most 1.

    The first numel % parts ranges get one extra element, so any numel works, 0 included
    (then every range is empty).
    """
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the tensor's memory (contiguous tensors only: a view is written through)."""
    if not tensor.is_contiguous():
        raise ValueError("all-reduce of a non-contiguous tensor: call .contiguous() first, then copy back")
    return tensor.view(-1)


def ring_all_reduce_simple(tensor: torch.Tensor) -> None:
    """Sum `tensor` over all ranks, in place: the ring algorithm as the textbooks draw it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return
    flat = _flat(tensor)
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), world)]
    right, left = (rank + 1) % world, (rank - 1) % world  # send to the right, receive from the left

    # Scatter-reduce. At step s rank r sends chunk r-s to its right neighbour and receives chunk r-s-1
    # from its left one, which it adds to its own copy. Each step adds one more rank's contribution
    # to the chunk travelling round, so after W-1 steps rank r holds chunk r+1 summed over all ranks.
    for step in range(world - 1):
        send_c, recv_c = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        received = torch.empty_like(recv_c)
        # isend, not send: every rank sends and receives at once. With a blocking send each rank
        # could wait for its right neighbour to receive, and round the ring nobody receives.
        # Empty chunks (fewer elements than ranks) are skipped by sender and receiver alike.
        work = dist.isend(send_c, right) if send_c.numel() else None
        if recv_c.numel():
            dist.recv(received, left)
            recv_c += received
        if work is not None:
            work.wait()

    # All-gather. At step s rank r sends chunk r+1-s (the summed one it got last) and receives the summed
    # chunk r-s, which simply overwrites its own partial copy. After W-1 steps every rank has every chunk.
    for step in range(world - 1):
        send_c, recv_c = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        work = dist.isend(send_c, right) if send_c.numel() else None
        if recv_c.numel():
            dist.recv(recv_c, left)
        if work is not None:
            work.wait()


# Receive buffers of the fast versions, allocated once and kept between calls. A fresh tensor of 32 MB
# or more comes straight from the OS (glibc mmaps blocks that big and unmaps them when freed), so every
# call would pay ~8000 page faults to touch it: 17 ms for 32 MB on the 2-core machine of the README,
# which is what the simple ring pays at 64 MB on 2 ranks.
_buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _buffer(name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
    key = (name, like.dtype, like.device)
    buf = _buffers.get(key)
    if buf is None or buf.numel() < numel:
        buf = _buffers[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return buf[:numel]


def ring_all_reduce(tensor: torch.Tensor, piece_bytes: int = PIECE_BYTES) -> None:
    """Sum `tensor` over all ranks, in place: the same ring, with each chunk pipelined in pieces.

    Step t = 0 .. 2W-3 covers both phases: t < W-1 is scatter-reduce step t, t >= W-1 all-gather
    step t-(W-1). In both, rank r sends chunk r-t and receives chunk r-t-1 (mod W), and the chunk
    received at step t is the one sent at step t+1. So as soon as piece k of step t has arrived (and,
    while scatter-reducing, been added in), it is sent on as piece k of step t+1, while the rest of
    step t is still in flight: the pieces stream round the ring instead of whole chunks waiting
    for each other, and the adds overlap with the transfers.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return
    flat = _flat(tensor)
    chunks = [flat[a:b] for a, b in chunk_bounds(flat.numel(), world)]
    piece = max(1, piece_bytes // flat.element_size())
    right, left = (rank + 1) % world, (rank - 1) % world
    steps = 2 * (world - 1)
    longest = len(chunks[0])
    per_step = -(-longest // piece)  # pieces in the longest chunk: tag = t * per_step + k is unique
    # Two scatter-reduce receive buffers used in turn: step t+1 receives into one while step t's pieces
    # are still being added from the other.
    scratch = [_buffer("ring0", longest, flat), _buffer("ring1", longest, flat)]

    def pieces(chunk: torch.Tensor) -> list[torch.Tensor]:
        return [chunk[i:i + piece] for i in range(0, len(chunk), piece)]

    def post_receives(t: int) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
        """Post step t's receives now, so that data can land as soon as the left neighbour sends it."""
        target = chunks[(rank - t - 1) % world]
        # Scatter-reduce receives into scratch and adds; all-gather receives straight into the result.
        into = scratch[t % 2][:len(target)] if t < world - 1 else target
        # A distinct tag per (step, piece): which message is which never depends on arrival order.
        return [(dst, src, dist.irecv(src, left, tag=t * per_step + k))
                for k, (dst, src) in enumerate(zip(pieces(target), pieces(into), strict=True))]

    sends = [dist.isend(p, right, tag=k) for k, p in enumerate(pieces(chunks[rank]))]  # step 0: own chunk r
    pending = post_receives(0)
    for t in range(steps):
        following = post_receives(t + 1) if t + 1 < steps else []  # double buffering: next step's receives
        for k, (dst, src, work) in enumerate(pending):
            work.wait()
            if t < world - 1:
                dst.add_(src)  # in place: no temporary tensor; dst is a view into the caller's tensor
            if t + 1 < steps:  # pass the piece on: it is piece k of the chunk step t+1 sends
                sends.append(dist.isend(dst, right, tag=(t + 1) * per_step + k))
        pending = following
    for work in sends:  # the right neighbour has received everything; our buffers may be reused
        work.wait()


def ps_all_reduce(tensor: torch.Tensor) -> None:
    """Sum `tensor` over all ranks, in place, through rank 0 (a "parameter server").

    Reduce: every rank sends its tensor to rank 0, which adds each one in as it arrives.
    Broadcast: rank 0 sends the sum back to every rank. Given the same care as the fast ring
    (reused receive buffers, in-place adds, all receives posted at once), so the difference
    the benchmark shows is the traffic pattern: rank 0 moves 2 * (W-1) * N bytes, the ring 2 * (W-1)/W * N per rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1 or tensor.numel() == 0:
        return
    flat = _flat(tensor)
    if rank == 0:
        bufs = [_buffer(f"ps{src}", flat.numel(), flat) for src in range(1, world)]
        works = [dist.irecv(buf, src) for src, buf in enumerate(bufs, start=1)]
        for buf, work in zip(bufs, works, strict=True):
            work.wait()
            flat.add_(buf)  # rank 0 + rank 1 + ... in rank order: a fixed order, the same result every run
        for work in [dist.isend(flat, dst) for dst in range(1, world)]:
            work.wait()
    else:
        dist.send(flat, 0)
        dist.recv(flat, 0)


ALGORITHMS = {"ring_simple": ring_all_reduce_simple, "ring": ring_all_reduce, "ps": ps_all_reduce}
