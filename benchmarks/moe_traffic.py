"""Stage 14's all-to-all, measured: the bytes each rank sends and receives per training step, against the formula.

    python benchmarks/moe_traffic.py                 # the default model at ep 2 and 4: about 1 minute on 2 cores
    python benchmarks/moe_traffic.py --quick         # a tiny model at ep 2: ~25 s

Each setting is 14_experts/train.py launched by torchrun as a reader launches it, with its experts module's calls to
torch.distributed counted from outside (tools.cli.SentBytes stands in for it: the stage carries no hook). Per rank and
optimizer step it counts the bytes of the rows that leave for another rank and of those that arrive from one (a rank's
rows for its own experts do not travel), and the bytes of the counts exchanged before them. The first step is left
out (under --pp torch's schedule runs an extra forward in it), and so is the held-out scoring after the last.

The formula, per rank and step, when every expert gets its even share: a rank routes n tokens (its windows x context),
each to k experts, in each of its L blocks; of those n k rows, (ep - 1) / ep go to other ranks' experts; they travel
four times (to the experts and back in the forward, the same in the backward), width numbers of `bytes` each:

    4 x n x k x L x (ep - 1) / ep x width x bytes

Where every token goes to every expert (k = E) each expert has its even share by construction, and the measurement must
equal the formula to the byte. Otherwise the router decides. A rank sends its rows for the others' experts and sends
back the outputs of the rows it received: the rank of the busiest experts sends and receives the most, and sets the
step's pace, while the mean over the ranks stays near the formula as long as every rank's tokens choose alike. The
counts: E numbers (int64) a block and micro-batch, (ep - 1) / ep of them sent. Writes DIR/moe_traffic.csv; the table
in 14_experts/README.md is readme_table(benchmarks/moe_traffic.csv), the default run's.
"""
from __future__ import annotations

import argparse
import json
import runpy
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, SentBytes, off_rank_bytes, positive, print_table, read_csv, write_csv  # noqa: E402
from tour import TORCHRUN, run_job  # noqa: E402

STAGE = ROOT / "14_experts"
# (ep, experts E, top-k k): the default mixture at ep 2 and 4, and every token to every expert (exact by construction)
SETTINGS = [(2, 4, 2), (4, 4, 2), (2, 8, 2), (2, 4, 4), (4, 4, 4)]
QUICK = [(2, 4, 2), (2, 4, 4)]
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24")
WINDOWS = 16  # the global batch of each setting: WINDOWS / ep windows per rank
BYTES = {"float32": 4, "float64": 8}
COLUMNS = ["ep", "experts", "top_k", "layers", "width", "tokens_per_rank", "steps", "formula_bytes",
           "sent_mean_bytes", "sent_max_bytes", "received_max_bytes", "sent_mean_ratio", "received_max_ratio",
           "counts_formula_bytes", "counts_sent_bytes"]


