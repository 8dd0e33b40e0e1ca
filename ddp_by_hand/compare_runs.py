"""Compare runs of naive.py, bucketed.py and stage 04 (torch's DDP): the training, the messages, the bits.

    python ddp_by_hand/compare_runs.py runs/hand_naive runs/hand_bucketed --ddp runs/04_2x32

For each run folder (a train script's --out): its epoch replay with stage 01's code (tour.replay_error: every
epoch it recorded, replayed and compared; tolerance sqrt(eps) of its dtype), the all-reduces it counted per step,
and whether its weights and every recorded epoch's state (weights and momentum) equal the DDP run's bit for bit.
Exit status 1 if a run does not replay within the tolerance.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
import tour  # noqa: E402
from tools.cli import ArgumentParser  # noqa: E402


def load(run: Path) -> tuple[dict, dict, list[dict]]:
    return (json.loads((run / "summary.json").read_text()),
            torch.load(run / "model.pt", map_location="cpu", weights_only=True),
            torch.load(run / "trajectory.pt", map_location="cpu", weights_only=True))


def identical(a: list[dict], b: list[dict]) -> bool:
    """Every recorded state (weights and momentum: None before the first step), bit for bit."""
    def tensors(states: list[dict]) -> list[torch.Tensor | None]:
        return [t for s in states for t in [*s["params"], *s["momentum"]]]
    return len(a) == len(b) and all(x is y is None or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(tensors(a), tensors(b), strict=True))


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="ddp_by_hand/compare_runs.py", description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="--out folders of naive.py or bucketed.py")
    p.add_argument("--ddp", type=Path, help="--out folder of stage 04 (torch's DDP) with the same settings")
    args = p.parse_args(argv)
    every = [*args.runs, *([args.ddp] if args.ddp else [])]
    missing = [str(r) for r in every if not (r / "summary.json").exists()]
    if missing:
        p.error(f"no summary.json in {', '.join(missing)}: give the --out folder of a finished run")
    ddp = load(args.ddp) if args.ddp else None
    rows = [["run", "stage", "W", "all-reduces/step", "bytes/step", "epoch replay vs 01", "final |Δw| vs DDP",
             "every epoch = DDP's, bit for bit"]]
    failed = False
    tols = {}  # each run's replay against its own dtype's sqrt(eps)
    for run in every:
        summary, model, trajectory = load(run)
        tols[summary["dtype"]] = tour.tolerance(summary["dtype"])
        replay = tour.replay_error(summary, trajectory)
        failed |= replay > tols[summary["dtype"]]
        counted = "allreduce_calls_per_step" in summary
        gap = f"{tour.max_abs_diff(ddp[1], model):.1e}" if ddp and run != args.ddp else "-"
        same = ("yes" if identical(trajectory, ddp[2]) else "no") if ddp and run != args.ddp else "-"
        rows.append([str(run), summary["stage"], str(summary["world_size"]),
                     f"{summary['allreduce_calls_per_step']:g}" if counted else "-",
                     f"{summary['allreduce_bytes_per_step']:,.0f}" if counted else "-", f"{replay:.1e}", gap, same])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
    said = f"= {tols.popitem()[1]:.1e}" if len(tols) == 1 else \
        "of each run's dtype: " + ", ".join(f"{d} {t:.1e}" for d, t in sorted(tols.items()))
    verdict = "a run FAILED it" if failed else "every run computed stage 01's training"
    print(f"\n(tolerance of the replay: sqrt(eps) {said}; {verdict})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
