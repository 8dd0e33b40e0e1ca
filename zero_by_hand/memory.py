"""What each rank keeps and sends, measured, against ZeRO's formulas: DDP, zero1.py, zero2.py, zero3.py and FSDP2.

    python zero_by_hand/memory.py                    # the README's table: the 100 MB MLP of ddp_by_hand/overlap.py
    python zero_by_hand/memory.py --hidden 256 --layers 2 --world-sizes 2 --out runs/memory_quick

For each W and each way, W ranks (forked, gloo, float32) train an MLP of --layers blocks (a square Linear of width
--hidden and a ReLU) and a Linear to 16 classes, with AdamW, for three steps on random data. Each block is a unit for
zero3.py and for FSDP2 (`fully_shard`, with reshard_after_forward True and False); zero1.py and zero2.py bucket the
gradients as DDP does (25 MiB, the first 1 MiB). DDP keeps its gradients in its buckets (gradient_as_bucket_view, as
zero1.py does; without it DDP keeps them twice, once where gc cannot see them).

Memory is counted from the tensors alive in rank 0's process (every tensor object Python's gc knows, each storage
once), not from the process's size: after the third step, sorted into weights, gradients and AdamW's state (by
which storages the model, the gradients and the optimizer hold), beside the formula (Ψ weights, 4 bytes each):
DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/W, ZeRO-2 4Ψ + 12Ψ/W, ZeRO-3 and FSDP2 16Ψ/W. During the third step it is counted again at
every Linear's forward and before its backward (hooks), and the largest total, less the total after the step, is
the transient peak: the activations, and what lives only during a step (the whole gradients of ZeRO-2, ZeRO-3 and
FSDP2 until they are reduce-scattered, the gathered units of ZeRO-3 and FSDP2).

Traffic is counted from outside the scripts: torch.distributed's all_reduce, all_gather_single and
reduce_scatter_single are wrapped in each rank (DDP's built-in all-reduce runs in C++, so DDP gets the comm hook
that does the same in Python), and each call costs what a ring sends per rank: 2n(W-1)/W elements for an all-reduce
of n, n(W-1)/W for an all-gather or a reduce-scatter of n in all. Formulas, in Ψ(W-1)/W: DDP 2, ZeRO-1 3 (the
all-reduce, then the all-gather of the weights), ZeRO-2 2, ZeRO-3 3 (two all-gathers and a reduce-scatter), FSDP2 3
with reshard_after_forward, 2 without (the weights stay whole from forward to backward).
"""
from __future__ import annotations

import argparse
import gc
import inspect
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository root: tools/
import zero1  # noqa: E402
import zero2  # noqa: E402
import zero3  # noqa: E402

from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, print_table, write_csv  # noqa: E402

WAYS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2", "FSDP2-no-reshard")
# Bytes per weight on each rank (float32, AdamW): (weights, gradients, AdamW's two moments), at W ranks.
FORMULA = {"DDP": lambda w: (4, 4, 8), "ZeRO-1": lambda w: (4, 4, 8 / w), "ZeRO-2": lambda w: (4, 4 / w, 8 / w),
           **{way: (lambda w: (4 / w, 4 / w, 8 / w)) for way in ("ZeRO-3", "FSDP2", "FSDP2-no-reshard")}}
# Elements a rank sends per step, in Ψ(W - 1)/W.
TRAFFIC = {"DDP": 2, "ZeRO-1": 3, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3, "FSDP2-no-reshard": 2}
MiB = 2**20
COLUMNS = ["way", "W", "weights", "weights_MiB", "grads_MiB", "state_MiB", "total_MiB", "formula_MiB", "ratio",
           "transient_MiB", "sent_MiB", "sent_formula_MiB"]


