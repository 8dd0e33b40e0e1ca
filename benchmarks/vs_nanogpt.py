"""11_gpt beside nanoGPT's CPU run: the same text, one run after the other on this machine, scored the same way.

    python benchmarks/vs_nanogpt.py                    # both full runs, one after the other: about 6 minutes on 2 cores
    python benchmarks/vs_nanogpt.py --quick            # 20 steps each: checks the script, measures nothing
    python benchmarks/vs_nanogpt.py --nanogpt PATH     # where karpathy/nanoGPT's code is (default: ../nanoGPT)

nanoGPT's code is not part of this repository and nothing here downloads it: clone it beside the repository yourself
(git clone https://github.com/karpathy/nanoGPT ../nanoGPT). Its run is the command its README gives for a CPU, with
its checkpoint written at every evaluation (--always_save_checkpoint=True: the model it ends with, not the one its
20-batch estimate liked best). Its data is made here the way its data/shakespeare_char/prepare.py makes it, from this
repository's copy of the same text (11_gpt/data/input.txt): one id per character of the sorted vocabulary, the first
90% to train on and the last 10% held out, which is 11_gpt's split too. 11_gpt's run is its README's default command.

Both final models are then scored by one function, 11_gpt's held-out loss: every held-out character but the first,
in consecutive windows of the model's own context (64 characters for nanoGPT's run, 128 for 11_gpt's), in float64.
nanoGPT's own figure (its last "val loss": 20 random batches) is printed beside it. Wall time is each launch's, from
start to exit, as a reader waits for it. Writes DIR/vs_nanogpt.json, and DIR/vs_nanogpt.png: both training losses
against each run's seconds of training (nanoGPT's per-iteration times, its evaluations in them; 11_gpt's log
intervals, without its evaluations), as means over 50 steps, with each run's final held-out loss.
"""
from __future__ import annotations

import importlib.util
import json
import pickle
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, positive  # noqa: E402
from tour import TORCHRUN, load_stage, run_job  # noqa: E402

TEXT = ROOT / "11_gpt" / "data" / "input.txt"
# nanoGPT's README, "I only have a macbook": its CPU command, as given there.
NANOGPT_CPU = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
               "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
               "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]
NANOGPT_QUICK = ["--max_iters=20", "--lr_decay_iters=20", "--eval_interval=10", "--warmup_iters=2"]
OURS = ["--standalone", "--nproc_per_node=2", str(ROOT / "11_gpt" / "train.py")]  # its README's default run
OURS_QUICK = ["--max-steps", "20", "--eval-every", "10", "--sample", "0"]


def prepare_nanogpt_data(text: str, folder: Path) -> None:
    """train.bin, val.bin (uint16 ids) and meta.pkl (the vocabulary), as nanoGPT's shakespeare_char reads them."""
    import numpy as np
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    split = int(len(ids) * 0.9)
    folder.mkdir(parents=True, exist_ok=True)
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)


def held_out_loss(logits_of, tokens, context: int) -> float:
    """11_gpt's held-out loss (nats per character) of a model given as `logits_of(windows) -> logits`."""
    import torch
    import torch.nn.functional as F
    total, count = 0.0, 0
    with torch.no_grad():
        starts = torch.arange(0, len(tokens) - 1, context)
        whole = starts[starts + context + 1 <= len(tokens)]
        for chunk in whole.split(64):
            windows = tokens[chunk[:, None] + torch.arange(context + 1)]
            logits = logits_of(windows[:, :-1]).double()
            total += F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="sum").item()
            count += windows[:, 1:].numel()
        for start in starts[starts + context + 1 > len(tokens)].tolist():  # the shorter last window
            window = tokens[start:][None]
            total += F.cross_entropy(logits_of(window[:, :-1])[0].double(), window[0, 1:], reduction="sum").item()
            count += window.shape[1] - 1
    return total / count


def nanogpt_model(checkout: Path, out: Path):
    """nanoGPT's final model from its checkpoint, built with its own model.py; (model, context, parameters)."""
    import torch
    spec = importlib.util.spec_from_file_location("nanogpt_model", checkout / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checkpoint = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)
    model = module.GPT(module.GPTConfig(**checkpoint["model_args"]))
    model.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in checkpoint["model"].items()})
    model.eval()
    return model, checkpoint["model_args"]["block_size"], sum(p.numel() for p in model.parameters())