class Traffic(SentBytes):
    """SentBytes, its all-to-alls also kept per optimizer step: (rows sent, rows received, counts sent) in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0  # optimizer steps done: the step a call belongs to
        self.per_step: dict[int, list[int]] = {}

    def all_to_all_single(self, out, x, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        before = self.sent
        result = super().all_to_all_single(out, x, output_split_sizes, input_split_sizes, group, **kwargs)
        tally = self.per_step.setdefault(self.steps, [0, 0, 0])
        if x.is_floating_point():  # the rows (or their gradients)
            tally[0] += self.sent - before
            tally[1] += off_rank_bytes(out, output_split_sizes, self.dist.get_rank(group),
                                       self.dist.get_world_size(group))
        else:  # the counts per expert
            tally[2] += self.sent - before
        return result


def count(out: Path, script: Path, flags: list[str]) -> None:
    """Inside torchrun: run `script` as its __main__, its experts module's collectives counted; at the end (when it
    destroys its process group) rank r writes out/rank<r>.json, {step: [rows sent, rows received, counts sent]}."""
    import torch.distributed as dist
    from torch.optim.optimizer import register_optimizer_step_post_hook

    sys.path.insert(0, str(script.parent))  # as `python script` would: the stage imports its own files
    import experts  # the stage's experts.py (the same module its train.py then imports)

    experts.dist = traffic = Traffic()
    register_optimizer_step_post_hook(lambda *_: setattr(traffic, "steps", traffic.steps + 1))
    destroy = dist.destroy_process_group

    def report_and_destroy(*args, **kwargs):
        Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(traffic.per_step))
        return destroy(*args, **kwargs)

    dist.destroy_process_group = report_and_destroy
    sys.argv = [str(script), *flags]
    runpy.run_path(str(script), run_name="__main__")


def measure(setting: tuple[int, int, int], args: argparse.Namespace) -> dict:
    ep, experts, top_k = setting
    out = args.out / "runs" / f"ep{ep}_E{experts}_k{top_k}"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    model = dict(zip(TINY[::2], TINY[1::2], strict=True)) if args.quick else {}
    layers, width, context = (int(model.get(f, d)) for f, d in (("--layers", 4), ("--width", 128),
                                                                 ("--context", 64)))
    flags = [*(TINY if args.quick else ()), "--ep", str(ep), "--experts", str(experts), "--top-k", str(top_k),
             "--batch-size", str(WINDOWS // ep), "--max-steps", str(args.steps), "--eval-every", str(args.steps),
             "--sample", "0", "--device", "cpu", "--dtype", args.dtype]
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={ep}", __file__, "--count", str(out),
           str(STAGE / "train.py"), *flags]
    run = run_job([cmd], out, timeout=args.timeout)
    if run.returncode != 0 or run.survivors:
        raise SystemExit(f"ep {ep}, E {experts}, k {top_k} failed:\n{run.describe()}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ep)]
    steps = [str(s) for s in range(1, args.steps)]  # the second step onwards (their keys: optimizer steps done)
    tokens = WINDOWS // ep * context
    formula = 4 * tokens * top_k * layers * (ep - 1) / ep * width * BYTES[args.dtype]
    row = {"ep": ep, "experts": experts, "top_k": top_k, "layers": layers, "width": width, "tokens_per_rank": tokens,
           "steps": len(steps), "formula_bytes": formula,
           "sent_mean_bytes": statistics.mean(statistics.mean(r[s][0] for r in ranks) for s in steps),
           "sent_max_bytes": statistics.mean(max(r[s][0] for r in ranks) for s in steps),
           "received_max_bytes": statistics.mean(max(r[s][1] for r in ranks) for s in steps),
           "counts_formula_bytes": layers * experts * (ep - 1) // ep * 8,
           "counts_sent_bytes": statistics.mean(statistics.mean(r[s][2] for r in ranks) for s in steps)}
    row["sent_mean_ratio"] = row["sent_mean_bytes"] / formula
    row["received_max_ratio"] = row["received_max_bytes"] / formula
    return row


def print_rows(rows: list[dict]) -> None:
    mb = 1e6
    print_table([["ep", "E", "k", "tokens/rank", "formula MB", "sent MB (mean, max)", "received MB (max)",
                  "mean sent / formula", "max received / formula", "counts B (formula, sent)"],
                 *[[str(r["ep"]), str(r["experts"]), str(r["top_k"]), str(r["tokens_per_rank"]),
                    f"{r['formula_bytes'] / mb:.3f}",
                    f"{r['sent_mean_bytes'] / mb:.3f}, {r['sent_max_bytes'] / mb:.3f}",
                    f"{r['received_max_bytes'] / mb:.3f}", f"{r['sent_mean_ratio']:.3f}",
                    f"{r['received_max_ratio']:.3f}", f"{r['counts_formula_bytes']}, {r['counts_sent_bytes']:g}"]
                   for r in rows]])


def readme_table(csv_path: Path) -> str:
    """The rows of 14_experts/README.md's traffic table, from the CSV (a test checks the README has them)."""
    lines = []
    for r in read_csv(csv_path):
        f = {k: float(v) for k, v in r.items()}
        every = " (every expert)" if r["top_k"] == r["experts"] else ""
        lines.append(f"| {r['ep']} | {r['experts']} | {r['top_k']}{every} | {f['formula_bytes'] / 1e6:.3f} | "
                     f"{f['sent_mean_bytes'] / 1e6:.3f} ({f['sent_mean_ratio']:.3f}) | "
                     f"{f['received_max_bytes'] / 1e6:.3f} ({f['received_max_ratio']:.3f}) | "
                     f"{f['counts_sent_bytes']:g} of {f['counts_formula_bytes']:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/moe_traffic.py", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny model (2 blocks, width 32, context 24) at ep 2 only")
    p.add_argument("--steps", type=positive(int), help="optimizer steps per run, the first left out (default 6; "
                                                       "--quick 3)")
    p.add_argument("--dtype", choices=list(BYTES), default="float32", help="the stage's --dtype (the rows' bytes)")
    p.add_argument("--out", type=Path, default=Path("runs/moe_traffic"), help="where to write the CSV")
    p.add_argument("--timeout", type=positive(float), default=300.0, help="seconds one launch may take")
    p.add_argument("--count", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # measure(): this process is a rank
    args = p.parse_args(argv)
    if args.count:  # OUT SCRIPT FLAGS...
        count(Path(args.count[0]), Path(args.count[1]), args.count[2:])
        return 0
    args.steps = args.steps or (3 if args.quick else 6)
    if args.steps < 2:
        p.error(f"argument --steps: at least 2 (the first step is left out), got {args.steps}")
    p.check_out_writable(args.out)  # fail now, not after measuring
    import torch  # for the version alone: the runs are subprocesses
    print(f"MoE traffic: 14_experts/train.py{' --quick: a tiny model' if args.quick else ''}, {WINDOWS} windows a step "
          f"over the ep ranks, {args.dtype}, steps 2 to {args.steps}; torch {torch.__version__}", flush=True)
    rows = []
    for setting in QUICK if args.quick else SETTINGS:
        rows.append(measure(setting, args))
        print(f"ep {setting[0]}, E {setting[1]}, k {setting[2]}: {rows[-1]['sent_mean_ratio']:.3f} x the formula",
              flush=True)
    print()
    print_rows(rows)
    print("per rank and training step; sent: rows to other ranks' experts and back, forward and backward; "
          "formula = 4 x tokens x k x blocks x (ep - 1) / ep x width x bytes (every expert its even share)")
    write_csv(args.out / "moe_traffic.csv", rows, COLUMNS, floats=".10g")
    print(f"\nwrote {args.out / 'moe_traffic.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
