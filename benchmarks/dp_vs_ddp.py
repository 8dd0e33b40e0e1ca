"""DataParallel (stage 02) against DistributedDataParallel (stages 03 and 04) on the same GPUs.

    python benchmarks/dp_vs_ddp.py                     # every visible GPU; needs 2 or more
    python benchmarks/dp_vs_ddp.py --batch-size 256 --epochs 3 --out runs/dp_vs_ddp

Runs the stage scripts themselves, at the same global batch (W GPUs x --batch-size): stage 02 as one
process with batch W*b, which DataParallel splits over the GPUs in threads every step; stage 03
(mp.spawn) and stage 04 (torchrun) as W processes of batch b. It reads the samples/s each stage writes
to its summary.json (training loop only, no start-up) and prints them side by side.

With fewer than 2 GPUs there is nothing to compare (on one device DataParallel does nothing, and on
the CPU it is not used at all): the script says so and exits 0 without measuring anything.
Writes DIR/dp_vs_ddp.csv and DIR/dp_vs_ddp.png (--out, default runs/dp_vs_ddp).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, positive, write_csv  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["stage", "launcher", "processes", "gpus", "per_process_batch", "global_batch", "epochs", "samples_per_s",
           "vs_dataparallel", "wall_s"]


def run_stage(cmd: list[str], timeout: float) -> tuple[int | None, str, float]:
    """Run one stage in its own session; at the time limit stop it (torchrun passes SIGTERM to its workers)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output, time.monotonic() - start
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                output, _ = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            output = ""
        return None, output, time.monotonic() - start


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(range(len(rows)), [r["samples_per_s"] for r in rows], color=["C0", "C1", "C2"][:len(rows)])
    ax.set_xticks(range(len(rows)), [f"{r['stage']}\n{r['launcher']}" for r in rows], fontsize=8)
    ax.set(ylabel="training samples/s", title=f"{rows[0]['gpus']} GPUs, global batch {rows[0]['global_batch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/dp_vs_ddp.py", description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=positive(int), default=256, help="samples per GPU per step (default 256)")
    p.add_argument("--epochs", type=positive(int), default=5, help="epochs of each stage (default 5)")
    p.add_argument("--gpus", type=positive(int), help="GPUs to use (default: all visible)")
    p.add_argument("--out", type=Path, default=Path("runs/dp_vs_ddp"), help="where to write the CSV and PNG")
    p.add_argument("--timeout", type=positive(float), default=600.0, help="seconds one stage may take")
    args = p.parse_args(argv)

    import torch  # after the flags are checked: importing torch takes seconds
    visible = torch.cuda.device_count()
    if visible < 2:
        print(f"dp_vs_ddp: needs 2 or more GPUs, found {visible}: DataParallel and DDP only differ when a "
              f"batch is split over several GPUs. Nothing measured (no numbers without GPUs).")
        return 0
    gpus = args.gpus or visible
    if gpus > visible or gpus < 2:
        p.error(f"argument --gpus: between 2 and the {visible} visible GPUs, got {gpus}")
    p.check_out_writable(args.out)  # fail now, not after measuring

    b, common = args.batch_size, ["--device", "cuda", "--epochs", str(args.epochs)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    runs = [
        ("02_dataparallel", "python (1 process, threads)", 1,
         [sys.executable, "02_dataparallel/train.py", *common, "--batch-size", str(gpus * b)]),
        ("03_ddp_spawn", "mp.spawn", gpus,
         [sys.executable, "03_ddp_spawn/train.py", *common, "--world-size", str(gpus), "--batch-size", str(b)]),
        ("04_ddp_torchrun", "torchrun", gpus, [*torchrun, "04_ddp_torchrun/train.py", *common, "--batch-size", str(b)]),
    ]
    print(f"DP vs DDP: {gpus} GPUs ({torch.cuda.get_device_name(0)}), global batch {gpus * b}, "
          f"{args.epochs} epochs each; torch {torch.__version__}", flush=True)
    rows = []
    if gpus < visible:  # DataParallel uses every GPU it sees: let the stages see only the first `gpus`
        ids = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(visible)))).split(",")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:gpus])
    with tempfile.TemporaryDirectory(prefix="dp-vs-ddp-") as tmp:
        for i, (stage, launcher, procs, cmd) in enumerate(runs):
            out = Path(tmp) / stage
            code, output, wall = run_stage([*cmd, "--out", str(out)], args.timeout)
            if code != 0:
                status = "timed out" if code is None else f"exit {code}"
                print(f"[{i + 1}/{len(runs)}] {stage} via {launcher}: FAILED ({status})\n{output[-3000:]}")
                return 1
            summary = json.loads((out / "summary.json").read_text())
            rows.append({"stage": stage, "launcher": launcher, "processes": procs, "gpus": gpus,
                         "per_process_batch": summary["batch_size"], "global_batch": summary["global_batch"],
                         "epochs": args.epochs, "samples_per_s": summary["samples_per_s"], "wall_s": wall})
            print(f"[{i + 1}/{len(runs)}] {stage} via {launcher}: {summary['samples_per_s']:,.0f} samples/s "
                  f"(wall {wall:.1f}s)", flush=True)
    for r in rows:
        r["vs_dataparallel"] = r["samples_per_s"] / rows[0]["samples_per_s"]

    print()
    header = ["stage", "launcher", "processes", "global batch", "samples/s", "vs DP"]
    table = [[r["stage"], r["launcher"], str(r["processes"]), str(r["global_batch"]), f"{r['samples_per_s']:,.0f}",
              f"{r['vs_dataparallel']:.2f}x"] for r in rows]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    write_csv(args.out / "dp_vs_ddp.csv", rows, COLUMNS)
    plot(rows, args.out / "dp_vs_ddp.png")
    print(f"\nwrote {args.out / 'dp_vs_ddp.csv'} and {args.out / 'dp_vs_ddp.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
