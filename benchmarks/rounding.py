"""Rounding: why the stages agree to ~1e-6 and not bit for bit, and why an epoch replay is the right check.

    python benchmarks/rounding.py                    # 60 epochs, float32 and float64, lr 0.05 and 0.01 (~1-2 min)
    python benchmarks/rounding.py --epochs 3 --no-check --out runs/rounding   # a quick look

Stage 01 trains with batch W*b; the DDP stages with W processes of batch b each. DDP's gradient is the
average of the W per-rank mean gradients, stage 01's the mean over the whole batch: the same number
in exact arithmetic, rounded differently in floats. This script reproduces both in ONE process, step
by step (W = 2): for each global batch `idx` of stage 01 (positions 64k..64k+63 of epoch e's
permutation torch.randperm(N, seed + e)), rank r's micro-batch is idx[r::W], as DistributedSampler
hands it out; each rank's mean-loss gradient is computed on its own and p.grad = sum(g_r / W), which
is what DDP's reducer computes (each rank's gradient times 1/W into the bucket, then a summing
all-reduce; bit for bit the same for W = 2). It measures

    max|dw|        the largest weight difference between the two runs after every step
    epoch replay   for every epoch e: stage 01's own Trainer restarts from the DDP run's weights and
                   momentum before epoch e, trains epoch e, and is compared with the DDP run after it
                   (tour.replay_error: the tour's check); also for two broken DDP runs, which must fail
    indicators     at the end of every epoch, on the 4096 training samples: how many ReLU units are on
                   in one run and off in the other, the largest |logit|, the training loss

and, once, runs the real stage 04 under torchrun and stage 01 (5 epochs, float32 and float64) and
compares their recorded states with the simulation's. Writes DIR/rounding.csv, one row per run and
epoch: max|dw| at the epoch's end and its largest value during the epoch, the replay error, stage
01's mean training loss, `batch_flips` (ReLU units on in one run and off in the other, summed over
the samples each step trained on), `relu_flips` and `samples_with_flip` (the same on all 4096 training
samples after the epoch), the largest |logit|; a broken run has its replay error, its own loss and
logits, no max|dw|. And DIR/rounding.png.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, positive, write_csv  # noqa: E402
from tour import Step, load_stage, max_gap, replay_error, run_job, tolerance  # noqa: E402

W = 2  # simulated ranks: for 2, sum(g_r / W) is bit for bit what DDP's reducer computes
DTYPES = ("float32", "float64")
COLUMNS = ["run", "dtype", "lr", "world_size", "batch_per_rank", "global_batch", "epoch", "steps", "max_dw_end",
           "max_dw_epoch_max", "replay_error", "tolerance", "train_loss", "batch_flips", "relu_flips",
           "samples_with_flip", "max_abs_logit"]
BROKEN = {  # name -> what the broken DDP run does differently
    "no set_epoch": "every epoch repeats epoch 0's order (sampler.set_epoch forgotten)",
    "global batch b": "no DistributedSampler: every rank takes the same b samples, so the global batch is b",
}


def preactivations(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The inputs of the two ReLUs, and the logits."""
    with torch.no_grad():
        z1 = model.body[0](x)
        z2 = model.head[0](z1.relu())
        return [z1, z2], model.head[2](z2.relu())


