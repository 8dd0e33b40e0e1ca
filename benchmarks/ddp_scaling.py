"""DDP scaling on the CPU: samples/s with 1 and W processes, and what buckets and no_sync change.

    python benchmarks/ddp_scaling.py                             # the full set, ~1.5 min on 2 cores
    python benchmarks/ddp_scaling.py --models mlp --batches 512  # a quicker look

Every process runs with ONE intra-op thread (torch.set_num_threads(1)), so W processes use W cores
and 1 process uses one: the comparison is one core against W cores, not 2 threads against 2 processes.
Each rank trains on its own random batch of the same size b (the per-rank batch), so W ranks process
W*b samples per step. For each model and b it measures

    single       1 process (rank 0; the other ranks wait, idle), plain model: the baseline throughput(1)
    independent  W processes, plain model, no communication at all: what the machine gives W copies
                 of the work when nobody talks (shared caches, memory bandwidth, clock speed)
    ddp          W processes, DistributedDataParallel (gloo): the real thing

and prints efficiency = throughput(W) / (W * throughput(1)): 1.0 is perfect scaling.
Then, for the MLP at one batch size: DDP with bucket_cap_mb 1, 25 (the default) and 100, and
gradient accumulation over several micro-batches with and without no_sync().

All configurations live in one job of W processes and take turns, a block of steps each, round after
round; each one's time is the median of its blocks. So a machine that slows down for a while (this one
is shared) slows every configuration alike instead of spoiling one of them.

Models: "stage", the stages' Net (8 -> 64 -> 64 -> 4, 5 K parameters, tiny: all overhead), and "mlp", a
compute-bound MLP (--mlp-width, 0.8 M parameters by default). Writes DIR/ddp_scaling.csv and .png.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, write_csv  # noqa: E402

COLUMNS = ["experiment", "model", "params", "mode", "world_size", "per_rank_batch", "global_batch", "bucket_cap_mb",
           "accumulate", "no_sync", "steps", "step_ms", "samples_per_s", "efficiency"]


class Net(nn.Module):
    """The stages' model (01_single_gpu/train.py): 8 features, hidden 64, 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(name: str, width: int) -> tuple[nn.Module, int, int]:
    """(model, input features, classes)."""
    if name == "stage":
        return Net(), 8, 4
    # Three width x width layers: the matrix products dominate, so compute grows with batch * parameters.
    layers = [nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width),
              nn.ReLU(), nn.Linear(width, 10)]
    return nn.Sequential(*layers), width, 10


class Runner:
    """One configuration, set up once (model, optimizer, data), then asked for a few steps at a time."""

    def __init__(self, cfg: dict, args: argparse.Namespace, rank: int) -> None:
        self.cfg = cfg
        self.active = cfg["mode"] != "single" or rank == 0  # "single": rank 0 trains, the others wait
        torch.manual_seed(args.seed)
        model, features, classes = make_model(cfg["model"], args.mlp_width)
        self.params = sum(p.numel() for p in model.parameters())
        if cfg["mode"] == "ddp":  # sync point (every rank): broadcasts rank 0's weights
            model = DDP(model, bucket_cap_mb=cfg["bucket_cap_mb"])
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        g = torch.Generator().manual_seed(args.seed + rank)
        b = cfg["batch"] if self.active else 0
        # A few batches made in advance and cycled: we time the training step, not making data.
        self.data = [(torch.randn(b, features, generator=g), torch.randint(0, classes, (b,), generator=g))
                     for _ in range(4)]
        self.i = 0

    def steps(self, n: int) -> None:
        if not self.active:
            return
        k = self.cfg["accumulate"]
        for _ in range(n):
            for j in range(k):  # k micro-batches, then one optimizer step
                x, y = self.data[self.i % len(self.data)]
                self.i += 1
                # no_sync: no gradient all-reduce for the first k-1 micro-batches; the gradients add up
                # locally and the last backward all-reduces their sum, once.
                skip = self.cfg["no_sync"] and j < k - 1
                with self.model.no_sync() if skip else contextlib.nullcontext():
                    (F.cross_entropy(self.model(x), y) / k).backward()  # ddp: all-reduces buckets in backward
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)