def our_model(stage, out: Path):
    """11_gpt's final model from its --out (model.pt), built with its own GPT class; (model, context, parameters)."""
    import torch
    summary = json.loads((out / "summary.json").read_text())
    model = stage.GPT(stage.Config(**summary["model"]))
    model.load_state_dict(torch.load(out / "model.pt", map_location="cpu", weights_only=True))
    model.eval()
    return model, summary["model"]["context"], summary["parameters"]


def nanogpt_curve(log: str, every: int = 50) -> list[tuple[float, float]]:
    """(seconds of training so far, mean training loss of the last `every` iterations) from nanoGPT's log lines,
    "iter N: loss L, time Tms, ..." (T: the time since the previous one, its evaluation and checkpoint included)."""
    iters = [(float(loss), float(ms) / 1000) for loss, ms in re.findall(r"^iter \d+: loss ([\d.]+), time ([\d.]+)ms",
                                                                         log, re.M)]
    points, seconds = [], 0.0
    for i in range(0, len(iters) - every + 1, every):
        chunk = iters[i:i + every]
        seconds += sum(t for _, t in chunk)
        points.append((seconds, sum(loss for loss, _ in chunk) / every))
    return points


def our_curve(summary: dict) -> list[tuple[float, float]]:
    """(seconds of training so far, mean training loss since the previous log line) from 11_gpt's summary.json."""
    points, seconds, previous = [], 0.0, 0
    tokens_per_step = summary["global_batch"] * summary["model"]["context"]
    for step, train_loss, _, tokens_per_s in summary["curve"]:
        seconds += (step - previous) * tokens_per_step / tokens_per_s
        points.append((seconds, train_loss))
        previous = step
    return points


