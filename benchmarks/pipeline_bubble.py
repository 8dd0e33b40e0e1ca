"""The pipeline's bubble, measured: a timeline of every micro-batch's forward and backward on each stage, for GPipe
and 1F1B, and the idle fraction against (p - 1) / (m + p - 1).

Two clocks, because this machine has 2 cores:
- wall time, for p = 2 stages: two processes, a core each; the timestamps are measured (time.perf_counter, one
  clock for every process of a machine) around the compute of each forward and backward, while the stages really
  wait for each other. More than 2 stages would share the cores, and time-slicing would look like bubble.
- the schedule's own clock, for p = 2, 3, 4: the very schedule functions of 10_pipeline_parallel/by_hand.py give
  each stage its order of forwards and backwards; a step is then played out with a forward taking 1 slot and a
  backward 2 (a backward computes two gradients per layer), each waiting for its input from the neighbour. That
  clock has no cores to share: it is what p stages on p devices would do with perfectly even stages.

    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_bubble.py --out benchmarks/pipeline_bubble
    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_bubble.py --microbatches 1,4 --steps 2 --out runs/pb

Writes OUT.csv (one row per clock, p, schedule and m) and OUT.png (the timelines at the figure's m, and the bubble
against m), and prints the table. The model is deeper and wider than the stages' (--layers Linear layers of
--width), so that compute, not Python, fills the timeline.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, exit_worker, list_of, positive, read_csv, summary, write_csv  # noqa: E402


def by_hand():
    """10_pipeline_parallel/by_hand.py as a module: its Pipe and its two schedules."""
    spec = importlib.util.spec_from_file_location("pipeline_by_hand", ROOT / "10_pipeline_parallel" / "by_hand.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def theory(p: int, m: int) -> float:
    """The idle fraction of a pipeline of p even stages and m micro-batches: (p - 1) / (m + p - 1)."""
    return (p - 1) / (m + p - 1)


def held_at_peak(order: list[tuple[str, int]]) -> int:
    """The most micro-batches whose activations a stage holds at once, running `order` (held from F to B)."""
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def slot_clock(hand, schedule: str, p: int, m: int, forward: int = 1, backward: int = 2) -> dict:
    """Play one step of `schedule` on p stages: each action starts when its stage is free and its input has arrived
    (F of stage s after F of stage s-1, B of stage s after B of stage s+1). Returns the timelines and the bubble."""
    orders = [hand.SCHEDULES[schedule](m, stage, p) for stage in range(p)]  # by_hand's order for each stage
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> end slot
    free = [0.0] * p
    timelines: list[list[tuple[str, int, float, float]]] = [[] for _ in range(p)]
    position = [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, mb = orders[s][position[s]]
            needs = ("F", mb, s - 1) if kind == "F" and s > 0 else ("B", mb, s + 1) if kind == "B" and s < p - 1 \
                else ("F", mb, s) if kind == "B" else None  # the last stage's backward follows its own forward
            if needs is not None and needs not in done:
                continue
            start = max(free[s], done.get(needs, 0.0))
            end = start + (forward if kind == "F" else backward)
            done[(kind, mb, s)], free[s] = end, end
            timelines[s].append((kind, mb, start, end))
            position[s] += 1
            progressed = True
        assert progressed, f"{schedule} deadlocks with p={p}, m={m}"
    return {"timelines": timelines, "bubble": bubble(timelines), "peak_held": [held_at_peak(o) for o in orders]}


def bubble(timelines: list[list[tuple]]) -> float:
    """1 - (the stages' busy time) / (stages x the step's span): the fraction of the pipeline left idle."""
    start = min(t[2] for line in timelines for t in line)
    end = max(t[3] for line in timelines for t in line)
    busy = sum(t[3] - t[2] for line in timelines for t in line)
    return 1 - busy / (len(timelines) * (end - start))


def wall_clock(hand, args: argparse.Namespace, schedule: str, m: int) -> dict:
    """Run real steps on this process's stage (2 stages, 1 pipeline); return the last step's timelines, gathered."""
    stage, stages = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    blocks = [[nn.Linear(args.width, args.width), nn.ReLU()] for _ in range(args.layers - 1)]
    blocks.append([nn.Linear(args.width, args.width)])  # the last one's output is the loss's input
    mine = nn.Sequential(*[module for block in blocks[stage * args.layers // stages:(stage + 1) * args.layers // stages]
                           for module in block])
    mesh = init_device_mesh("cpu", (1, stages), mesh_dim_names=("dp", "pp"))
    loss_fn = hand.BatchMeanLoss()
    loss_fn.samples = m * args.microbatch_size
    pipe = hand.Pipe(mine, mesh, loss_fn)
    order = hand.SCHEDULES[schedule](m, stage, stages)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(m * args.microbatch_size, args.width, generator=g).tensor_split(m)
    ys = torch.randint(0, args.width, (m * args.microbatch_size,), generator=g).tensor_split(m)
    for _ in range(args.warmup + args.steps):
        pipe.timeline.clear()
        dist.barrier()  # every stage starts the step together
        pipe.run(order, xs, ys)
        mine.zero_grad(set_to_none=True)
    every: list = [None] * stages  # raw perf_counter stamps: one clock for every process of this machine
    dist.all_gather_object(every, pipe.timeline)
    since = min(start for line in every for _, _, start, _ in line)
    every = [[(kind, mb, start - since, end - since) for kind, mb, start, end in line] for line in every]
    return {"timelines": every, "bubble": bubble(every), "peak_held": pipe.peak_held}


def readme_table(csv_path: Path) -> str:
    """The rows of 10_pipeline_parallel/README.md's bubble table, from the CSV (a test checks the README has them)."""
    rows = read_csv(csv_path)

    def row(clock: str, p: int, schedule: str, m: int) -> dict | None:
        wanted = (clock, str(p), schedule, str(m))
        return next((r for r in rows if (r["clock"], r["p"], r["schedule"], r["m"]) == wanted), None)
    lines = []
    for m in sorted({int(r["m"]) for r in rows}):
        slots = " / ".join(f"{float(row('slots', p, 'gpipe', m)['bubble']):.1%}" for p in (2, 3, 4))
        one_f = row("slots", 4, "1f1b", m)
        held = (f"{row('slots', 4, 'gpipe', m)['peak_held'].replace(' ', ', ')} / "
                + (one_f["peak_held"].replace(" ", ", ") if one_f else "refused (m < p)"))
        lines.append(f"| {m} | {theory(2, m):.1%} | {float(row('wall', 2, 'gpipe', m)['bubble']):.1%} | "
                     f"{float(row('wall', 2, '1f1b', m)['bubble']):.1%} | {slots} | {held} |")
    return "\n".join(lines)


