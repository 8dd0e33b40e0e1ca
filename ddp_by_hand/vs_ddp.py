"""How close the hand-built data parallelism is to torch's DDP, gradient by gradient, and why.

    python ddp_by_hand/vs_ddp.py                      # W = 2, 3 and 4 processes (gloo), a few seconds each
    python ddp_by_hand/vs_ddp.py --world-sizes 3

Every rank builds the stages' model (float64, the same weights), and for a few steps computes the gradients
of its own random batch, then averages them over the ranks three ways: torch's DistributedDataParallel (default
buckets), bucketed.py's HandDDP, and a copy of HandDDP's arithmetic with DDP's two habits added:

    1. DDP multiplies each gradient by 1/W as it copies it into the bucket, then sums over the ranks;
       HandDDP sums, then divides by W. The same for W = 2 and 4 (halving is exact in binary), not for W = 3.
    2. DDP's first step uses one bucket with the parameters in parameters() order; it then rebuilds its buckets
       in the order the gradients arrived (what HandDDP uses from the start). gloo adds up the W ranks' values of
       an element in an order that depends on where the element sits in the bucket: for W >= 3 another order can
       round differently; for W = 2 a + b = b + a, whatever the order.

It prints the largest difference from DDP's averaged gradients, for the first step and for the later ones.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (DDP(...) imports it, 2-3 CPU-s: imported here once, not in every forked rank)
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
import bucketed  # noqa: E402

from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, print_table  # noqa: E402

WAYS = ("hand", "hand + 1/W first", "hand + 1/W first + DDP's first-step order")


def with_ddps_habits(params: list[torch.nn.Parameter], step: int, premultiply: bool, first_order: bool) -> None:
    """HandDDP's arithmetic for one bucket of every parameter, with DDP's habits switched on or off."""
    world_size = dist.get_world_size()
    order = params if first_order and step == 0 else params[::-1]  # [::-1]: HandDDP's, and DDP's after step 1
    flat = torch.cat([p.grad.flatten() * (1.0 / world_size) if premultiply else p.grad.flatten() for p in order])
    dist.all_reduce(flat)
    if not premultiply:
        flat /= world_size
    for p, grad in zip(order, flat.split([p.numel() for p in order]), strict=True):
        p.grad.copy_(grad.view_as(p))


def averaged_gradients(way: str, steps: int, seed: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(seed)
    net = bucketed.Net().double()  # every rank draws the same weights (and DDP would broadcast rank 0's anyway)
    model = DDP(net) if way == "ddp" else bucketed.HandDDP(net) if way == "hand" else net
    params, found = list(net.parameters()), []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own batch
        x = torch.randn(32, bucketed.N_FEATURES, generator=g, dtype=torch.float64)
        y = torch.randint(0, bucketed.N_CLASSES, (32,), generator=g)
        for p in params:
            p.grad = None
        F.cross_entropy(model(x), y).backward()  # DDP: averaged here, during backward
        if way == "hand":
            model.sync_gradients()
        elif way != "ddp":
            with_ddps_habits(params, step, premultiply="1/W" in way, first_order="order" in way)
        found.append([p.grad.clone() for p in params])
    return found


def worker(rank: int, world: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        ddp = averaged_gradients("ddp", args.steps, args.seed)
        gaps = {}
        for way in WAYS:
            mine = averaged_gradients(way, args.steps, args.seed)
            gaps[way] = [max((a - b).abs().max().item() for a, b in zip(m, d, strict=True))
                         for m, d in zip(mine, ddp, strict=True)]
        if rank == 0:
            results.put(gaps)
    exit_worker()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="ddp_by_hand/vs_ddp.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=list_of(int), default=[2, 3, 4])
    p.add_argument("--steps", type=positive(int), default=4, help="steps compared (the first is DDP's odd one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive(float), default=60.0)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("argument --steps: at least 2 (DDP's first step differs from the later ones)")
    # fork where there is one: the workers start with torch already imported (spawn would import it again, ~2 s each)
    method = "fork" if sys.platform == "linux" else "spawn"
    print("max |difference| from DDP's averaged gradients (float64, the stages' model, batch 32 per rank; "
          "0: bit for bit); hand = HandDDP (sum / W), then with DDP's habits added one by one:")
    later = f"steps 2-{args.steps}"
    rows = [["W", "hand: step 1", later, "+ 1/W first: step 1", later, "+ DDP's step-1 order: step 1", later]]
    for world in args.world_sizes:
        args.port = free_port()
        results = mp.get_context(method).SimpleQueue()
        mp.start_processes(worker, args=(world, args, results), nprocs=world, start_method=method)
        gaps = results.get()
        rows.append([str(world), *(f"{x:.1e}" if x else "0" for g in gaps.values() for x in (g[0], max(g[1:])))])
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