def plot(curves: dict[str, list[tuple[float, float]]], rows: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for i, row in enumerate(rows):
        seconds, losses = zip(*curves[row["run"]], strict=True) if curves[row["run"]] else ((), ())
        ax.plot(seconds, losses, color=f"C{i}", label=f"{row['run']}: training loss (mean of 50 steps)")
        ax.scatter([row["wall_seconds"]], [row["held_out_loss"]], color=f"C{i}", zorder=3,
                   label=f"{row['run']}: held-out loss at the end, {row['held_out_loss']:.3f} "
                         f"(plotted at its wall time, {row['wall_seconds']:.0f} s)")
    ax.set_xlabel("seconds: of training (the curves), from start to exit (the dots)")
    ax.set_ylabel("loss, nats per character")
    ax.set_ylim(1.4, 3.0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("11_gpt's default run beside nanoGPT's CPU command, one after the other on one machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run(name: str, cmd: list[str], cwd: Path, out: Path, timeout: float) -> tuple[float, str]:
    """One launch, timed from start to exit; its stdout (also written to out/stdout.txt)."""
    print(f"{name}: $ {' '.join(cmd)}", flush=True)
    job = run_job([cmd], out, None, timeout, cwd=cwd)
    if job.returncode != 0 or job.survivors:
        raise SystemExit(f"{name} failed:\n{job.describe()}")
    print(f"{name}: {job.seconds:.0f} s", flush=True)
    (out / "stdout.txt").write_text(job.stdout)  # the whole log, beside the run's files
    return job.seconds, job.stdout


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="benchmarks/vs_nanogpt.py", description=__doc__.splitlines()[0])
    p.add_argument("--nanogpt", type=Path, default=ROOT.parent / "nanoGPT",
                   help="a checkout of karpathy/nanoGPT (default: ../nanoGPT, beside this repository)")
    p.add_argument("--quick", action="store_true", help="20 steps each: checks the script, measures nothing")
    p.add_argument("--out", type=Path, default=Path("runs/vs_nanogpt"), help="where both runs and the JSON go")
    p.add_argument("--timeout", type=positive(float), default=900.0, help="seconds each run may take")
    args = p.parse_args(argv)
    p.check_out_writable(args.out)  # fail now, not after the first run
    args.nanogpt = args.nanogpt.resolve()
    if not (args.nanogpt / "train.py").is_file() or not (args.nanogpt / "config/train_shakespeare_char.py").is_file():
        p.error(f"argument --nanogpt: no nanoGPT checkout at {args.nanogpt}; clone it there (git clone "
                f"https://github.com/karpathy/nanoGPT {args.nanogpt}) or give its path")
    args.out = args.out.resolve()

    import torch
    text = TEXT.read_text(encoding="utf-8")
    work = args.out / "nanogpt"  # its working directory: it reads data/ and configurator.py from there
    prepare_nanogpt_data(text, work / "data" / "shakespeare_char")
    for name in ("configurator.py", "config"):
        link = work / name
        if not link.exists():
            link.symlink_to(args.nanogpt / name)
    theirs_cmd = [sys.executable, str(args.nanogpt / "train.py"), *NANOGPT_CPU, f"--out_dir={work / 'out'}",
                  "--always_save_checkpoint=True", *(NANOGPT_QUICK if args.quick else [])]
    ours_cmd = [*TORCHRUN, *OURS, "--out", str(args.out / "11_gpt"), *(OURS_QUICK if args.quick else [])]
    (args.out / "11_gpt").mkdir(parents=True, exist_ok=True)
    print(f"on {torch.get_num_threads()} threads, torch {torch.__version__}; one run after the other", flush=True)
    theirs_seconds, theirs_log = run("nanoGPT", theirs_cmd, work, work / "out", args.timeout)
    ours_seconds, _ = run("11_gpt", ours_cmd, ROOT, args.out / "11_gpt", args.timeout)

    stage = load_stage("11_gpt")
    held_out = stage.load_corpus(TEXT).held_out  # what nanoGPT's val.bin holds too (tests/test_benchmarks.py)
    ours = json.loads((args.out / "11_gpt" / "summary.json").read_text())
    estimates = re.findall(r"val loss ([0-9.]+)", theirs_log)
    rows = []
    for name, (model, context, parameters), seconds, tokens, own in [
            ("nanoGPT", nanogpt_model(args.nanogpt, work / "out"), theirs_seconds,
             int(re.findall(r"--max_iters=(\d+)", " ".join(theirs_cmd))[-1]) * 12 * 64,  # steps x batch x block
             float(estimates[-1]) if estimates else None),
            ("11_gpt", our_model(stage, args.out / "11_gpt"), ours_seconds,
             ours["steps"] * ours["global_batch"] * ours["model"]["context"], ours["eval_loss"])]:
        # nanoGPT's forward gives every position's logits only when given targets (else the last position's)
        logits_of = (lambda x, m=model: m(x, x.contiguous())[0]) if name == "nanoGPT" else model
        rows.append({"run": name, "parameters": parameters, "context": context, "tokens": tokens,
                     "held_out_loss": held_out_loss(logits_of, held_out, context), "own_estimate": own,
                     "wall_seconds": seconds})
    print(f"\n{'run':<8} {'parameters':>10} {'context':>7} {'tokens':>10} {'held-out loss':>13} {'its own':>8} "
          f"{'wall time':>9}")
    for r in rows:
        own = f"{r['own_estimate']:.4f}" if r["own_estimate"] is not None else "-"
        print(f"{r['run']:<8} {r['parameters']:>10,} {r['context']:>7} {r['tokens']:>10,} {r['held_out_loss']:>13.4f} "
              f"{own:>8} {r['wall_seconds']:>8.0f}s")
    print("held-out loss: one function for both (11_gpt's: the whole held-out text, nats/char); its own: nanoGPT's "
          "last 'val loss' (20 random batches), 11_gpt's held-out loss as it printed it")
    (args.out / "vs_nanogpt.json").write_text(json.dumps({"quick": args.quick, "torch": torch.__version__,
                                                          "threads": torch.get_num_threads(), "rows": rows},
                                                         indent=2) + "\n")
    plot({"nanoGPT": nanogpt_curve(theirs_log), "11_gpt": our_curve(ours)}, rows, args.out / "vs_nanogpt.png")
    print(f"wrote {args.out / 'vs_nanogpt.json'} and {args.out / 'vs_nanogpt.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
