"""Stage 14's mixture of experts trained, measured: what the balancing loss does to the experts' load, and the mixture
against stage 13's dense GPT at the same active parameters, the same wall time and the same steps.

    python benchmarks/moe_quality.py               # 15 runs one after another, one thread each: ~15 minutes on 2 cores
    python benchmarks/moe_quality.py --quick       # the same runs on a tiny model, 20 steps, one seed: ~1 minute

Each run is `python STAGE/train.py ... --sample 0 --out DIR` with OMP_NUM_THREADS=1, one at a time (their times are
compared: run it on an otherwise idle machine). From each run's summary.json:

- moe_balance.csv, two runs of the default mixture (4 blocks, 4 experts a block, each token to 2) for 200 steps,
  with the balancing loss (--aux-weight 0.01) and without (0): per step and block, the busiest expert's tokens over
  the even share (2.0 is the most a token's two different choices allow), its mean over the first 10 steps and over
  the last 50 (and the worst of those), the last block's share per expert over the last 50 steps, the balancing loss
  of the last step, and the held-out loss.
- moe_dense.csv, the default batch (16 windows of 64 characters a step): stage 13's dense GPT for its default 800
  steps, seeds 0, 1 and 2; the mixture with --top-k 1 (a token's active parameters are the dense model's, plus the
  router's) and with --top-k 2, each for as many steps as fit in the dense runs' mean time (its pace timed first on a
  probe run of PROBE_STEPS, then thrown away), seeds 0, 1 and 2; and both mixtures for 800 steps (seed 0). The
  held-out loss is over all 111,539 held-out characters; the seconds are the training steps' (train_seconds).

The two tables of 14_experts/README.md are readme_tables() of the committed CSVs, benchmarks/moe_balance.csv and
benchmarks/moe_dense.csv (tests/test_experts.py checks that they are).
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, positive, print_table, read_csv, summary, write_csv  # noqa: E402
from tour import load_stage, run_job  # noqa: E402

TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24")
PROBE_STEPS = 60  # a mixture's pace is timed over this many steps (its first step's set-up among them)
BALANCE_COLUMNS = ["aux_weight", "steps", "busiest_first", "busiest_last", "busiest_last_worst", "last_block_shares",
                   "aux_loss_last", "eval_loss"]
DENSE_COLUMNS = ["model", "top_k", "budget", "seed", "steps", "parameters", "active", "train_seconds", "eval_loss"]


def train(stage: str, flags: list[str], out: Path, timeout: float) -> dict:
    """One run of `stage` in one process and one thread; its summary.json."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / stage / "train.py"), *flags, "--sample", "0", "--out", str(out)]
    run = run_job([cmd], env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    if run.returncode != 0:
        raise SystemExit(f"moe_quality: {' '.join(cmd)} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    return json.loads((out / "summary.json").read_text())


def busiest(load: list[list[list[float]]], steps: range) -> tuple[float, float]:
    """The busiest expert's tokens over the even share, per step and block: the mean and the worst over `steps`."""
    ratios = [max(block) / (sum(block) / len(block)) for step in steps for block in load[step]]
    return statistics.fmean(ratios), max(ratios)


def balance_row(summary: dict, first: int, last: int) -> dict:
    experts = summary["experts"]
    load, steps = experts["load"], len(experts["load"])
    tail = range(steps - last, steps)
    shares = [sum(load[s][-1][e] for s in tail) for e in range(len(load[0][-1]))]
    return {"aux_weight": experts["aux_weight"], "steps": steps, "busiest_first": busiest(load, range(first))[0],
            "busiest_last": busiest(load, tail)[0], "busiest_last_worst": busiest(load, tail)[1],
            "last_block_shares": " ".join(f"{s / sum(shares):.4f}" for s in shares),
            "aux_loss_last": experts["aux_losses"][-1], "eval_loss": summary["eval_loss"]}


@functools.cache
def experts_stage():
    """Stage 14's train.py and its files, imported once (load_stage imports them afresh at every call)."""
    return load_stage("14_experts")


def dense_row(summary: dict, model: str, top_k: int, seed: int) -> dict:
    """A run's row; its active parameters counted by stage 14's own `parameters` (k of the E experts' weights)."""
    active = summary["parameters"]
    if "experts" in summary["model"]:
        stage = experts_stage()
        active = stage.parameters(stage.Config(**summary["model"]))[1]
    return {"model": model, "top_k": top_k, "seed": seed, "steps": summary["steps"],
            "parameters": summary["parameters"], "active": active, "train_seconds": summary["train_seconds"],
            "eval_loss": summary["eval_loss"]}


def run_dense_or_moe(model: str, k: int, steps: int, seed: int, budget: str, shape: list[str], args) -> dict:
    """One run of stage 13's dense GPT (k 0) or of the mixture at top-k k; its row."""
    flags = [*shape, "--max-steps", str(steps), "--eval-every", str(max(1, steps // 4)), "--seed", str(seed)]
    stage = "13_pipeline_4d" if model == "dense" else "14_experts"
    summary = train(stage, flags + (["--top-k", str(k)] if k else []), args.out / f"{model}_k{k}_{steps}_{seed}",
                    args.timeout)
    print(f"{stage} top-k {k or '-'} seed {seed}: {steps} steps in {summary['train_seconds']:.1f}s, held-out "
          f"{summary['eval_loss']:.4f}", flush=True)
    return {**dense_row(summary, model, k, seed), "budget": budget}


def readme_tables(balance_csv: Path, dense_csv: Path) -> tuple[str, str]:
    """The rows of 14_experts/README.md's two tables, from the CSVs."""
    balance = []
    for r in read_csv(balance_csv):
        shares = ", ".join(f"{float(s):.0%}" for s in r["last_block_shares"].split())
        weight = float(r["aux_weight"])
        balance.append(f"| {weight:g}{' (the default)' if weight == 0.01 else ''} | {float(r['busiest_first']):.2f} | "
                       f"{float(r['busiest_last']):.2f} ({float(r['busiest_last_worst']):.2f}) | {shares} | "
                       f"{float(r['aux_loss_last']):.3f} | {float(r['eval_loss']):.4f} |")
    rows = read_csv(dense_csv)
    dense = []
    for key in dict.fromkeys((r["model"], r["top_k"], r["budget"], r["steps"]) for r in rows):
        runs = [r for r in rows if (r["model"], r["top_k"], r["budget"], r["steps"]) == key]
        model, top_k, budget, steps = key
        name = "stage 13, dense" if model == "dense" else f"14, E 4, k {top_k}: {budget}"
        dense.append(f"| {name} | {int(runs[0]['parameters']):,} ({int(runs[0]['active']):,}) | {steps} | "
                     + ", ".join(f"{float(r['train_seconds']):.1f}" for r in runs) + " | "
                     + ", ".join(f"{float(r['eval_loss']):.4f}" for r in runs) + " |")
    return "\n".join(balance), "\n".join(dense)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/moe_quality.py", description=summary(__doc__))
    p.add_argument("--quick", action="store_true",
                   help="a tiny model (2 blocks, width 32, context 24), 20 steps a run, one seed")
    p.add_argument("--out", type=Path, default=Path("runs/moe_quality"), help="where to write the CSVs and the runs")
    p.add_argument("--timeout", type=positive(float), default=1800.0, help="seconds one run may take")
    args = p.parse_args(argv)
    p.check_out_writable(args.out)  # fail now, not after a quarter of an hour
    shape = list(TINY) if args.quick else []
    length = 20 if args.quick else 200
    balance = [balance_row(train("14_experts", [*shape, "--max-steps", str(length), "--eval-every", str(length // 4),
                                                "--aux-weight", str(w)], args.out / f"balance_{w}", args.timeout),
                           first=10, last=length // 4)
               for w in (0.01, 0.0)]
    write_csv(args.out / "moe_balance.csv", balance, BALANCE_COLUMNS)
    seeds = [0] if args.quick else [0, 1, 2]
    full = length if args.quick else 800
    dense = [run_dense_or_moe("dense", 0, full, seed, "same steps", shape, args) for seed in seeds]
    budget = statistics.fmean(r["train_seconds"] for r in dense)  # the dense model's time: the mixtures' budget
    for k in (1, 2):
        # Its pace from a probe run (its own steps, after which it is thrown away): the steps that fit in the budget.
        probe = train("14_experts", [*shape, "--top-k", str(k), "--max-steps", str(PROBE_STEPS), "--eval-every",
                                     str(PROBE_STEPS)], args.out / f"probe_k{k}", args.timeout)
        steps = round(budget / (probe["train_seconds"] / PROBE_STEPS))
        dense += [run_dense_or_moe("moe", k, steps, seed, "same time", shape, args) for seed in seeds]
    if not args.quick:
        dense += [run_dense_or_moe("moe", k, full, 0, "same steps", shape, args) for k in (1, 2)]
    write_csv(args.out / "moe_dense.csv", dense, DENSE_COLUMNS)
    for rows, columns in ((balance, BALANCE_COLUMNS), (dense, DENSE_COLUMNS)):
        print_table([columns] + [[f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in columns]
                                 for r in rows])
    print(f"wrote {args.out / 'moe_balance.csv'} and {args.out / 'moe_dense.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