def figure(rows: list[dict], shown: dict, path: Path, m_shown: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(12, 8.5), gridspec_kw={"height_ratios": [1, 1, 1.4]})
    for col, schedule in enumerate(("gpipe", "1f1b")):
        for row, clock in enumerate(("wall", "slots")):
            ax = axes[row][col]
            run = shown[(clock, schedule)]
            for s, line in enumerate(run["timelines"]):
                for kind, mb, start, end in line:
                    ax.barh(s, end - start, left=start, color="tab:blue" if kind == "F" else "tab:orange",
                            edgecolor="black", linewidth=0.5)
                    ax.text((start + end) / 2, s, f"{kind}{mb}", ha="center", va="center", fontsize=7)
            unit = "ms" if clock == "wall" else "slots (F = 1, B = 2)"
            p = len(run["timelines"])
            ax.set_title(f"{schedule}, p = {p}, m = {m_shown}, {clock} clock: bubble {run['bubble']:.0%} "
                         f"(theory {theory(p, m_shown):.0%})", fontsize=9)
            ax.set_yticks(range(p), [f"stage {s}" for s in range(p)])
            ax.invert_yaxis()
            ax.set_xlabel(unit)
    for col, clock in enumerate(("wall", "slots")):
        ax = axes[2][col]
        ps = sorted({r["p"] for r in rows if r["clock"] == clock})
        for p in ps:
            ms = sorted({r["m"] for r in rows if r["clock"] == clock and r["p"] == p})
            ax.plot(ms, [theory(p, m) for m in ms], "k--", linewidth=0.8)
            for schedule, marker in (("gpipe", "o"), ("1f1b", "x")):
                mine = [r for r in rows if (r["clock"], r["p"], r["schedule"]) == (clock, p, schedule)]
                ax.plot([r["m"] for r in mine], [r["bubble"] for r in mine], marker, label=f"{schedule}, p = {p}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("micro-batches m")
        ax.set_ylabel("bubble (idle fraction)")
        ax.set_title(f"{clock} clock; dashed: (p - 1) / (m + p - 1)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = ArgumentParser(prog="benchmarks/pipeline_bubble.py", description=summary(__doc__))
    p.add_argument("--microbatches", type=list_of(int), default=[1, 2, 4, 8, 16], help="comma-separated m")
    p.add_argument("--microbatch-size", type=positive(int), default=128)
    p.add_argument("--width", type=positive(int), default=1024)
    p.add_argument("--layers", type=positive(int), default=8)
    p.add_argument("--steps", type=positive(int), default=3, help="measured steps per setting (the last one is kept)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps first (0 or more)")
    p.add_argument("--figure-m", type=positive(int), default=4, help="the m whose timelines the figure shows")
    p.add_argument("--out", type=Path, required=True, help="write OUT.csv and OUT.png")
    args = p.parse_args()
    ms = args.microbatches
    if args.warmup < 0:
        p.error(f"argument --warmup: must be 0 or more, got {args.warmup}")
    if "RANK" not in os.environ or int(os.environ["WORLD_SIZE"]) != 2:
        p.error("run it with torchrun --standalone --nproc_per_node=2 (two stages: one core each)")
    if args.layers < 2:  # (10's by_hand.py splits the layers between the two stages: each needs one)
        p.error(f"argument --layers: 2 stages need a layer each, got {args.layers}; use --layers 2 or more")
    if args.figure_m not in ms:
        p.error(f"argument --figure-m: {args.figure_m} is not one of --microbatches {','.join(map(str, ms))}")
    p.check_out_writable(args.out.parent)  # fail now, not after measuring
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    hand = by_hand()
    rows, shown = [], {}
    for m in ms:
        for schedule in ("gpipe", "1f1b"):
            run = wall_clock(hand, args, schedule, m)
            held = [0] * 2
            dist.all_gather_object(held, run["peak_held"])
            rows.append({"clock": "wall", "p": 2, "schedule": schedule, "m": m, "bubble": run["bubble"],
                         "theory": theory(2, m), "peak_held": held})
            if m == args.figure_m:
                shown[("wall", schedule)] = {**run, "timelines": [[(k, mb, s * 1e3, e * 1e3) for k, mb, s, e in line]
                                                                  for line in run["timelines"]]}
    if dist.get_rank() == 0:
        for stages in (2, 3, 4):
            for m in ms:
                for schedule in ("gpipe", "1f1b"):
                    if schedule == "1f1b" and m < stages:
                        continue  # refused by the stage (its warm-up would never end): not a setting to measure
                    run = slot_clock(hand, schedule, stages, m)
                    rows.append({"clock": "slots", "p": stages, "schedule": schedule, "m": m,
                                 "bubble": run["bubble"], "theory": theory(stages, m), "peak_held": run["peak_held"]})
                    if (stages, m) == (2, args.figure_m):
                        shown[("slots", schedule)] = run
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_csv(args.out.with_suffix(".csv"), ({**r, "peak_held": " ".join(map(str, r["peak_held"]))} for r in rows),
                  list(rows[0]), floats=".4f")
        print(f"{'clock':<6} {'p':>2} {'schedule':<8} {'m':>3} {'bubble':>7} {'theory':>7}  activations held at peak, "
              f"per stage (micro-batches)")
        for r in rows:
            print(f"{r['clock']:<6} {r['p']:>2} {r['schedule']:<8} {r['m']:>3} {r['bubble']:>7.1%} "
                  f"{r['theory']:>7.1%}  {' '.join(map(str, r['peak_held']))}")
        figure(rows, shown, args.out.with_suffix(".png"), args.figure_m)
        print(f"wrote {args.out.with_suffix('.csv')} and {args.out.with_suffix('.png')}")
    dist.destroy_process_group()
    exit_worker()  # rank 1 ends right after a collective: a plain exit can abort in gloo's thread


if __name__ == "__main__":
    main()
