"""Stage 11's GPT on the CPU: tokens/s with 1, 2 and 4 processes, DDP, FSDP2 and tensor parallelism.

    python benchmarks/gpt_scaling.py                 # every setting, 3 rounds: about 12 minutes on 2 cores
    python benchmarks/gpt_scaling.py --quick         # a tiny model, W = 1 and 2, one round: ~20 s

Each setting is 11_gpt/train.py launched as a reader launches it (python, or torchrun --standalone), with the same
model and the same batch per dp rank (16 windows of 128 characters: weak scaling, so W ranks process W times the
tokens of one). Its tokens/s is the median of the log intervals after the first (the first holds the warm-up),
as train.py measures them: the training steps alone, not the evaluations. The settings take turns, round after
round, and each setting's figure is the median over the rounds: this machine is shared, and a slow minute then
slows every setting alike.

    1 process, 1 thread    python, OMP_NUM_THREADS=1: the baseline, one core
    1 process, 2 threads   python, OMP_NUM_THREADS=2: torch's own intra-op threads on both cores
    DDP, W = 2             torchrun, 2 processes (torchrun gives each one thread)
    FSDP2, W = 2           --parallel fsdp
    FSDP2 + tp, 1 x 2      --parallel fsdp --tp 2: both processes on the same 16 windows, each half of every block
    DDP, W = 4             4 processes on 2 cores: oversubscribed, to show what that costs

efficiency = tokens/s / (cores x tokens/s of 1 process, 1 thread), where cores = processes x threads, at most the
machine's: what the setting could use. The runs read a copy of the corpus's first 250,000
characters (train.py --data): the held-out part they score at the end is 25,000 characters instead of 111,540,
which saves each launch seconds and changes nothing in a training step. Writes DIR/gpt_scaling.csv and .png.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, positive, write_csv  # noqa: E402
from tour import TORCHRUN, run_job  # noqa: E402

CORPUS = ROOT / "11_gpt" / "data" / "input.txt"
# (name, processes, threads per process, train.py's flags beyond the common ones)
SETTINGS = [("1 process, 1 thread", 1, 1, ()), ("1 process, 2 threads", 1, 2, ()), ("DDP, W = 2", 2, 1, ()),
            ("FSDP2, W = 2", 2, 1, ("--parallel", "fsdp")),
            ("FSDP2 + tp, dp 1 x tp 2", 2, 1, ("--parallel", "fsdp", "--tp", "2")), ("DDP, W = 4", 4, 1, ())]
QUICK = ["1 process, 1 thread", "DDP, W = 2"]
COLUMNS = ["setting", "processes", "threads", "cores", "dp", "tp", "parallel", "per_rank_batch", "global_batch",
           "tokens_per_step", "parameters", "tokens_per_s", "rounds", "efficiency", "peak_rss_mib_rank0",
           "model_state_mib_per_rank", "flops_per_token", "peak_gflops", "mfu"]


def command(processes: int, flags: tuple[str, ...], model: tuple[str, ...], args: argparse.Namespace,
            data: Path) -> list[str]:
    script = str(ROOT / "11_gpt" / "train.py")
    common = [*model, "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--eval-every",
              str(args.steps // 4), "--sample", "0", "--device", "cpu", "--data", str(data)]
    launcher = [sys.executable] if processes == 1 else [*TORCHRUN, "--standalone", f"--nproc_per_node={processes}"]
    return [*launcher, script, *common, *flags]


def measure(settings: list[tuple], args: argparse.Namespace, model: tuple[str, ...], data: Path) -> list[dict]:
    speeds: dict[str, list[float]] = {name: [] for name, *_ in settings}
    summaries: dict[str, dict] = {}
    for r in range(args.rounds):
        for name, processes, threads, flags in settings:
            out = args.out / "runs" / name.replace(" ", "_").replace(",", "").replace("+", "and")
            out.mkdir(parents=True, exist_ok=True)
            cmd = [*command(processes, flags, model, args, data), "--out", str(out)]
            # torchrun sets OMP_NUM_THREADS=1 for its workers; a plain python gets what the setting says.
            run = run_job([cmd], out, {"OMP_NUM_THREADS": str(threads)}, timeout=args.timeout)
            if run.returncode != 0 or run.survivors:
                raise SystemExit(f"{name} failed:\n{run.describe()}")
            s = run.summary
            later = [c[3] for c in s["curve"][1:]] or [s["tokens_per_s"]]  # after the first interval: no warm-up
            speeds[name].append(statistics.median(later))
            summaries[name] = s
            print(f"round {r + 1}/{args.rounds} | {name}: {speeds[name][-1]:,.0f} tokens/s "
                  f"({run.seconds:.0f} s with start-up and evaluation)", flush=True)
    rows = []
    for name, processes, threads, _ in settings:
        s = summaries[name]
        rows.append({"setting": name, "processes": processes, "threads": threads, "dp": s["dp"], "tp": s["tp"],
                     "parallel": s["parallel"], "per_rank_batch": s["batch_size"], "global_batch": s["global_batch"],
                     "tokens_per_step": s["global_batch"] * s["model"]["context"], "parameters": s["parameters"],
                     "tokens_per_s": statistics.median(speeds[name]), "rounds": " ".join(f"{v:.0f}" for v in
                                                                                        speeds[name]),
                     "peak_rss_mib_rank0": s["memory"]["peak"][0] / 2**20,
                     "model_state_mib_per_rank": s["memory"]["state"][0] / 2**20,
                     # train.py's MFU, of this table's tokens/s: over the matmul peak its ranks measured together
                     "flops_per_token": s["flops_per_token"], "peak_gflops": s["peak_flops"] / 1e9,
                     "mfu": statistics.median(speeds[name]) * s["flops_per_token"] / s["peak_flops"]})
    return with_efficiency(rows)


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Each row against 1 process of 1 thread (the first row) times the cores the setting can use."""
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["cores"] = min(r["processes"] * r["threads"], os.cpu_count() or 1)
        r["efficiency"] = r["tokens_per_s"] / (r["cores"] * base)
    return rows