def build(hidden: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank
    blocks = [nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(hidden, 16))


class Counted:
    """Wraps torch.distributed's collectives in this process; `elements` is what a ring sends per rank for them."""

    NAMES = ("all_reduce", "all_gather_single", "reduce_scatter_single")

    def __init__(self) -> None:
        self.real = {name: getattr(dist, name) for name in self.NAMES}
        self.elements = 0.0

    def __enter__(self) -> Counted:
        world = dist.get_world_size()

        # The whole tensor of each: all-reduce's, all-gather's output, reduce-scatter's input (by name: FSDP2 passes
        # them as keywords).
        whole = {"all_reduce": "tensor", "all_gather_single": "output_tensor", "reduce_scatter_single": "input"}

        def wrap(name: str):
            signature = inspect.signature(self.real[name])

            def counted(*args, **kwargs):
                n = signature.bind(*args, **kwargs).arguments[whole[name]].numel()
                self.elements += n * (world - 1) / world * (2 if name == "all_reduce" else 1)
                return self.real[name](*args, **kwargs)
            return counted
        for name in self.NAMES:
            setattr(dist, name, wrap(name))
        return self

    def __exit__(self, *exc) -> None:
        for name, function in self.real.items():
            setattr(dist, name, function)


def storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of `tensors` (a DTensor counts its local shard)."""
    found = {}
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def alive() -> dict[int, int]:
    """Every storage a live tensor object of this process uses, once."""
    # type(), not isinstance(): isinstance asks some deprecated objects for __class__, which warns.
    return storages(o for o in gc.get_objects()
                    if issubclass(type(o), torch.Tensor) and not issubclass(type(o), DTensor))


def setup(way: str, net: nn.Sequential, lr: float):
    """(model, optimizer, what holds the weights, the gradients and the state: each a function giving tensors)."""
    units = list(net)
    if way == "DDP":
        model = DDP(net, gradient_as_bucket_view=True)  # .grad in DDP's buckets: otherwise both, and gc sees one
        model.register_comm_hook(None, allreduce_hook)  # DDP's all-reduce, in Python: the wrapper counts it
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        return model, optimizer, net.parameters, lambda: [p.grad for p in net.parameters()], optimizer
    if way.startswith("FSDP2"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # the default would be cuda where a GPU is visible
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=way == "FSDP2")
        fully_shard(net, mesh=mesh, reshard_after_forward=way == "FSDP2")
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        return net, optimizer, net.parameters, lambda: [p.grad for p in net.parameters()], optimizer
    script = {"ZeRO-1": zero1, "ZeRO-2": zero2, "ZeRO-3": zero3}[way]
    model = script.HandFSDP(net, units) if way == "ZeRO-3" else script.HandDDP(net)
    optimizer = script.ShardedOptimizer(model, torch.optim.AdamW, lr=lr)
    grads = {"ZeRO-1": lambda: model.flat_grads,
             "ZeRO-2": lambda: [*model.grad_shards, *model.flat_grads]}.get(way, lambda: [
                 *(s.grad for s in optimizer.shards), *model.flat_grads])
    weights = (lambda: [*optimizer.shards, *model.flat_params]) if way == "ZeRO-3" else lambda: model.flat_params
    return model, optimizer, weights, grads, optimizer.optimizer


def measure(way: str, args: argparse.Namespace) -> dict:
    net = build(args.hidden, args.layers)
    model, optimizer, weights, grads, inner = setup(way, net, args.lr)
    samples: list[int] = []

    def sample(*_) -> None:
        samples.append(sum(alive().values()))

    def sample_before_backward(module: nn.Module, inputs, output: torch.Tensor) -> None:
        sample()
        output.register_hook(sample)  # called with the output's gradient: the module's backward is next
    linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
    handles = []
    with Counted() as counted:
        for step in range(3):
            g = torch.Generator().manual_seed(step * 100 + dist.get_rank())
            x = torch.randn(args.batch_size, args.hidden, generator=g)
            y = torch.randint(0, 16, (args.batch_size,), generator=g)
            if step == 2:  # the third step is measured: the first made AdamW's state, DDP rebuilt its buckets after it
                sent_before = counted.elements
                handles = [h for m in linears for h in (m.register_forward_pre_hook(sample),
                                                        m.register_forward_hook(sample_before_backward))]
            if way == "DDP":
                optimizer.zero_grad(set_to_none=False)  # keep .grad, views of DDP's buckets (gc sees them there)
            else:
                optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            if hasattr(model, "sync_gradients"):
                model.sync_gradients()
            optimizer.step()
        sent = counted.elements - sent_before
    for h in handles:
        h.remove()
    del x, y
    found = alive()
    kinds = {"weights": storages(weights()), "grads": storages(grads()),
             "state": storages(t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor))}
    counted_bytes = {kind: sum(b for ptr, b in owned.items() if ptr in found) for kind, owned in kinds.items()}
    n = sum(p.numel() for p in build(args.hidden, args.layers).parameters())
    world = dist.get_world_size()
    formula = sum(FORMULA[way](world)) * n
    total = sum(counted_bytes.values())
    return {"way": way, "W": world, "weights": n, **{f"{k}_MiB": v / MiB for k, v in counted_bytes.items()},
            "total_MiB": total / MiB, "formula_MiB": formula / MiB, "ratio": total / formula,
            "transient_MiB": (max(samples) - sum(found.values())) / MiB,
            "sent_MiB": sent * 4 / MiB, "sent_formula_MiB": TRAFFIC[way] * n * (world - 1) / world * 4 / MiB}


def worker(rank: int, world: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        for way in args.ways:
            row = measure(way, args)
            gc.collect()
            if rank == 0:
                results.put(row)
    exit_worker()


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="zero_by_hand/memory.py", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=positive(int), default=2048, help="width of the MLP's blocks")
    p.add_argument("--layers", type=positive(int), default=6, help="square blocks (each hidden^2 + hidden weights)")
    p.add_argument("--batch-size", type=positive(int), default=32, help="samples per step per rank")
    p.add_argument("--world-sizes", type=list_of(int), default=[1, 2, 4])
    p.add_argument("--ways", type=list_of(str, WAYS), default=list(WAYS))
    p.add_argument("--lr", type=positive(float), default=1e-3)
    p.add_argument("--timeout", type=positive(float), default=300.0)
    p.add_argument("--out", type=Path, default=HERE, help="where memory.csv and memory.png go")
    args = p.parse_args(argv)
    p.check_out_writable(args.out)
    method = "fork" if sys.platform == "linux" else "spawn"
    rows = []
    for world in args.world_sizes:
        args.port = free_port()
        results = mp.get_context(method).SimpleQueue()
        mp.start_processes(worker, args=(world, args, results), nprocs=world, start_method=method)
        rows += [results.get() for _ in args.ways]
    write_csv(args.out / "memory.csv", rows, COLUMNS, floats=".4f")
    print(f"rank 0 of W, float32, AdamW; the MLP: {rows[0]['weights']:,} weights ({rows[0]['weights'] * 4 / MiB:.1f} "
          f"MiB); MiB after a step, counted from the live tensors, and the formula; the transient peak during the step;"
          f" MiB sent per step and rank (ring costs of the collectives counted), and the formula")
    table = [["way", "W", "weights", "grads", "AdamW", "total", "formula", "ratio", "transient", "sent", "formula"]]
    table += [[r["way"], str(r["W"]), *(f"{r[k]:.1f}" for k in ("weights_MiB", "grads_MiB", "state_MiB", "total_MiB",
                                                                "formula_MiB")), f"{r['ratio']:.3f}",
               f"{r['transient_MiB']:.1f}", f"{r['sent_MiB']:.1f}", f"{r['sent_formula_MiB']:.1f}"] for r in rows]
    print_table(table)
    plot(rows, args.out / "memory.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    worlds = sorted({r["W"] for r in rows})
    ways = [w for w in WAYS if any(r["way"] == w for r in rows)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(ways)
    for i, way in enumerate(ways):
        mine = {r["W"]: r for r in rows if r["way"] == way}
        xs = [j + i * width for j in range(len(worlds))]
        kept = [mine[w]["total_MiB"] for w in worlds]
        peak = [mine[w]["transient_MiB"] for w in worlds]
        bars = ax.bar(xs, kept, width, label=way)
        ax.bar(xs, peak, width, bottom=kept, color=bars[0].get_facecolor(), alpha=0.3)
        ax.scatter(xs, [mine[w]["formula_MiB"] for w in worlds], color="black", marker="_", s=200, zorder=3)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(worlds))], [f"W = {w}" for w in worlds])
    ax.set_ylabel("MiB on rank 0")
    ax.set_title("kept between steps (solid; black: the formula) and the transient peak during a step (light)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
