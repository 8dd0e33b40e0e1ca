"""Context parallelism, measured: each rank's attention work with and without zigzag, and the bytes and time of ring
attention against all-gather attention (12_context_parallel/train.py's), causal, on gloo.

    python benchmarks/cp_balance.py                       # cp = 2 and 4, 2048 tokens
    python benchmarks/cp_balance.py --tokens 512 --repeats 3

It starts 4 processes (fork, gloo, one intra-op thread each); cp = 2 runs on ranks 0 and 1 while 2 and 3 wait. For
each cp, split (contiguous, zigzag) and method (ring, all-gather) it runs the forward and backward of causal attention
on [1, 4 heads, --tokens, 64] float32, once to warm up, then --repeats times, and prints the medians of:
- each rank's compute: the CPU time of its main thread (time.thread_time), which leaves out the time spent waiting
  for messages: the work the split gave that rank, whatever the machine's cores did meanwhile;
- the step's wall time, from a barrier to the end, of the slowest rank. 4 processes on 2 cores are oversubscribed:
  at cp = 4 they take turns on the cores, so wall time is shared cores' time there (and any other load's);
- the bytes each rank handed to torch.distributed (tools.cli.SentBytes), the same on every rank.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/
from tools.cli import ArgumentParser, SentBytes, exit_worker, free_port, gloo_group, positive, summary  # noqa: E402
from tour import load_stage  # noqa: E402

WORLD, CPS = 4, (2, 4)
HEADS, HEAD_SIZE = 4, 64
METHODS = {"ring": "ring_attention", "all-gather": "allgather_attention"}


def measure(ring: ModuleType, method: str, zigzag: bool, cp: int, group, args: argparse.Namespace) -> dict:
    """This rank's medians over the repeats: CPU seconds of forward + backward, wall seconds, bytes sent."""
    rank = dist.get_rank(group)
    g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    shape = (1, HEADS, args.tokens, HEAD_SIZE)
    q, k, v, dout = (ring.split_sequence(torch.randn(shape, generator=g), cp, rank, zigzag, dim=2) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    cpu, wall, sent = [], [], []
    for _ in range(1 + args.repeats):  # the first warms up
        dist.barrier(group)
        before, start, start_cpu = ring.dist.sent, time.perf_counter(), time.thread_time()
        getattr(ring, METHODS[method])(q, k, v, group, True, zigzag).backward(dout)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        sent.append(ring.dist.sent - before)
    return {"cpu": statistics.median(cpu[1:]), "wall": statistics.median(wall[1:]), "sent": sent[-1]}


def worker(rank: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, WORLD, args.port, args.timeout):
        ring = load_stage("12_context_parallel")
        ring.dist = SentBytes()  # its calls to torch.distributed, counted
        groups = {cp: dist.new_group(list(range(cp))) for cp in CPS}  # every rank takes part in making each
        rows = []
        for cp in CPS:
            for method in METHODS:
                for zigzag in (False, True):
                    mine = measure(ring, method, zigzag, cp, groups[cp], args) if rank < cp else None
                    every = [None] * WORLD
                    dist.all_gather_object(every, mine)
                    rows.append({"cp": cp, "method": method, "zigzag": zigzag, "ranks": every[:cp]})
        if rank == 0:
            results.put(rows)
    exit_worker()


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"causal attention, forward + backward, [1, {HEADS} heads, {args.tokens} tokens, {HEAD_SIZE}] float32, "
          f"gloo, median of {args.repeats}; compute = CPU ms of each rank's main thread (waiting not counted)")
    table = [["cp", "method", "split", *(f"rank {r}" for r in range(WORLD)), "max/min", "wall ms/step",
              "sent/rank/step"]]
    for row in rows:
        cpu = [r["cpu"] * 1e3 for r in row["ranks"]]
        table.append([str(row["cp"]), row["method"], "zigzag" if row["zigzag"] else "contiguous",
                      *(f"{c:.1f}" for c in cpu), *([""] * (WORLD - row["cp"])), f"{max(cpu) / min(cpu):.2f}",
                      f"{max(r['wall'] for r in row['ranks']) * 1e3:.1f}",
                      f"{row['ranks'][0]['sent'] / 2**20:.2f} MiB"])
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    for r in table:
        print("  ".join(cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                    strict=True))))
    print(f"({WORLD} processes on {os.cpu_count()} cores: where cp exceeds the cores, wall times are shared cores')")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="benchmarks/cp_balance.py", description=summary(__doc__))
    p.add_argument("--tokens", type=positive(int), default=2048, help="sequence length (a multiple of 8: 2 cp)")
    p.add_argument("--repeats", type=positive(int), default=5, help="timed steps per configuration")
    p.add_argument("--timeout", type=positive(float), default=120.0, help="seconds a collective may wait")
    args = p.parse_args(argv)
    if args.tokens % (2 * max(CPS)):
        p.error(f"argument --tokens: must be a multiple of {2 * max(CPS)} (zigzag cuts it into 2 cp equal chunks), "
                f"got {args.tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.port = free_port()
    results = mp.get_context("fork").SimpleQueue()
    # fork: the workers start with torch already imported (spawn would import it again, ~3 s each)
    mp.start_processes(worker, args=(args, results), nprocs=WORLD, start_method="fork")
    print_table(results.get(), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
