"""See the overlap: profile a few training steps of torch's DDP and of the hand-built one (bucketed.py), draw
each rank's timeline, measure how much of the communication hides under backward, and sweep the bucket size.

    python ddp_by_hand/overlap.py                # the README's figures: 2 ranks, a 100 MB MLP (~100 s on 2 idle cores)
    python ddp_by_hand/overlap.py --hidden 512 --layers 4 --bucket-mb 0.001,1000 --rounds 1 --out runs/overlap_quick

W processes (mp.spawn, gloo, one intra-op thread each) train an MLP of --layers square layers of width
--hidden, in float32, on random data. Each configuration (which DDP, which buckets) trains a few warm-up steps,
then --steps steps under torch.profiler, in turns with the others, --rounds times. From each rank's trace:

    backward compute   the autograd engine's operators on the main thread (autograd::engine::evaluate_function),
                       less the moments spent launching an all-reduce from a hook inside them
    communication      the all-reduces on gloo's worker threads (gloo:all_reduce), from start to end
    hidden             the communication time during which backward compute ran on the same rank
    overlap            hidden / communication: 1 = every all-reduce ran under backward, 0 = none did
    exposed            communication - hidden
    waited             on the main thread, from backward's last operator to the optimizer step: what the step
                       waited for, measured apart from gloo's threads (at least their all-reduce time after backward)

Configurations: "hand" is bucketed.HandDDP, "ddp" torch's DistributedDataParallel with the same buckets, and
"hand, after backward" the negative control: the same HandDDP code, but every all-reduce launched only after
backward has finished (as naive.py does, in buckets). The sweep runs --bucket-mb from one bucket per parameter
to one bucket for the whole model, every bucket with the same cap; the timeline uses DDP's defaults (25 MiB,
first bucket 1 MiB).

Writes DIR/overlap.csv (one row per configuration), DIR/timeline.png (one step of the three at 25 MiB, each
rank's main thread and gloo's threads on one time axis), DIR/sweep.png, and DIR/trace_<name>.json.gz: the
profiler's chrome traces of the timeline's configurations, both ranks in one file (open it in
https://ui.perfetto.dev). Default DIR: runs/ddp_by_hand.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bucketed.py: the hand-built DDP
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
import bucketed  # noqa: E402

from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, summary, write_csv  # noqa: E402

COLUMNS = ["name", "impl", "bucket_mb", "first_bucket_mb", "buckets", "bucket_bytes", "ddp_bucket_bytes", "ranks",
           "steps", "step_ms", "backward_ms", "comm_ms", "hidden_ms", "exposed_ms", "overlap", "first_allreduce_ms",
           "comm_after_backward_ms", "waited_ms"]
DEFAULT_CAP, DEFAULT_FIRST = 25.0, 1.0  # DDP's bucket_cap_mb and its first bucket (dist._DEFAULT_FIRST_BUCKET_BYTES)
COMPUTE = "autograd::engine::evaluate_function: "  # the prefix of every backward operator in the trace
COMM = "gloo:all_reduce"  # what gloo's worker thread records for each all-reduce it runs
LAUNCH = "c10d::allreduce_"  # launching one, on the main thread: inside a backward operator, but not computing


class LaunchAfterBackward(bucketed.HandDDP):
    """The negative control: the same buckets and the same all-reduces, but none launched before backward ends."""

    def _gradient_ready(self, p: nn.Parameter) -> None:
        self.arrived.append(p)  # hold every gradient back...

    def sync_gradients(self) -> None:
        for p in self.arrived:  # ...until backward has finished: then launch the buckets, and wait
            super()._gradient_ready(p)
        self.arrived.clear()
        super().sync_gradients()

    def _new_step(self) -> None:
        super()._new_step()
        self.arrived: list[nn.Parameter] = []


@dataclass(frozen=True)
class Config:
    impl: str  # "hand", "ddp" or "after_backward"
    bucket_mb: float
    first_bucket_mb: float
    timeline: bool = False  # drawn in timeline.png, its trace kept

    @property
    def name(self) -> str:
        what = {"hand": "hand", "ddp": "ddp", "after_backward": "hand, after backward"}[self.impl]
        return f"{what} {self.bucket_mb:g}/{self.first_bucket_mb:g} MiB"


def plan(args: argparse.Namespace) -> list[Config]:
    timeline = [Config(impl, DEFAULT_CAP, DEFAULT_FIRST, timeline=True) for impl in ("hand", "after_backward", "ddp")]
    # Without the small first bucket: DDP(bucket_cap_mb=25) does this (an explicit cap is the first bucket's too).
    first = [Config(impl, DEFAULT_CAP, DEFAULT_CAP) for impl in ("hand", "ddp")]
    sweep = [Config(impl, cap, cap) for cap in args.bucket_mb for impl in ("hand", "ddp") if cap != DEFAULT_CAP]
    return timeline + first + sweep


def make_model(args: argparse.Namespace) -> nn.Module:
    """--layers square layers of width --hidden with ReLUs, then 16 classes; the same weights on every rank."""
    torch.manual_seed(args.seed)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(args.hidden, 16))


def wrap(model: nn.Module, cfg: Config) -> nn.Module:
    """Sync point: every wrapper broadcasts rank 0's weights."""
    if cfg.impl == "hand":
        return bucketed.HandDDP(model, cfg.bucket_mb, cfg.first_bucket_mb)
    if cfg.impl == "after_backward":
        return LaunchAfterBackward(model, cfg.bucket_mb, cfg.first_bucket_mb)
    if (cfg.bucket_mb, cfg.first_bucket_mb) == (DEFAULT_CAP, DEFAULT_FIRST):
        return DDP(model)  # DDP's defaults, as everyone uses it
    # Per-bucket caps: the first, then the rest. (bucket_cap_mb=X alone makes X the first bucket's cap too.)
    return DDP(model, bucket_cap_mb_list=[cfg.first_bucket_mb, cfg.bucket_mb])


