"""Draw a stage 11 run's loss curves over the corpus's baselines, from the summary.json its --out wrote.

    python 11_gpt/plot_loss.py runs/11_gpt                  # writes runs/11_gpt/loss.png
    python 11_gpt/plot_loss.py runs/a runs/b --out both.png  # several runs on one figure

The training loss of every step (thin) and its mean over 20 steps, the held-out estimate at each log line
(16 fixed held-out windows), the final held-out loss over the whole held-out text (a dot), and the three baselines
train.py computed from the text: uniform, unigram and bigram.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def plot(runs: list[Path], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.6))
    summaries = [json.loads((run / "summary.json").read_text()) for run in runs]
    for i, (run, s) in enumerate(zip(runs, summaries, strict=True)):
        label = f"{run.name}: {s['world_size']} process{'es' if s['world_size'] > 1 else ''}, {s['parallel']}" + \
            (f", tp {s['tp']}" if s["tp"] > 1 else "")
        losses, k = s["losses"], 20
        ax.plot(range(1, len(losses) + 1), losses, color=f"C{i}", alpha=0.25, linewidth=0.8)
        mean = [sum(losses[j - k:j]) / k for j in range(k, len(losses) + 1)]  # of the last k steps
        ax.plot(range(k, len(losses) + 1), mean, "-", color=f"C{i}", label=f"{label}: training loss ({k}-step mean)")
        curve = s["curve"]
        ax.plot([c[0] for c in curve], [c[2] for c in curve], "o--", color=f"C{i}", markersize=3,
                label="held-out (16 windows)")
        ax.plot([s["steps"]], [s["eval_loss"]], "D", color=f"C{i}", markersize=8,
                label=f"held-out, all {s['eval_count']:,} characters: {s['eval_loss']:.3f}")
    for (name, value), style in zip(summaries[0]["baselines"].items(), (":", "-.", "--"), strict=True):
        ax.axhline(value, color="0.4", linestyle=style, linewidth=1)
        ax.text(1, value, f" {name} {value:.2f}", va="bottom", fontsize=8, color="0.3")
    s = summaries[0]
    tokens = s["global_batch"] * s["model"]["context"]
    ax.set(xlabel=f"step ({tokens:,} tokens each)", ylabel="loss, nats per character",
           title=f"11_gpt: {s['parameters'] / 1e6:.2f} M parameters on tiny Shakespeare ({s['dtype']}, "
                 f"{s['device']})", ylim=(min(1.0, min(x['eval_loss'] for x in summaries) - 0.2),
                                           s["baselines"]["uniform"] + 0.3))
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="11_gpt/plot_loss.py", description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="--out directories of train.py runs")
    p.add_argument("--out", type=Path, help="the PNG to write (default: loss.png in the first run's directory)")
    args = p.parse_args(argv)
    missing = [str(r) for r in args.runs if not (r / "summary.json").is_file()]
    if missing:
        p.exit(2, f"{p.prog}: error: no summary.json in {', '.join(missing)}: give the --out of a train.py run\n")
    out = args.out or args.runs[0] / "loss.png"
    plot(args.runs, out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
