"""What each rank keeps and sends, measured, against ZeRO's formulas: DDP, zero1.py, zero2.py, zero3.py and FSDP2.

    python zero_by_hand/memory.py                    # the README's table: the 100 MB MLP of ddp_by_hand/overlap.py
    python zero_by_hand/memory.py --hidden 256 --layers 2 --world-sizes 2 --out runs/memory_quick

For each W and each way, W ranks of their own (forked, gloo, float32) train an MLP of --layers blocks (a square Linear
of width --hidden and a ReLU) and a Linear to 16 classes, with AdamW, for three steps on random data. Each block is a
unit for zero3.py and for FSDP2 (`fully_shard`, with reshard_after_forward True and False); zero1.py and zero2.py
bucket the gradients as DDP does (25 MiB, the first 1 MiB). DDP keeps its gradients in its buckets
(gradient_as_bucket_view, as zero1.py does; without it DDP keeps them twice, once where gc cannot see them).

Memory is counted from the tensors alive in rank 0's process after the third step: every tensor object Python's gc
knows, each storage once, not the process's size. The total is all of them; they are then sorted by what torch's own
objects hold, not by what a script says it keeps: weights (the model's parameters and those AdamW steps), gradients
(their .grad), AdamW's state (its `state`: exp_avg, exp_avg_sq and step per tensor it steps), and other (what none
of them holds: a whole gradient a script kept somewhere would be there). Beside the total, the formula (Ψ weights, 4
bytes each): DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/W, ZeRO-2 4Ψ + 12Ψ/W, ZeRO-3 and FSDP2 16Ψ/W. Each way runs in ranks of its
own: a parameter's post-accumulate-grad hook that holds its wrapper is a cycle gc cannot free (zero1's HandDDP
outlives gc.collect() with its hooks, not without them), so a way measured after another in one process would count
the other's leftovers. During the third step memory is counted again at every Linear's forward and before its
backward (hooks), and the largest total, less the total after the step, is the transient peak: the activations, and
what lives only during a step (the whole gradients of ZeRO-2, ZeRO-3 and FSDP2 until they are reduce-scattered, the
gathered units of ZeRO-3 and FSDP2).

Traffic is counted from outside the scripts: torch.distributed's all_reduce, all_gather_single and
reduce_scatter_single are wrapped in each rank (DDP's built-in all-reduce runs in C++, so DDP gets the comm hook
that does the same in Python), and each call costs what a ring sends per rank: 2n(W-1)/W elements for an all-reduce
of n, n(W-1)/W for an all-gather or a reduce-scatter of n in all. Formulas, in Ψ(W-1)/W: DDP 2, ZeRO-1 3 (the
all-reduce, then the all-gather of the weights), ZeRO-2 2, ZeRO-3 3 (two all-gathers and a reduce-scatter), FSDP2 3
with reshard_after_forward, 2 without (the weights stay whole from forward to backward).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import io
import sys
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (DDP(...) imports it, 2-3 CPU-s: imported here once, not in every forked rank)
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

from tools.cli import (  # noqa: E402
    ArgumentParser,
    exit_worker,
    free_port,
    gloo_group,
    list_of,
    positive,
    print_table,
    read_csv,
    write_csv,
)

WAYS = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2", "FSDP2-no-reshard")
# Bytes per weight on each rank (float32, AdamW): (weights, gradients, AdamW's two moments), at W ranks.
FORMULA = {"DDP": lambda w: (4, 4, 8), "ZeRO-1": lambda w: (4, 4, 8 / w), "ZeRO-2": lambda w: (4, 4 / w, 8 / w),
           **{way: (lambda w: (4 / w, 4 / w, 8 / w)) for way in ("ZeRO-3", "FSDP2", "FSDP2-no-reshard")}}
# Elements a rank sends per step, in Ψ(W - 1)/W.
TRAFFIC = {"DDP": 2, "ZeRO-1": 3, "ZeRO-2": 2, "ZeRO-3": 3, "FSDP2": 3, "FSDP2-no-reshard": 2}
MiB = 2**20
COLUMNS = ["way", "W", "weights", "weights_MiB", "grads_MiB", "state_MiB", "other_MiB", "total_MiB", "formula_MiB",
           "ratio", "moment_elements", "state_keys", "transient_MiB", "sent_MiB", "sent_formula_MiB"]


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


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard (its numel() is the whole tensor's), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of `tensors` (a DTensor counts its local shard)."""
    found = {}
    for t in tensors:
        if t is None:
            continue
        t = local(t)
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
    """(model, the optimizer the loop calls, the torch.optim.AdamW inside it, whose .state holds the moments)."""
    units = list(net)
    if way == "DDP":
        model = DDP(net, gradient_as_bucket_view=True)  # .grad in DDP's buckets: otherwise both, and gc sees one
        model.register_comm_hook(None, allreduce_hook)  # DDP's all-reduce, in Python: the wrapper counts it
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        return model, optimizer, optimizer
    if way.startswith("FSDP2"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # the default would be cuda where a GPU is visible
        for unit in units:
            fully_shard(unit, mesh=mesh, reshard_after_forward=way == "FSDP2")
        fully_shard(net, mesh=mesh, reshard_after_forward=way == "FSDP2")
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
        return net, optimizer, optimizer
    script = {"ZeRO-1": zero1, "ZeRO-2": zero2, "ZeRO-3": zero3}[way]
    model = script.HandFSDP(net, units) if way == "ZeRO-3" else script.HandDDP(net)
    optimizer = script.ShardedOptimizer(model, torch.optim.AdamW, lr=lr)
    return model, optimizer, optimizer.optimizer


def held(net: nn.Module, adamw: torch.optim.Optimizer) -> tuple[dict[str, dict[int, int]], int, str]:
    """What torch's own objects hold, by storage: ({"weights", "grads", "state": {storage: bytes}}, the elements of
    one AdamW moment, the keys of AdamW's state). Weights: the model's parameters and those AdamW steps (a script's
    shards); gradients: their .grad; state: AdamW's `state`, read as AdamW keeps it, not as a script says."""
    params = [*net.parameters(), *(p for group in adamw.param_groups for p in group["params"])]
    state = [adamw.state[p] for group in adamw.param_groups for p in group["params"] if p in adamw.state]
    keys = sorted({key for s in state for key in s})
    return ({"weights": storages(params), "grads": storages(p.grad for p in params),
             "state": storages(t for s in state for t in s.values() if isinstance(t, torch.Tensor))},
            sum(local(s["exp_avg"]).numel() for s in state), " ".join(keys))


def measure(way: str, args: argparse.Namespace) -> dict:
    net = build(args.hidden, args.layers)
    model, optimizer, adamw = setup(way, net, args.lr)
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
    found = alive()  # every storage a live tensor uses: what a whole gradient kept somewhere would add to
    kinds, moment, keys = held(net, adamw)
    counted_bytes = {kind: sum(b for ptr, b in owned.items() if ptr in found) for kind, owned in kinds.items()}
    counted_bytes["other"] = sum(b for ptr, b in found.items() if not any(ptr in owned for owned in kinds.values()))
    n = sum(p.numel() for p in build(args.hidden, args.layers).parameters())
    world = dist.get_world_size()
    formula = sum(FORMULA[way](world)) * n
    total = sum(found.values())
    return {"way": way, "W": world, "weights": n, **{f"{k}_MiB": v / MiB for k, v in counted_bytes.items()},
            "total_MiB": total / MiB, "formula_MiB": formula / MiB, "ratio": total / formula,
            "transient_MiB": (max(samples) - total) / MiB, "moment_elements": moment, "state_keys": keys,
            "sent_MiB": sent * 4 / MiB, "sent_formula_MiB": TRAFFIC[way] * n * (world - 1) / world * 4 / MiB}


def worker(rank: int, world: int, way: str, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        row = measure(way, args)
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
        for way in args.ways:  # each in ranks of its own: no tensor a way leaves behind is counted in another's
            args.port = free_port()
            results = mp.get_context(method).SimpleQueue()
            mp.start_processes(worker, args=(world, way, args, results), nprocs=world, start_method=method)
            rows.append(results.get())
    write_csv(args.out / "memory.csv", rows, COLUMNS, floats=".4f")
    print(readme_table(args.out / "memory.csv"), end="")
    plot(rows, args.out / "memory.png")
    return 0


def readme_table(csv_path: Path) -> str:
    """What main() prints, from the CSV it wrote: the README shows the committed memory.csv's (a test checks it)."""
    rows = read_csv(csv_path)
    n = int(rows[0]["weights"])
    table = [["way", "W", "weights", "grads", "AdamW", "other", "total", "formula", "ratio", "transient", "sent",
              "formula"]]
    table += [[r["way"], r["W"], *(f"{float(r[k]):.1f}" for k in ("weights_MiB", "grads_MiB", "state_MiB", "other_MiB",
                                                                  "total_MiB", "formula_MiB")),
               f"{float(r['ratio']):.3f}", *(f"{float(r[k]):.1f}" for k in ("transient_MiB", "sent_MiB",
                                                                            "sent_formula_MiB"))] for r in rows]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print(f"rank 0 of W, float32, AdamW; the MLP: {n:,} weights ({n * 4 / MiB:.1f} MiB); MiB after a step, every "
              f"live tensor counted (AdamW: its .state; other: held by none of the model, the gradients, AdamW), and "
              f"the formula; the transient peak during the step; MiB sent per step and rank (ring costs of the "
              f"collectives counted), and the formula")
        print_table(table)
    return out.getvalue()


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
