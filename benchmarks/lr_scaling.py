"""The learning rate when the global batch grows with the number of ranks W: measured on this tutorial's model.

    python benchmarks/lr_scaling.py --out benchmarks        # W = 1, 2, 4, 8, 16; 5 and 20 epochs; 5 seeds (~1 min)
    python benchmarks/lr_scaling.py --worlds 1,2 --epochs 2 --seeds 1 --out runs/lr_scaling   # a quick look

W DDP ranks of batch b each compute stage 01's training at batch W*b (the tour checks it, epoch by epoch),
so this script runs stage 01's own code (model, data, sampler, Trainer, evaluate) at batch W*b, in one
process: the same numbers as W ranks, without starting them. For every W, epoch budget and seed it trains
twice: with the learning rate unchanged (--lr) and scaled linearly (--lr * W). The number of epochs is
fixed, so the number of steps falls as W grows: epochs * 4096 / (W*b). Writes DIR/lr_scaling.csv (one row
per run: the last epoch's mean train loss, the held-out loss and accuracy) and prints the table of means over
the seeds, in Markdown: the table on your_model/index.md.
"""
from __future__ import annotations

import contextlib
import io
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, list_of, positive, write_csv  # noqa: E402
from tour import load_stage  # noqa: E402

COLUMNS = ["epochs", "world_size", "batch_per_rank", "global_batch", "lr_rule", "lr", "seed", "steps", "train_loss",
           "eval_loss", "eval_accuracy"]
RULES = ("unchanged", "linear")


def train_once(s01, global_batch: int, lr: float, epochs: int, seed: int) -> dict:
    """Stage 01 at batch W*b: what W ranks of batch b compute. Returns its last epoch's loss and held-out metrics."""
    args = s01.parse_args(["--batch-size", str(global_batch), "--lr", str(lr), "--epochs", str(epochs),
                           "--seed", str(seed), "--device", "cpu"])
    device = torch.device("cpu")
    train_set, eval_set, model, optimizer = s01.load_train_objs(args, device)
    trainer = s01.Trainer(model, s01.prepare_dataloader(train_set, global_batch), optimizer, device, seed)
    with contextlib.redirect_stdout(io.StringIO()):  # its line per epoch
        trainer.train(epochs)
    loss_sum, correct, count = s01.evaluate(model, eval_set, device)
    return {"steps": trainer.steps, "train_loss": trainer.losses[-1], "eval_loss": loss_sum / count,
            "eval_accuracy": correct / count}


def measure(worlds: list[int], epoch_budgets: list[int], seeds: int, batch: int, lr: float) -> list[dict]:
    s01 = load_stage("01_single_gpu")
    rows, done = [], {}
    configs = [(e, w, rule) for e in epoch_budgets for w in worlds for rule in RULES]
    for i, (epochs, world, rule) in enumerate(configs, 1):
        run_lr = lr * world if rule == "linear" else lr
        for seed in range(seeds):
            key = (epochs, world, run_lr, seed)  # at W = 1 both rules are one run
            if key not in done:
                done[key] = train_once(s01, world * batch, run_lr, epochs, seed)
            rows.append({"epochs": epochs, "world_size": world, "batch_per_rank": batch, "global_batch": world * batch,
                         "lr_rule": rule, "lr": run_lr, "seed": seed, **done[key]})
        loss, accuracy = means(rows[-seeds:])
        print(f"[{i}/{len(configs)}] {epochs} epochs, W={world}, lr {run_lr:g} ({rule}): train loss {loss:.4f}, "
              f"held-out accuracy {accuracy:.2%} (mean of {seeds} seed(s))", flush=True)
    return rows


def means(rows: list[dict]) -> tuple[float, float]:
    """Mean train loss and mean held-out accuracy over the seeds."""
    return statistics.fmean(r["train_loss"] for r in rows), statistics.fmean(r["eval_accuracy"] for r in rows)


def table(rows: list[dict]) -> str:
    """The Markdown table of your_model/index.md: one line per (epochs, W), the two rules side by side."""
    lines = ["| epochs | W | global batch | steps | lr unchanged | train loss | held-out acc | lr × W | train loss "
             "| held-out acc |", "|---|---|---|---|---|---|---|---|---|---|"]
    for epochs, world in dict.fromkeys((r["epochs"], r["world_size"]) for r in rows):
        cells = []
        for rule in RULES:
            mine = [r for r in rows if (r["epochs"], r["world_size"], r["lr_rule"]) == (epochs, world, rule)]
            loss, accuracy = means(mine)
            cells.append(f"{mine[0]['lr']:g} | {loss:.4f} | {accuracy:.2%}")
        first = mine[0]
        lines.append(f"| {epochs} | {world} | {first['global_batch']} | {first['steps']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="benchmarks/lr_scaling.py", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=list_of(int), default=[1, 2, 4, 8, 16], help="numbers of ranks W")
    p.add_argument("--epochs", type=list_of(int), default=[5, 20], help="epoch budgets (fixed, whatever W)")
    p.add_argument("--seeds", type=positive(int), default=5, help="seeds 0..N-1: data, weights and order")
    p.add_argument("--batch-size", type=positive(int), default=32, help="samples per rank per step")
    p.add_argument("--lr", type=positive(float), default=0.05, help="the learning rate at W = 1")
    p.add_argument("--out", type=Path, default=Path("runs/lr_scaling"), help="where to write lr_scaling.csv")
    args = p.parse_args(argv)
    if bad := [w for w in args.worlds if 4096 % (w * args.batch_size)]:
        p.error(f"argument --worlds: W * --batch-size must divide the 4096 training samples (not for W = {bad})")
    p.check_out_writable(args.out)  # fail now, not after measuring
    torch.set_num_threads(1)  # one core, as each rank would have
    rows = measure(args.worlds, args.epochs, args.seeds, args.batch_size, args.lr)
    write_csv(args.out / "lr_scaling.csv", rows, COLUMNS, floats=None)
    print(f"\nmeans over {args.seeds} seed(s); per-rank batch {args.batch_size}; stage 01's model and data, float32\n")
    print(table(rows))
    print(f"\nwrote {args.out / 'lr_scaling.csv'}")


if __name__ == "__main__":
    main()
