"""All-reduce written from scratch on torch.distributed point-to-point messages (batch_isend_irecv).

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

Safe where a send completes only once it is received (NCCL, above its eager size, which also runs a
communicator's messages in order on one stream): a ring step's send to the right and receive from the
left are posted together, in one batch_isend_irecv. Posted one after the other, every rank could wait
for its right neighbour to take its chunk while that neighbour waits for its own right one, round the
ring. tests/test_sync_sends.py runs them on gloo made synchronous and in order (tests/sync_sends.py).
"""
from __future__ import annotations

from collections import deque

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


def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> list:
    """Send `send` to rank dst and receive `recv` from rank src at once, in one batch_isend_irecv; return its works.

    A send and a receive posted together cannot wait on each other, whatever the transport does. An empty tensor is
    left out, by sender and receiver alike (both know the chunk sizes); with nothing left, nothing is posted."""
    ops = ([dist.P2POp(dist.isend, send, dst)] if send.numel() else []) + \
          ([dist.P2POp(dist.irecv, recv, src)] if recv.numel() else [])
    return dist.batch_isend_irecv(ops) if ops else []


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
        # Send and receive at once (exchange): every rank sends and receives in the same step. Sent first and
        # received after, each rank could wait for its right neighbour to take its chunk, and round the ring
        # nobody takes one.
        for work in exchange(send_c, right, received, left):
            work.wait()
        recv_c += received

    # All-gather. At step s rank r sends chunk r+1-s (the summed one it got last) and receives the summed
    # chunk r-s, which simply overwrites its own partial copy. After W-1 steps every rank has every chunk.
    for step in range(world - 1):
        send_c, recv_c = chunks[(rank + 1 - step) % world], chunks[(rank - step) % world]
        for work in exchange(send_c, right, recv_c, left):
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
    received at step t is the one sent at step t+1. Each chunk is cut into pieces, and piece k of
    step t is one exchange: its send to the right and its receive from the left, posted together.
    Every rank posts them in the same order, step by step and piece by piece, so each one meets its
    neighbours' piece k of step t. As soon as piece k of step t has arrived (and, while scatter-reducing,
    been added in), piece k of step t+1, which sends it on, is posted, while the rest of step t is still
    in flight: the pieces stream round the ring instead of whole chunks waiting for each other, and the
    adds overlap with the transfers.
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
    per_step = -(-longest // piece)  # pieces in the longest chunk: every step is cut into as many (some empty)
    # Scatter-reduce receives into scratch and adds. One buffer is enough: piece k of step t+1 is posted only once
    # piece k of step t has been added in, and the pieces in flight meanwhile are other pieces of it.
    scratch = _buffer("ring", longest, flat)

    def post(t: int, k: int) -> tuple[int, torch.Tensor, torch.Tensor, list]:
        """Post piece k of step t: (t, the piece of the result it fills, where it lands, its works)."""
        sent = chunks[(rank - t) % world][k * piece:(k + 1) * piece]  # empty past the chunk's end
        target = chunks[(rank - t - 1) % world][k * piece:(k + 1) * piece]
        # All-gather receives straight into the result: no buffer, no copy.
        into = scratch[k * piece:k * piece + len(target)] if t < world - 1 else target
        return t, target, into, exchange(sent, right, into, left)

    def finish(t: int, target: torch.Tensor, into: torch.Tensor, works: list) -> None:
        for work in works:
            work.wait()
        if t < world - 1:
            target.add_(into)  # in place: no temporary tensor; target is a view into the caller's tensor

    in_flight: deque = deque()  # posted pieces, in the order posted: (step, piece) ascending
    for t in range(steps):
        for k in range(per_step):
            # Piece k of step t sends what piece k of step t-1 received: that one, and those before it, must be done.
            while in_flight and in_flight[0][0] <= (t - 1, k):
                finish(*in_flight.popleft()[1])
            in_flight.append(((t, k), post(t, k)))
    while in_flight:  # the left neighbour's last pieces have arrived; our buffers may be reused
        finish(*in_flight.popleft()[1])


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
    # No order here can wait on itself, even where a send completes only once it is received: the others send, then
    # receive; rank 0 takes every tensor before it sends any back.
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
