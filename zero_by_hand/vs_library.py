"""The sharding by hand against the library's, step by step: the same weights, to the bit where the sums are.

    python zero_by_hand/vs_library.py                      # W = 1, 2 and 3 processes (gloo), a few seconds each
    python zero_by_hand/vs_library.py --world-sizes 3 --steps 6

Every rank builds the stages' model (float64, the same weights) and for a few steps trains it with AdamW on its own
random batch, several ways: torch's DDP with AdamW, DDP with ZeroRedundancyOptimizer (torch's ZeRO-1), FSDP2 with
AdamW (`fully_shard` on body and head, as stage 08: torch's ZeRO-3), bucketed.py's HandDDP with AdamW (DDP's
averaging by hand, nothing sharded), and zero1.py, zero2.py and zero3.py (the same units as FSDP2). It prints the
largest difference of the weights from DDP's, HandDDP's and FSDP2's, after the first step and after the later ones.

Sharding changes where each element of AdamW's update is computed, not how: AdamW works element by element, so a rank
stepping its 1/W computes what every rank computes unsharded. What can differ is the averaged gradient, and only in
how it is added up: bucketed.py's vs_ddp.py shows DDP's two habits (1/W before the sum; its first step's bucket in
parameters() order), which change the rounding from W = 3 on. Where an element sits in the tensor a reduce-scatter
cuts decides in which order gloo adds its W values: zero3.py cuts each unit's flat tensor, FSDP2 each parameter.
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "ddp_by_hand"))
sys.path.insert(0, str(HERE.parent))  # the repository root: tools/
import bucketed  # noqa: E402
import zero1  # noqa: E402
import zero2  # noqa: E402
import zero3  # noqa: E402

from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, print_table  # noqa: E402

REFERENCES = ("DDP + AdamW", "HandDDP + AdamW", "FSDP2 + AdamW")
WAYS = ("DDP + ZeroRedundancyOptimizer", "zero1.py", "zero2.py", "zero3.py")
LR = 0.01  # the scripts' default


def train(way: str, steps: int, seed: int) -> list[list[torch.Tensor]]:
    """The weights after each of `steps` steps, trained `way`."""
    torch.manual_seed(seed)
    net = bucketed.Net().double()  # every rank draws the same weights (and each way broadcasts rank 0's anyway)
    if way.startswith("DDP"):
        model = DDP(net)
        optimizer = (ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=LR)
                     if "Zero" in way else torch.optim.AdamW(net.parameters(), lr=LR))
    elif way == "FSDP2 + AdamW":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # the default would be cuda where a GPU is visible
        for unit in (net.body, net.head, net):  # stage 08's units (the root last)
            fully_shard(unit, mesh=mesh)
        model, optimizer = net, torch.optim.AdamW(net.parameters(), lr=LR)
    elif way == "HandDDP + AdamW":
        model = bucketed.HandDDP(net)
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
    else:
        script = {"zero1.py": zero1, "zero2.py": zero2, "zero3.py": zero3}[way]
        model = script.HandFSDP(net, [net.body, net.head]) if script is zero3 else script.HandDDP(net)
        optimizer = script.ShardedOptimizer(model, torch.optim.AdamW, lr=LR)
    found = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # each rank its own batch
        x = torch.randn(32, bucketed.N_FEATURES, generator=g, dtype=torch.float64)
        y = torch.randint(0, bucketed.N_CLASSES, (32,), generator=g)
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()  # DDP: averaged here, during backward
        if hasattr(model, "sync_gradients"):
            model.sync_gradients()
        optimizer.step()
        found.append(whole_weights(way, net, model))
    return found


def whole_weights(way: str, net: torch.nn.Module, model) -> list[torch.Tensor]:
    """Every weight, whole: FSDP2's and zero3.py's are gathered (here, to compare; training never does)."""
    if way == "FSDP2 + AdamW":
        return [p.full_tensor().clone() for p in net.parameters()]  # (at W = 1 the shard itself: the next step
        #                                                                  would change what this step kept)
    if way == "zero3.py":
        wholes = []
        for shard, shapes in zip(model.param_shards, model.shapes, strict=True):
            flat = torch.empty(shard.numel() * dist.get_world_size(), dtype=shard.dtype)
            dist.all_gather_single(flat, shard)
            wholes += [w.view(s) for w, s in zip(flat[:sum(s.numel() for s in shapes)].split(
                [s.numel() for s in shapes]), shapes, strict=True)]
        return wholes
    return [p.detach().clone() for p in net.parameters()]


def gaps(mine: list[list[torch.Tensor]], reference: list[list[torch.Tensor]]) -> list[float]:
    return [max((a - b).abs().max().item() for a, b in zip(m, r, strict=True))
            for m, r in zip(mine, reference, strict=True)]


def worker(rank: int, world: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        references = {name: train(name, args.steps, args.seed) for name in REFERENCES}
        table = {way: {name: gaps(train(way, args.steps, args.seed), ref) for name, ref in references.items()}
                 for way in (*WAYS, *REFERENCES[1:])}
        if rank == 0:
            results.put(table)
    exit_worker()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="zero_by_hand/vs_library.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=list_of(int), default=[1, 2, 3])
    p.add_argument("--steps", type=positive(int), default=4, help="steps compared (DDP's first is its odd one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive(float), default=60.0)
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("argument --steps: at least 2 (DDP's first step differs from the later ones)")
    # fork where there is one: the workers start with torch already imported (spawn would import it again, ~2 s each)
    method = "fork" if sys.platform == "linux" else "spawn"
    print("max |difference| of the weights from DDP + AdamW's, HandDDP + AdamW's and FSDP2 + AdamW's, after step 1 "
          f"and after the later steps (float64, the stages' model, batch 32 per rank, AdamW lr {LR}; 0: bit for bit)")
    later = f"steps 2-{args.steps}"
    rows = [["W", "way", *(f"{name}, {c}" for name in ("DDP", "HandDDP", "FSDP2") for c in ("step 1", later))]]
    for world in args.world_sizes:
        args.port = free_port()
        results = mp.get_context(method).SimpleQueue()
        mp.start_processes(worker, args=(world, args, results), nprocs=world, start_method=method)
        for way, found in results.get().items():
            rows.append([str(world), way, *(f"{x:.1e}" if x else "0" for g in found.values()
                                            for x in (g[0], max(g[1:])))])
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