def sign_flips(ref: torch.nn.Module, ddp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Per sample: how many ReLU units are on (input > 0) in one model and off in the other."""
    (a, _), (b, _) = preactivations(ref, x), preactivations(ddp, x)
    return sum(((za > 0) != (zb > 0)).sum(dim=1) for za, zb in zip(a, b, strict=True))


def simulate(s01, dtype: str, lr: float, epochs: int, batch: int, seed: int, variant: str = "") -> dict:
    """Stage 01 (batch W*batch) and DDP (W ranks x batch) side by side; `variant` breaks the DDP run."""
    args = argparse.Namespace(seed=seed, dtype=dtype, lr=lr)
    cpu = torch.device("cpu")
    train_set, _, ref, ref_opt = s01.load_train_objs(args, cpu)  # stage 01's own data, weights, optimizer
    _, _, ddp, ddp_opt = s01.load_train_objs(args, cpu)
    x, y = train_set.tensors
    n, gb = len(x), W * batch
    ref_p, ddp_p = list(ref.parameters()), list(ddp.parameters())
    gaps, batch_flips, losses, epoch_rows = [], [], [], []
    trajectory, ref_trajectory = [s01.state_of(ddp, ddp_opt, 0)], [s01.state_of(ref, ref_opt, 0)]
    for epoch in range(epochs):
        ref_order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        ddp_order = ref_order if variant != "no set_epoch" else torch.randperm(
            n, generator=torch.Generator().manual_seed(seed))
        total, epoch_gaps, epoch_flips = 0.0, [], []
        for k in range(n // gb):
            if not variant:  # stage 01's step (a broken run is judged by the replay alone)
                idx = ref_order[k * gb:(k + 1) * gb]
                # ReLU units on in one run and off in the other, on the batch both are about to train on
                epoch_flips.append(int(sign_flips(ref, ddp, x[idx]).sum()))
                ref_opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(ref(x[idx]), y[idx])
                loss.backward()
                ref_opt.step()
                total += loss.item()
            if variant == "global batch b":  # W ranks on the same b samples: W steps of batch b per global batch
                micro_steps = [[ddp_order[(W * k + j) * batch:(W * k + j + 1) * batch]] * W for j in range(W)]
            else:
                idx = ddp_order[k * gb:(k + 1) * gb]
                micro_steps = [[idx[r::W] for r in range(W)]]  # DistributedSampler: rank r, positions r, r+W, ...
            for micro in micro_steps:
                # Each rank's loss and gradient (ranks that share their samples share them: computed once).
                per_batch = {id(m): F.cross_entropy(ddp(x[m]), y[m]) for m in micro}
                per_batch = {key: (loss, torch.autograd.grad(loss, ddp_p)) for key, loss in per_batch.items()}
                rank_losses, grads = zip(*(per_batch[id(m)] for m in micro), strict=True)
                for i, p in enumerate(ddp_p):
                    p.grad = sum(g[i] / W for g in grads)  # the reducer: each rank's grad / W, summed
                ddp_opt.step()
                if variant:
                    total += sum(rank_loss.item() for rank_loss in rank_losses) / W / len(micro_steps)
            if not variant:
                epoch_gaps.append(max_gap(ref_p, ddp_p))
        gaps += epoch_gaps
        batch_flips += epoch_flips
        losses.append(total / (n // gb))
        trajectory.append(s01.state_of(ddp, ddp_opt, epoch + 1))
        ref_trajectory.append(s01.state_of(ref, ref_opt, epoch + 1))
        row = {"epoch": epoch + 1, "steps": (epoch + 1) * (n // gb), "train_loss": losses[-1],
               "max_abs_logit": preactivations(ddp if variant else ref, x)[1].abs().max().item()}
        if not variant:
            flips = sign_flips(ref, ddp, x)  # on the whole training set, after the epoch
            row |= {"max_dw_end": epoch_gaps[-1], "max_dw_epoch_max": max(epoch_gaps),
                    "batch_flips": sum(epoch_flips), "relu_flips": int(flips.sum()),
                    "samples_with_flip": int((flips > 0).sum())}
        epoch_rows.append(row)
    summary = {"seed": seed, "lr": lr, "dtype": dtype, "global_batch": gb}
    for e, row in enumerate(epoch_rows):  # the tour's replay, one epoch at a time: one value per epoch
        row["replay_error"] = replay_error(summary, trajectory[e:e + 2])
    name = f"broken: {variant}" if variant else f"DDP {W}x{batch} vs 01 batch {gb}"
    return {"run": name, "variant": variant, "dtype": dtype, "lr": lr, "batch": batch, "gaps": gaps,
            "epochs": epoch_rows, "batch_flips": batch_flips, "trajectory": trajectory,
            "ref_trajectory": ref_trajectory}


def run_real(batch: int, seed: int, epochs: int, timeout: float) -> tuple[dict, list[str]]:
    """Stage 04 under torchrun (W x batch) and stage 01 (batch W x batch), lr 0.05: {(dtype, stage): trajectory}."""
    real, log = {}, []
    for dtype in DTYPES:
        common = ("--device", "cpu", "--dtype", dtype, "--epochs", str(epochs), "--seed", str(seed), "--lr", "0.05")
        steps = {"04_ddp_torchrun": Step("04_ddp_torchrun", "torchrun", (*common, "--batch-size", str(batch)),
                                         nproc=W),
                 "01_single_gpu": Step("01_single_gpu", "python", (*common, "--batch-size", str(W * batch)))}
        with tempfile.TemporaryDirectory(prefix="rounding-check-") as tmp:
            for stage, step in steps.items():
                out = Path(tmp) / stage
                run = run_job(step.commands(out=out), out, step.env, timeout=timeout)
                if run.returncode != 0:
                    raise RuntimeError(f"{stage} ({dtype}) failed:\n{run.describe()}")
                real[dtype, stage] = run.trajectory
                log.append(f"  ran {stage} ({dtype}, {epochs} epochs) in {run.seconds:.1f}s")
    return real, log


def compare(s01, real: dict, sims: dict, batch: int, seed: int, epochs: int) -> list[dict]:
    """The real runs' recorded states (weights and momentum, every epoch) against the simulation's."""
    results = []
    for dtype in DTYPES:
        sim = sims.get((dtype, 0.05))
        if sim is None or len(sim["trajectory"]) <= epochs:
            sim = simulate(s01, dtype, 0.05, epochs, batch, seed)
        for stage, mine in (("04_ddp_torchrun", sim["trajectory"]), ("01_single_gpu", sim["ref_trajectory"])):
            per_epoch = [max(max_gap(a["params"], b["params"]),
                             max_gap(a["momentum"], b["momentum"]) if a["momentum"][0] is not None else 0.0)
                         for a, b in zip(real[dtype, stage], mine[:epochs + 1], strict=True)]
            results.append({"dtype": dtype, "stage": stage, "final": per_epoch[-1], "worst": max(per_epoch)})
        results.append({"dtype": dtype, "stage": "04 vs 01 (both real)", "worst": None,
                        "final": max_gap(real[dtype, "04_ddp_torchrun"][-1]["params"],
                                          real[dtype, "01_single_gpu"][-1]["params"])})
    return results


def fmt(v: float) -> str:
    return f"{v:.1e}" if v else "0"


def first_flip(r: dict) -> str:
    """The first step at which a ReLU unit was on in one run and off in the other on a sample being trained."""
    step = next((i for i, n in enumerate(r["batch_flips"]) if n), None)
    if step is None:
        return "none"
    before = r["gaps"][step - 1] if step else 0.0
    return f"step {step + 1} (ep {step // (len(r['gaps']) // len(r['epochs'])) + 1}): {fmt(before)} -> " \
           f"{fmt(r['gaps'][step])}"


def print_table(runs: list[dict], epochs: int) -> None:
    marks = [e for e in (1, 5, 20, 60) if e <= epochs] or [epochs]
    marks += [epochs] if marks[-1] != epochs else []
    header = ["run", "dtype", "lr", *[f"max|dw| ep {e}" for e in marks], "worst replay", "tolerance", "verdict",
              "first ReLU flip: max|dw| before -> after"]
    table = []
    for r in runs:
        tol = tolerance(r["dtype"])
        worst = max(row["replay_error"] for row in r["epochs"])
        broken = bool(r["variant"])
        ok = (worst > tol) if broken else (worst <= tol)
        verdict = ("caught" if ok else "MISSED") if broken else ("passes" if ok else "FAILS")
        dw = [fmt(r["epochs"][e - 1]["max_dw_end"]) if not broken else "-" for e in marks]
        table.append([r["run"], r["dtype"], f"{r['lr']:g}", *dw, fmt(worst), f"{tol:.1e}", verdict,
                      "-" if broken else first_flip(r)])
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) if i < 3 or i == len(row) - 1 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths, strict=True))).rstrip())


def plot(runs: list[dict], path: Path, batch: int) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 6))
    correct = [r for r in runs if not r["variant"]]
    lrs = sorted({r["lr"] for r in correct}, reverse=True)
    color = {(d, lr): f"C{i}" for i, (d, lr) in enumerate((d, lr) for d in DTYPES for lr in lrs)}
    steps_per_epoch = len(correct[0]["gaps"]) // len(correct[0]["epochs"]) if correct else 1
    for r in correct:
        steps = range(1, len(r["gaps"]) + 1)
        c = color[r["dtype"], r["lr"]]
        left.plot(steps, [g if g > 0 else float("nan") for g in r["gaps"]], color=c, linewidth=1,
                  label=f"{r['dtype']}, lr {r['lr']:g}")
        first = next((i for i, n in enumerate(r["batch_flips"]) if n), None)
        if first is not None:
            left.plot(first + 1, r["gaps"][first], "v", color=c, markersize=8, markeredgecolor="black")
    left.plot([], [], "v", color="white", markeredgecolor="black",
              label="first ReLU flip: a unit on in one run,\noff in the other, on a trained sample")
    left.set(yscale="log", xlabel=f"training step ({steps_per_epoch} per epoch)",
             ylabel="max |w(DDP) - w(stage 01)| over all weights",
             title=f"the runs drift apart: stage 01 (batch {W * batch}) vs DDP ({W} x {batch})")
    top = left.secondary_xaxis("top", functions=(lambda s: s / steps_per_epoch, lambda e: e * steps_per_epoch))
    top.set_xlabel("epoch")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=3)
    left.grid(True, which="major", alpha=0.3)
    for r in runs:
        epochs = [row["epoch"] for row in r["epochs"]]
        errors = [row["replay_error"] if row["replay_error"] > 0 else float("nan") for row in r["epochs"]]
        if r["variant"]:
            right.plot(epochs, errors, "x-" if r["variant"] == "no set_epoch" else "s-", color="black",
                       markersize=4, linewidth=1, alpha=0.8 if r["variant"] == "no set_epoch" else 0.5,
                       label=f"broken ({r['dtype']}, lr {r['lr']:g}): {r['variant']}")
        else:
            right.plot(epochs, errors, "o-", color=color[r["dtype"], r["lr"]], markersize=3, linewidth=1,
                       label=f"{r['dtype']}, lr {r['lr']:g}")
    for d, style in zip(DTYPES, ("--", "-."), strict=True):
        tol = tolerance(d)
        right.axhline(tol, color="grey", linestyle=style, linewidth=1.2)
        right.annotate(f"{d} tolerance sqrt(eps) = {tol:.1e} ", (0.99, tol), xycoords=("axes fraction", "data"),
                       ha="right", va="top", fontsize=8, color="dimgrey")
    right.set(yscale="log", xlabel="epoch", ylabel="max |replay - DDP| after the epoch (weights and momentum)",
              title="epoch replay: stage 01's code redoes each DDP epoch")
    right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=2)
    right.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"Rounding, DDP vs one process (simulated in one process, torch {torch.__version__}); "
                 "points at exactly 0 are not drawn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def list_of(item):
    """A comma-separated list, each value parsed by `item`."""
    def parse(text: str):
        try:
            return [item(v) for v in text.split(",")]
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r} ({e})") from None
    parse.__name__ = "list"
    return parse


def dtype_name(text: str) -> str:
    if text not in DTYPES:
        raise ValueError(f"{text!r} is not one of {', '.join(DTYPES)}")
    return text


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/rounding.py", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive(int), default=60)
    p.add_argument("--lrs", type=list_of(positive(float)), default=[0.05, 0.01], help="learning rates")
    p.add_argument("--dtypes", type=list_of(dtype_name), default=list(DTYPES),
                   help="the broken runs use the first one, and the first of --lrs")
    p.add_argument("--batch-size", type=positive(int), default=32, help=f"per-rank batch b (stage 01: {W} x b)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-epochs", type=positive(int), default=5, help="epochs of the real runs of the check")
    p.add_argument("--no-check", action="store_true", help="skip the real torchrun / stage 01 runs")
    p.add_argument("--timeout", type=positive(float), default=180.0, help="seconds one real run may take")
    p.add_argument("--out", type=Path, default=HERE, help="where to write rounding.csv and rounding.png")
    args = p.parse_args(argv)
    if 4096 % (W * args.batch_size):
        p.error(f"argument --batch-size: {W} x batch must divide the 4096 training samples, got {args.batch_size}")
    p.check_out_writable(args.out)  # fail now, not after measuring

    torch.set_num_threads(1)
    s01 = load_stage("01_single_gpu")
    print(f"rounding: stage 01 (batch {W * args.batch_size}) vs DDP ({W} ranks x {args.batch_size}), simulated in "
          f"one process, {args.epochs} epochs, one thread; torch {torch.__version__}", flush=True)
    runs, start = [], time.monotonic()
    # The real runs of the check start now, as subprocesses: their start-up overlaps the simulation.
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    real = None if args.no_check else pool.submit(run_real, args.batch_size, args.seed, args.check_epochs,
                                                  args.timeout)
    configs = [(d, lr, "") for d in args.dtypes for lr in args.lrs]
    configs += [(args.dtypes[0], args.lrs[0], v) for v in BROKEN]  # by default float32: the looser tolerance
    for i, (dtype, lr, variant) in enumerate(configs):
        t = time.monotonic()
        runs.append(simulate(s01, dtype, lr, args.epochs, args.batch_size, args.seed, variant))
        r = runs[-1]
        what = f"broken ({variant})" if variant else f"max|dw| at the end {fmt(r['epochs'][-1]['max_dw_end'])}"
        print(f"[{i + 1}/{len(configs)}] {dtype} lr {lr:g}: {what}, worst epoch replay "
              f"{fmt(max(row['replay_error'] for row in r['epochs']))} ({time.monotonic() - t:.1f}s)", flush=True)
    print(f"simulated in {time.monotonic() - start:.0f}s\n")
    print_table(runs, args.epochs)
    print(f"broken runs: {'; '.join(f'{k}: {v}' for k, v in BROKEN.items())}")

    checks = []
    if real is not None:
        print(f"\ncheck: the simulation against the real runs ({args.check_epochs} epochs, lr 0.05)", flush=True)
        try:
            real_states, log = real.result()
        except RuntimeError as e:
            print(f"check FAILED: a real run failed: {e}", file=sys.stderr)
            return 1
        print("\n".join(log))
        sims = {(r["dtype"], r["lr"]): r for r in runs if not r["variant"]}
        checks = compare(s01, real_states, sims, args.batch_size, args.seed, args.check_epochs)
        for c in checks:
            if c["worst"] is None:
                print(f"  {c['dtype']}: real stage 04 vs real stage 01, final weights: max|d| = {fmt(c['final'])}")
            else:
                same = "bit for bit" if c["worst"] == 0 else "NOT bit for bit"
                print(f"  {c['dtype']}: simulation vs real {c['stage']}: {same}, max|d| over every recorded epoch "
                      f"(weights and momentum) = {fmt(c['worst'])}, final = {fmt(c['final'])}")

    write_csv(args.out / "rounding.csv", [{"run": r["run"], "dtype": r["dtype"], "lr": r["lr"], "world_size": W,
                                          "batch_per_rank": r["batch"], "global_batch": W * r["batch"],
                                          "tolerance": tolerance(r["dtype"]), **row}
                                         for r in runs for row in r["epochs"]], COLUMNS)
    plot(runs, args.out / "rounding.png", args.batch_size)
    print(f"\nwrote {args.out / 'rounding.csv'} and {args.out / 'rounding.png'} ({os.cpu_count()} cores, "
          f"{time.monotonic() - start:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
