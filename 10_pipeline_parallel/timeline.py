"""A pipeline step's timeline, from the events schedules.py recorded: the idle time of each rank, the bubble beside
its formula, and the picture (one row per rank, a box per computation).

An event is (rank, stage, micro-batch, kind, start, end, sent): kind F, B or W, seconds since the step's first
computation on any rank (perf_counter is one clock for every process of a machine), `sent` when what it made had
left the rank (None if it made nothing to send).

    python 10_pipeline_parallel/timeline.py runs/10_schedules/schedules.json --m 4 --out timelines.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

COLOURS = {"F": "tab:blue", "B": "tab:orange", "W": "tab:green"}


def formula(schedule: str, p: int, m: int, v: int = 1) -> float:
    """The bubble of p even stages per rank: (p - 1) / (m + p - 1); interleaved, (p - 1) / (v * m + p - 1); ZB-H1 with
    F, B and W equally long, (p - 1) / (3m + p - 1) (its bubble time is (p - 1)(F + B - W) against 1F1B's
    (p - 1)(F + B + W))."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zbh1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


def idle(events: list, p: int) -> list[float]:
    """Seconds each rank computed nothing between the step's first start and its last end (on any rank)."""
    start, end = min(e[4] for e in events), max(e[5] for e in events)
    return [end - start - sum(e[5] - e[4] for e in events if e[0] == r) for r in range(p)]


def bubble(events: list, p: int) -> float:
    """The fraction of the ranks' time over the step spent idle."""
    span = max(e[5] for e in events) - min(e[4] for e in events)
    return sum(idle(events, p)) / (p * span)


def readme_table(path: Path) -> str:
    """The rows of 10_pipeline_parallel/README.md's table, from a recorded schedules.json (a test checks they are
    there): each run's measured bubble beside the formula, the step's length, each rank's idle time, and the
    activations held."""
    rows = []
    for run in json.loads(path.read_text()):
        p, m, v = run["p"], run["m"], run["v"]
        rows.append(f"| {run['schedule']} | {p} | {v} | {m} | {bubble(run['events'], p):.1%} | "
                    f"{formula(run['schedule'], p, m, v):.1%} | {max(e[5] for e in run['events']) * 1e3:,.0f} | "
                    f"{' / '.join(f'{t * 1e3:.0f}' for t in idle(run['events'], p))} | "
                    f"{', '.join(map(str, run['peak_held']))} |")
    return "\n".join(rows)


def draw(runs: list[dict], path: Path | None = None):
    """One panel per run, one row per rank: each computation a box at its measured start and end, labelled with
    its micro-batch (and its stage where a rank holds several). Saved to `path` if given; the figure is returned."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.1 + 0.55 * sum(r["p"] for r in runs)), squeeze=False,
                             sharex=True)
    for ax, run in zip(axes[:, 0], runs, strict=True):
        p, v = run["p"], run["v"]
        for rank, stage, mb, kind, start, end, _ in run["events"]:
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, color=COLOURS[kind], edgecolor="black",
                    linewidth=0.4, hatch="//" if v > 1 and stage >= p else None)
            ax.text((start + end) / 2 * 1e3, rank, f"{mb}" if v == 1 else f"{mb}\ns{stage}", ha="center",
                    va="center", fontsize=6)
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
        ax.invert_yaxis()
        ax.set_title(f"{run['schedule']}, p = {p}" + (f", v = {v}" if v > 1 else "") + f", m = {run['m']}: bubble "
                     f"{bubble(run['events'], p):.0%} measured, {formula(run['schedule'], p, run['m'], v):.0%} by "
                     f"the formula; held at peak {', '.join(map(str, run['peak_held']))}", fontsize=9)
    axes[-1, 0].set_xlabel("ms since the step's first computation (blue F, orange B, green W; hatched: a rank's "
                           "second stage)")
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("runs", type=Path, help="schedules.json, written by schedules.py --out")
    parser.add_argument("--m", type=int, help="draw the runs with this many micro-batches (default: the first)")
    parser.add_argument("--out", type=Path, required=True, help="the picture (.png)")
    args = parser.parse_args()
    runs = json.loads(args.runs.read_text())
    m = args.m if args.m is not None else runs[0]["m"]
    draw([r for r in runs if r["m"] == m], args.out)


if __name__ == "__main__":
    main()