def print_table(rows: list[dict]) -> None:
    header = ["setting", "W", "cores", "dp x tp", "global batch", "tokens/step", "tokens/s", "efficiency", "rounds",
              "peak GFLOP/s", "MFU", "state MiB/rank", "peak RSS MiB"]
    table = [[r["setting"], str(r["processes"]), str(r["cores"]), f"{r['dp']} x {r['tp']}", str(r["global_batch"]),
              f"{r['tokens_per_step']:,}", f"{r['tokens_per_s']:,.0f}", f"{r['efficiency']:.2f}", r["rounds"],
              f"{r['peak_gflops']:.1f}", f"{r['mfu']:.1%}", f"{r['model_state_mib_per_rank']:.1f}",
              f"{r['peak_rss_mib_rank0']:.0f}"] for r in rows]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.2))
    names = [r["setting"].replace(", ", ",\n") for r in rows]
    bars = ax.bar(range(len(rows)), [r["tokens_per_s"] for r in rows],
                  color=[f"C{min(r['processes'], 4) - 1}" for r in rows])
    ax.bar_label(bars, labels=[f"{r['tokens_per_s']:,.0f}\n(eff. {r['efficiency']:.2f})" for r in rows], fontsize=8)
    base = rows[0]["tokens_per_s"]
    ideal = sorted({r["cores"] for r in rows})
    for w in ideal:
        ax.axhline(w * base, color="grey", linewidth=1, linestyle=":")
        ax.text(len(rows) - 0.55, w * base, f"{w} core{'s' if w > 1 else ''} x 1 process, 1 thread", fontsize=8,
                va="bottom", ha="right", color="grey")
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    top = max(max(r["tokens_per_s"] for r in rows), ideal[-1] * base)
    ax.set(ylabel="tokens/s (training steps)", title=title, ylim=(0, 1.2 * top))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/gpt_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (2 blocks, width 64, context 64), W = 1 and 2, "
                                                        "12 steps, one round: checks the script, measures little")
    p.add_argument("--steps", type=positive(int), help="steps per run (default 40; --quick 12); logged in quarters")
    p.add_argument("--rounds", type=positive(int), help="runs of every setting, in turns (default 3; --quick 1)")
    p.add_argument("--batch-size", type=positive(int), default=16, help="windows per step per dp rank")
    p.add_argument("--out", type=Path, default=Path("runs/gpt_scaling"), help="where to write the CSV and PNG")
    p.add_argument("--timeout", type=positive(float), default=300.0, help="seconds one launch may take")
    args = p.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 40)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.steps < 4:
        p.error(f"argument --steps: at least 4 (the log, and so the measurement, comes in quarters), got {args.steps}")
    p.check_out_writable(args.out)  # fail now, not after measuring
    settings = [s for s in SETTINGS if s[0] in QUICK] if args.quick else SETTINGS
    model = ("--layers", "2", "--heads", "2", "--width", "64", "--context", "64") if args.quick else ()
    data = args.out / "input_250k.txt"
    data.write_text(CORPUS.read_text(encoding="utf-8")[:250_000], encoding="utf-8")

    import torch  # for the version alone: the runs are subprocesses
    cores = os.cpu_count() or 1
    print(f"GPT scaling: 11_gpt/train.py{' --quick: a tiny model' if args.quick else ''}, batch {args.batch_size} "
          f"per dp rank, {args.steps} steps, {args.rounds} round(s); {cores} CPU cores, gloo, "
          f"torch {torch.__version__}", flush=True)
    rows = measure(settings, args, model, data)
    print()
    print_table(rows)
    print(f"efficiency = tokens/s / (cores x tokens/s of 1 process, 1 thread), cores = processes x threads, at most "
          f"{cores}: W = 4 is oversubscribed. peak: the matmul FLOP/s the setting's ranks measured together "
          f"(train.py); MFU = tokens/s x FLOPs per token / peak. state: a rank's weights, gradients and AdamW moments.")
    write_csv(args.out / "gpt_scaling.csv", rows, COLUMNS)
    first = rows[0]
    context = first["tokens_per_step"] // first["global_batch"]
    plot(rows, args.out / "gpt_scaling.png", f"11_gpt ({first['parameters'] / 1e6:.2f} M parameters) on {cores} CPU "
                                             f"cores, gloo: batch {args.batch_size} x {context} per dp rank")
    print(f"\nwrote {args.out / 'gpt_scaling.csv'} and {args.out / 'gpt_scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