def timed(runner: Runner, n: int) -> float:
    """Seconds for n steps, from a common start to the end of the slowest rank."""
    dist.barrier()  # every rank starts the clock together (an idle rank waits here, using no CPU)
    start = time.perf_counter()
    runner.steps(n)
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def worker(rank: int, world: int, configs: list[dict], args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        runners, per_block = [], []
        for i, cfg in enumerate(configs):  # set up, warm up, and size the blocks of steps
            runner = Runner(cfg, args, rank)
            runner.steps(args.warmup)
            one = timed(runner, 1)  # the same on every rank (the slowest's), so all agree on the block size
            n = args.steps or max(1, round(args.budget / args.rounds / one))
            runners.append(runner)
            per_block.append(n)
            if rank == 0:
                print(f"[{i + 1}/{len(configs)}] {label(cfg)}: {one * 1e3:.1f} ms/step, {args.rounds} blocks of "
                      f"{n} step{'s' if n > 1 else ''}", flush=True)
        # The configurations take turns, block after block: if the machine gets slower or faster meanwhile
        # (other jobs, clock speed), every configuration sees it alike, and the ratios stay fair.
        blocks: list[list[float]] = [[] for _ in runners]
        for r in range(args.rounds):
            for runner, n, times in zip(runners, per_block, blocks, strict=True):
                times.append(timed(runner, n))
            if rank == 0:
                print(f"round {r + 1}/{args.rounds} done", flush=True)
        rows = []
        for runner, n, times in zip(runners, per_block, blocks, strict=True):
            cfg, procs = runner.cfg, 1 if runner.cfg["mode"] == "single" else world
            seconds = statistics.median(times)  # of the blocks: a block hit by a hiccup does not count
            rows.append({**{key: cfg[key] for key in ("experiment", "model", "mode", "accumulate", "no_sync")},
                         "bucket_cap_mb": cfg["bucket_cap_mb"] if cfg["mode"] == "ddp" else "",
                         "params": runner.params, "world_size": procs, "per_rank_batch": cfg["batch"],
                         "global_batch": cfg["batch"] * procs, "steps": n * args.rounds,
                         "step_ms": seconds / n * 1e3,
                         "samples_per_s": n * cfg["accumulate"] * cfg["batch"] * procs / seconds})
        if rank == 0:
            results.put(rows)
    exit_worker()


def label(cfg: dict) -> str:
    extra = f", bucket {cfg['bucket_cap_mb']} MB" if cfg["mode"] == "ddp" else ""
    if cfg["accumulate"] > 1:
        extra += f", {cfg['accumulate']} micro-batches" + (" with no_sync" if cfg["no_sync"] else " all synced")
    return f"{cfg['experiment']} {cfg['model']} {cfg['mode']} b={cfg['batch']}{extra}"


def plan(args: argparse.Namespace) -> list[dict]:
    """Every configuration; "single" ones run on rank 0 alone while the other ranks wait."""
    base = {"bucket_cap_mb": 25, "accumulate": 1, "no_sync": False}
    configs = []
    for model in args.models:
        for b in args.batches:
            for mode in ("single", "independent", "ddp"):
                configs.append({**base, "experiment": "scaling", "model": model, "batch": b, "mode": mode})
    b = args.sweep_batch
    configs.append({**base, "experiment": "buckets", "model": "mlp", "batch": b, "mode": "single"})
    for cap in args.bucket_caps:
        configs.append({**base, "experiment": "buckets", "model": "mlp", "batch": b, "mode": "ddp",
                        "bucket_cap_mb": cap})
    acc = {**base, "experiment": "no_sync", "model": "mlp", "batch": b, "accumulate": args.accumulate}
    configs += [{**acc, "mode": "single"}, {**acc, "mode": "ddp"}, {**acc, "mode": "ddp", "no_sync": True}]
    return configs


def key(row: dict) -> tuple:
    return row["experiment"], row["model"], row["per_rank_batch"], row["accumulate"]


def run(world: int, configs: list[dict], args: argparse.Namespace) -> list[dict]:
    args.port = free_port()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, configs, args, queue), nprocs=world)  # worker(rank, world, ...)
    return queue.get()