def bucket_sizes(model: nn.Module) -> tuple[list[int], list[int]]:
    """(bytes of each bucket as HandDDP packs them, as DDP reports it packed them: [] for HandDDP)."""
    if isinstance(model, DDP):
        data = model._get_ddp_logging_data()  # after the first step DDP rebuilds its buckets in the order seen
        return [], [int(s) for s in str(data.get("rebuilt_bucket_sizes", "")).split(",") if s.strip()]
    return [sum(p.numel() * p.element_size() for p in bucket) for bucket in model.params], []


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, n: int,
                first: int = 0) -> None:
    for k in range(first, first + n):
        with record_function(f"step {k}"):
            optimizer.zero_grad(set_to_none=True)
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                loss.backward()  # DDP: waits for its last bucket here, inside backward
            if not isinstance(model, DDP):
                with record_function("sync_gradients"):
                    model.sync_gradients()  # HandDDP: waits for its buckets here
            with record_function("optimizer step"):
                optimizer.step()


def block(cfg: Config, args: argparse.Namespace, rank: int, trace: Path) -> tuple[list[int], list[int]]:
    """Set up one configuration, warm it up, profile --steps steps into `trace`; return its bucket sizes."""
    model = wrap(make_model(args), cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own batch
    x, y = torch.randn(args.batch_size, args.hidden, generator=g), torch.randint(0, 16, (args.batch_size,), generator=g)
    train_steps(model, optimizer, x, y, args.warmup)  # DDP's buckets are rebuilt after its first step
    dist.barrier()  # the ranks start the profiled steps together
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_steps(model, optimizer, x, y, args.steps, first=args.warmup)
    prof.export_chrome_trace(str(trace))
    return bucket_sizes(model)


# --- reading a trace ------------------------------------------------------------------------------------------------

def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def minus(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of a union of disjoint spans `xs` outside those of `ys`."""
    out = []
    for a, b in xs:
        for c, d in ys:
            if c < b and d > a:  # ys[k] cuts into [a, b]
                if c > a:
                    out.append((a, c))
                a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where two unions of disjoint spans overlap."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def steps_in(events: list[dict]) -> list[dict]:
    """Each profiled step of one rank's trace: its span, the phases on the main thread, backward's operators and the
    all-reduces on gloo's threads, in ms from the step's start."""
    spans = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in spans if e["name"].startswith("step ")), key=lambda e: e["ts"])
    main = steps[0]["tid"]
    found = []
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        inside = [e for e in spans if t0 <= e["ts"] < t1]

        def ms(e: dict, t0: float = t0) -> tuple[float, float]:
            return (e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3
        phases = {e["name"]: ms(e) for e in inside if e["tid"] == main and e["name"] in
                  ("forward", "backward", "sync_gradients", "optimizer step")}
        compute = [ms(e) for e in inside if e["tid"] == main and e["name"].startswith(COMPUTE)]
        launches = [ms(e) for e in inside if e["tid"] == main and e["name"] == LAUNCH]
        gloo = sorted((e for e in spans if e["tid"] != main and e["name"] == COMM and t0 <= e["ts"] < t1),
                      key=lambda e: e["ts"])
        comm = [ms(e) for e in gloo]  # in the order they started: bucket 0, 1, ... (gloo takes them in launch order)
        threads = sorted({e["tid"] for e in gloo})
        found.append({"start_us": t0, "ms": s["dur"] / 1e3, "phases": phases,
                      "compute": minus(union(compute), union(launches)), "comm": comm,
                      "thread": [threads.index(e["tid"]) for e in gloo]})
    return found


def measure(step: dict) -> dict[str, float]:
    compute, comm = step["compute"], union(step["comm"])
    hidden = length(intersection(comm, compute))
    start, end = step["phases"]["backward"][0], compute[-1][1]
    # To the end of its last operator: DDP's loss.backward() goes on to wait for its buckets, HandDDP's does not.
    return {"step_ms": step["ms"], "backward_ms": end - start, "comm_ms": length(comm),
            "hidden_ms": hidden, "exposed_ms": length(comm) - hidden,
            "first_allreduce_ms": step["comm"][0][0] - start if step["comm"] else float("nan"),
            # Two views of what backward left to wait for, from two threads: on gloo's, the all-reduce time after
            # backward's last operator; on the main thread, the time from that operator to the optimizer step. The
            # step must wait for every all-reduce, so the first is at most the second (the tests check it).
            "comm_after_backward_ms": length(intersection(comm, [(end, math.inf)])),
            "waited_ms": step["phases"]["optimizer step"][0] - end}


# --- the job --------------------------------------------------------------------------------------------------------

def worker(rank: int, world: int, configs: list[Config], args: argparse.Namespace, tmp: str) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        for r in range(args.rounds):  # the configurations take turns: a slow moment of the machine hits them alike
            for i, cfg in enumerate(configs):
                sizes = block(cfg, args, rank, Path(tmp) / f"r{r}_c{i}_rank{rank}.json")
                if rank == 0 and r == 0:
                    (Path(tmp) / f"c{i}_buckets.json").write_text(json.dumps(sizes))
            if rank == 0:
                print(f"round {r + 1}/{args.rounds} done", flush=True)
    exit_worker()


def summarise(configs: list[Config], args: argparse.Namespace, world: int, tmp: Path) -> tuple[list[dict], dict]:
    rows, timelines = [], {}
    for i, cfg in enumerate(configs):
        measured = []
        for r in range(args.rounds):
            for rank in range(world):
                events = json.loads((tmp / f"r{r}_c{i}_rank{rank}.json").read_text())["traceEvents"]
                steps = steps_in(events)
                measured += [measure(s) for s in steps]
                if cfg.timeline and r == args.rounds - 1:  # its trace is the one kept
                    timelines.setdefault(cfg.name, {})[rank] = steps
        if cfg.timeline:  # the figure shows the step of median length (the ranks' mean) of the kept round
            ranks = timelines[cfg.name]
            lengths = [statistics.fmean(ranks[rank][k]["ms"] for rank in ranks) for k in range(args.steps)]
            k = sorted(range(args.steps), key=lengths.__getitem__)[args.steps // 2]
            timelines[cfg.name] = {rank: steps[k] for rank, steps in ranks.items()}
        hand_sizes, ddp_sizes = json.loads((tmp / f"c{i}_buckets.json").read_text())
        comm, hidden = sum(m["comm_ms"] for m in measured), sum(m["hidden_ms"] for m in measured)
        sizes = hand_sizes or ddp_sizes
        rows.append({**{k: v for k, v in asdict(cfg).items() if k != "timeline"}, "name": cfg.name,
                     "buckets": len(sizes), "bucket_bytes": " ".join(map(str, hand_sizes)),
                     "ddp_bucket_bytes": " ".join(map(str, ddp_sizes)), "ranks": world,
                     "steps": len(measured) // world,
                     **{k: statistics.median(m[k] for m in measured)
                        for k in ("step_ms", "backward_ms", "first_allreduce_ms")},
                     # Means, so that hidden + exposed = all-reduce time, and overlap = hidden / all-reduce time.
                     **{k: statistics.fmean(m[k] for m in measured) for k in ("comm_ms", "hidden_ms", "exposed_ms",
                                                                               "comm_after_backward_ms", "waited_ms")},
                     "overlap": hidden / comm if comm else 0.0})
    return rows, timelines


def keep_traces(configs: list[Config], args: argparse.Namespace, world: int, tmp: Path) -> list[Path]:
    """The timeline configurations' traces of the last round, both ranks in one file, gzipped (Perfetto reads it)."""
    kept = []
    for i, cfg in enumerate(configs):
        if not cfg.timeline:
            continue
        merged: list[dict] = []
        for rank in range(world):
            trace = json.loads((tmp / f"r{args.rounds - 1}_c{i}_rank{rank}.json").read_text())
            pid = next(e["pid"] for e in trace["traceEvents"] if e.get("ph") == "X")
            merged += [{**e, "args": {"name": f"rank {rank}"}} if e.get("ph") == "M" and e.get("name") == "process_name"
                       and e.get("pid") == pid else e for e in trace["traceEvents"]]
        path = args.out / f"trace_{cfg.impl}.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, f)
        kept.append(path)
    return kept


# --- figures --------------------------------------------------------------------------------------------------------

def shifted(step: dict, ms: float) -> dict:
    """A step of steps_in() moved `ms` later."""
    def move(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(a + ms, b + ms) for a, b in spans]
    return {**step, "phases": dict(zip(step["phases"], move(list(step["phases"].values())), strict=True)),
            "compute": move(step["compute"]), "comm": move(step["comm"])}


BUCKET_COLOURS = ["tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"]


def plot_timeline(timelines: dict, rows: list[dict], path: Path) -> None:
    """One step of each configuration: per rank, the main thread's phases and gloo's all-reduces on one time axis."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_name = {r["name"]: r for r in rows}
    ranks = max(len(t) for t in timelines.values())
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.3 + 1.1 * ranks * len(timelines)), squeeze=False)
    end = 1.01 * max((s["start_us"] - min(o["start_us"] for o in t.values())) / 1e3 + s["ms"]
                     for t in timelines.values() for s in t.values())
    for ax, (name, steps) in zip(axes[:, 0], timelines.items(), strict=True):
        lanes = []
        # The ranks run on one machine, so their traces share a clock: one time axis from the first rank's start.
        t0 = min(step["start_us"] for step in steps.values())
        for rank, step in sorted(steps.items()):
            step = shifted(step, (step["start_us"] - t0) / 1e3)
            main, gloo = len(lanes), len(lanes) + 1  # top to bottom: rank 0's main thread, its gloo threads, rank 1's
            lanes += [f"rank {rank}: main thread", f"rank {rank}: gloo threads"]
            waiting = [step["phases"][p] for p in ("backward", "sync_gradients") if p in step["phases"]]
            ax.broken_barh([(a, b - a) for a, b in waiting], (main - 0.06, 0.12), color="tab:red", zorder=1)
            for phase, colour in (("forward", "0.75"), ("optimizer step", "tab:green")):
                if phase in step["phases"]:
                    a, b = step["phases"][phase]
                    ax.broken_barh([(a, b - a)], (main - 0.35, 0.7), color=colour, zorder=2)
            ax.broken_barh([(a, b - a) for a, b in step["compute"]], (main - 0.35, 0.7), color="tab:blue", zorder=2)
            for k, ((a, b), thread) in enumerate(zip(step["comm"], step["thread"], strict=True)):
                y = gloo - 0.2 + 0.4 * (thread % 2)  # gloo has two threads: two buckets may be in flight at once
                ax.broken_barh([(a, b - a)], (y - 0.18, 0.36), color=BUCKET_COLOURS[k % len(BUCKET_COLOURS)],
                               edgecolor="black", lw=0.5, zorder=2)
                ax.text((a + b) / 2, y, f"b{k}", ha="center", va="center", fontsize=6, zorder=3)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        ax.set_xlim(0, end)
        row = by_name[name]
        ax.set_title(f"{name}: {row['overlap']:.0%} of {row['comm_ms']:.0f} ms of all-reduce per step hidden under "
                     f"backward; step {row['step_ms']:.0f} ms (medians over every profiled step; drawn: a median one)",
                     fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms from the start of the step on the rank that started it first")
    fig.legend(handles=[Patch(color="0.75", label="forward"), Patch(color="tab:blue", label="backward operators"),
                        Patch(color="tab:red", label="in backward() or sync_gradients(), not computing"),
                        Patch(color="tab:green", label="optimizer step"),
                        Patch(color=BUCKET_COLOURS[0], label="all-reduce of bucket k (bk)")],
               loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for impl, marker, colour in (("hand", "o", "tab:blue"), ("ddp", "s", "tab:orange")):
        sweep = sorted((r for r in rows if r["impl"] == impl and r["bucket_mb"] == r["first_bucket_mb"]),
                       key=lambda r: r["bucket_mb"])
        caps = [r["bucket_mb"] for r in sweep]
        ax.plot(caps, [r["step_ms"] for r in sweep], marker + "-", color=colour, label=f"{impl}: step")
        ax.plot(caps, [r["exposed_ms"] for r in sweep], marker + "--", color=colour, mfc="white",
                label=f"{impl}: all-reduce time not under backward")
        bx.plot(caps, [100 * r["overlap"] for r in sweep], marker + "-", color=colour, label=impl)
        for r in sweep:
            bx.annotate(str(r["buckets"]), (r["bucket_mb"], 100 * r["overlap"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
    control = [r for r in rows if r["impl"] == "after_backward"]
    for r in control:
        ax.axhline(r["step_ms"], color="0.5", lw=1, ls=":", label="after backward (25 MiB): step")
        bx.axhline(100 * r["overlap"], color="0.5", lw=1, ls=":", label="after backward (25 MiB)")
    ax.set(xscale="log", xlabel="bucket cap (MiB; every bucket)", ylabel="ms per step (median)", ylim=(0, None),
           title="step time, and the all-reduce time left exposed")
    bx.set(xscale="log", xlabel="bucket cap (MiB; every bucket)", ylabel="% of all-reduce time under backward",
           title="overlap (numbers: buckets)", ylim=(-5, 105))
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    header = ["configuration", "buckets", "step ms", "backward ms", "all-reduce ms", "hidden ms", "exposed ms",
              "overlap", "1st all-reduce at"]
    table = [[r["name"], str(r["buckets"]), f"{r['step_ms']:.1f}", f"{r['backward_ms']:.1f}", f"{r['comm_ms']:.1f}",
              f"{r['hidden_ms']:.1f}", f"{r['exposed_ms']:.1f}", f"{r['overlap']:.0%}",
              f"{r['first_allreduce_ms']:.1f} ms"] for r in rows]
    widths = [max(len(x[c]) for x in [header, *table]) for c in range(len(header))]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="ddp_by_hand/overlap.py", description=summary(__doc__))
    p.add_argument("--hidden", type=positive(int), default=2048, help="width of the MLP's layers")
    p.add_argument("--layers", type=positive(int), default=6, help="square layers (each hidden^2 + hidden parameters)")
    p.add_argument("--batch-size", type=positive(int), default=64, help="samples per step per rank")
    p.add_argument("--bucket-mb", type=list_of(float), default=[0.001, 1, 4, 16, 25, 64, 1000],
                   help="the sweep's bucket caps in MiB (every bucket the same), e.g. 0.001 (one bucket per "
                        "parameter) to 1000 (one bucket)")
    p.add_argument("--world-size", type=positive(int), default=2)
    p.add_argument("--warmup", type=positive(int), default=2, help="steps before the profiled ones (at least 2: DDP "
                                                                    "rebuilds its buckets after its first step)")
    p.add_argument("--steps", type=positive(int), default=3, help="profiled steps per configuration and round")
    p.add_argument("--rounds", type=positive(int), default=2, help="turns of every configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=positive(float), default=120.0)
    p.add_argument("--out", type=Path, default=Path("runs/ddp_by_hand"))
    args = p.parse_args(argv)
    if args.warmup < 2:
        p.error("argument --warmup: at least 2 (DDP rebuilds its buckets after its first step)")
    p.check_out_writable(args.out)  # fail now, not after measuring

    configs = plan(args)
    params = sum(q.numel() for q in make_model(args).parameters())
    print(f"overlap: {args.world_size} ranks (gloo, 1 thread each), MLP {args.layers} x {args.hidden} + 16 classes "
          f"= {params:,} parameters ({params * 4 / 2**20:.1f} MiB of float32 gradients), batch {args.batch_size} "
          f"per rank; {len(configs)} configurations x {args.rounds} rounds x {args.steps} profiled steps", flush=True)
    args.port = free_port()
    with tempfile.TemporaryDirectory(prefix="ddp-overlap-") as tmp:
        mp.spawn(worker, args=(args.world_size, configs, args, tmp), nprocs=args.world_size)
        rows, timelines = summarise(configs, args, args.world_size, Path(tmp))
        traces = keep_traces(configs, args, args.world_size, Path(tmp))
    write_csv(args.out / "overlap.csv", rows, COLUMNS, floats=".4g")
    print()
    print_table(rows)
    plot_timeline(timelines, rows, args.out / "timeline.png")
    plot_sweep(rows, args.out / "sweep.png")
    print(f"\nwrote {args.out / 'overlap.csv'}, timeline.png, sweep.png and {', '.join(t.name for t in traces)} "
          f"(open a trace in https://ui.perfetto.dev)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