def print_table(rows: list[dict]) -> None:
    header = ["experiment", "model", "params", "mode", "W", "b/rank", "global", "bucket MB", "micro", "no_sync",
              "ms/step", "samples/s", "efficiency"]
    table = [[r["experiment"], r["model"], f"{r['params']:,}", r["mode"], str(r["world_size"]),
              str(r["per_rank_batch"]), str(r["global_batch"]), str(r["bucket_cap_mb"]) if r["mode"] == "ddp" else "-",
              str(r["accumulate"]),
              "yes" if r["no_sync"] else "-", f"{r['step_ms']:.2f}", f"{r['samples_per_s']:,.0f}",
              f"{r['efficiency']:.2f}"] for r in rows]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) if i < 4 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    scaling = [r for r in rows if r["experiment"] == "scaling" and r["mode"] != "single"]
    for i, model in enumerate(sorted({r["model"] for r in scaling})):
        for mode, style in (("ddp", "-"), ("independent", "--")):
            pts = sorted((r["global_batch"], r["efficiency"]) for r in scaling
                         if r["model"] == model and r["mode"] == mode)
            what = "DDP" if mode == "ddp" else "no communication"
            left.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}",
                      label=f"{model}: {what}")
    left.axhline(1.0, color="grey", linewidth=1)
    left.axhline(0.9, color="grey", linewidth=1, linestyle=":")
    world = max(r["world_size"] for r in rows)
    left.set(xscale="log", xlabel=f"global batch ({world} ranks x per-rank batch)", ylim=(0, 1.1),
             ylabel=f"efficiency = throughput({world}) / ({world} x throughput(1))", title="scaling, 1 thread per rank")
    left.legend(fontsize=8)
    sweep = [r for r in rows if r["experiment"] in ("buckets", "no_sync") and r["mode"] == "ddp"]
    names = [(f"bucket {r['bucket_cap_mb']} MB" if r["experiment"] == "buckets" else
              f"{r['accumulate']} micro-b.\n" + ("no_sync" if r["no_sync"] else "all synced")) for r in sweep]
    bars = right.bar(range(len(sweep)), [r["efficiency"] for r in sweep],
                     color=["C2" if r["experiment"] == "buckets" else "C3" for r in sweep])
    right.bar_label(bars, fmt="%.2f")
    right.set_xticks(range(len(sweep)), names, fontsize=8)
    right.axhline(1.0, color="grey", linewidth=1)
    b = sweep[0]["per_rank_batch"] if sweep else 0
    right.set(ylabel="efficiency", ylim=(0, 1.1), title=f"mlp, {world} ranks, batch {b} per rank: buckets and no_sync")
    fig.suptitle(f"DDP on gloo/CPU ({os.cpu_count()} cores, torch {torch.__version__})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)




def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/ddp_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=list_of(str, ("stage", "mlp")), default=["stage", "mlp"])
    p.add_argument("--batches", type=list_of(int), default=[32, 128, 512, 2048, 4096], help="per-rank batch sizes")
    p.add_argument("--world-size", type=positive(int), default=2, help="processes of the distributed runs")
    p.add_argument("--mlp-width", type=positive(int), default=512, help="width of the MLP's layers (512: 0.8 M params)")
    p.add_argument("--sweep-batch", type=positive(int), default=64, help="per-rank batch of the bucket/no_sync runs")
    p.add_argument("--bucket-caps", type=list_of(int), default=[1, 25, 100], help="bucket_cap_mb values")
    p.add_argument("--accumulate", type=positive(int), default=4, help="micro-batches per step in the no_sync run")
    p.add_argument("--steps", type=int, default=0, help="steps per block (default 0: fit --budget)")
    p.add_argument("--rounds", type=positive(int), default=5, help="timed blocks per configuration (median)")
    p.add_argument("--budget", type=positive(float), default=1.5, help="seconds of timed steps per configuration")
    p.add_argument("--warmup", type=positive(int), default=3, help="untimed steps first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/ddp_scaling"), help="where to write the CSV and PNG")
    p.add_argument("--timeout", type=positive(float), default=120.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    args = p.parse_args(argv)
    if args.steps < 0:
        p.error(f"argument --steps: must be 0 (fit --budget) or positive, got {args.steps}")
    if args.world_size < 2:
        p.error(f"argument --world-size: the distributed runs need 2 or more processes, got {args.world_size}")
    p.check_out_writable(args.out)  # fail now, not after measuring

    cores = os.cpu_count() or 1
    over = " (oversubscribed: more processes than cores)" if args.world_size > cores else ""
    print(f"DDP scaling: W = 1 and {args.world_size}{over} on {cores} CPU cores, gloo, ONE intra-op thread per "
          f"process (torch.set_num_threads(1)), same per-rank batch; torch {torch.__version__}", flush=True)
    rows = run(args.world_size, plan(args), args)
    # The baseline of every row: 1 process, same experiment, model, per-rank batch and number of micro-batches.
    base = {key(r): r["samples_per_s"] for r in rows if r["mode"] == "single"}
    for r in rows:
        r["efficiency"] = r["samples_per_s"] / (r["world_size"] * base[key(r)])

    print()
    print_table(rows)
    print("efficiency = samples/s with W processes / (W x samples/s of 1 process), same per-rank batch. "
          "independent: W processes training without any communication (the machine's own limit).")
    write_csv(args.out / "ddp_scaling.csv", rows, COLUMNS)
    plot(rows, args.out / "ddp_scaling.png")
    print(f"\nwrote {args.out / 'ddp_scaling.csv'} and {args.out / 'ddp_scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
