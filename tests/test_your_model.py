"""your_model/index.md, "Your model, your data": every block of code on the page is the code, every command on it
runs and prints what the page shows, and its claims hold.

The page's blocks are tagged as tests/page_blocks.py says. Here the run blocks run block after block, in a copy of
your_model/ (runs/ fill there); the one not-run block is the lr benchmark at full size (its CSV is checked instead).

Cost here: the page's commands once (2 torchrun launches of 2 ranks, 5 plain python processes: ~35 CPU-s), the
FSDP check's negative control (the page's fsdp.py command once more, on a copy without set_epoch: ~18 CPU-s), and
one row of the lr benchmark in this process (40 steps: a second or two).
"""
from __future__ import annotations

import csv
import importlib.util
import math
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DistributedSampler

from harness import ROOT, Run, run_job
from page_blocks import (
    block_limit,
    code_mismatch,
    diff_mismatch,
    output_mismatch,
    page_blocks,
    shown_outputs,
    untagged,
)
from tools.cli import read_csv

HERE = ROOT / "your_model"
PAGE = HERE / "index.md"
W, EPOCHS, N_EVAL = 2, 5, 1001  # the scripts' defaults and the page's commands: 2 ranks, 5 epochs, 1001 held out

BLOCKS = page_blocks(PAGE)
RUNS = [b for b in BLOCKS if b.kind == "run"]


def load(path: Path, name: str):
    """Import a script of your_model/ (or benchmarks/) as a module: their work is under `if __name__ == ...`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the page shows the code ---------------------------------------------------------------------

def test_every_block_says_what_it_is():
    wrong = untagged(BLOCKS)
    assert not wrong, f"tag these blocks as tests/page_blocks.py says: {wrong}"
    assert len(RUNS) >= 6, "the page lost its commands?"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_code_blocks_are_the_files(block):
    why = code_mismatch(block)
    assert why is None, why


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "diff"], ids=lambda b: b.id)
def test_diffs_are_the_files_diffs(block):
    why = diff_mismatch(block)
    assert why is None, why


def test_every_script_of_the_folder_is_on_one_of_its_pages():
    """index.md shows its scripts, hugging_face.md the hf_*.py ones (tests/test_hugging_face.py checks that page)."""
    pages = sorted(HERE.glob("*.md"))
    shown = {path for page in pages for b in page_blocks(page) if b.lang in ("python", "diff")
             for path in b.arg.split()}
    scripts = {f"your_model/{p.name}" for p in HERE.glob("*.py")}
    assert scripts and scripts <= shown, f"not shown on {[p.name for p in pages]}: {sorted(scripts - shown)}"


# --- the page's commands run and print what it shows --------------------------------------------

@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Each run block's run, by block id: in order, in one copy of your_model/ (later blocks read earlier runs/)."""
    copy = tmp_path_factory.mktemp("your_model")
    shutil.copytree(HERE, copy / "your_model", ignore=shutil.ignore_patterns("__pycache__", "runs"))
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `python`, `torchrun`: ours
           "OMP_NUM_THREADS": "1",  # as torchrun gives its workers; the tests share the cores
           "CUDA_VISIBLE_DEVICES": ""}  # the page's outputs are the CPU's
    runs = {}
    for block in RUNS:
        runs[block.id] = run_job([["bash", "-euo", "pipefail", "-c", block.body]], copy, env=env,
                                 timeout=block_limit(block), cwd=copy)
    return runs


def run_of(ran: dict[str, Run], script: str) -> Run:
    (block,) = [b for b in RUNS if script in b.body.split("\n")[0]]
    run = ran[block.id]
    assert run.returncode == 0 and not run.survivors, f"{block.id}\n{run.describe()}"
    return run


def test_every_command_on_the_page_runs_and_prints_what_it_shows(ran):
    for block in RUNS:
        run = ran[block.id]
        assert run.returncode == 0 and not run.survivors, f"{block.id}\n{run.describe()}"
    for run, shown in shown_outputs(BLOCKS):
        why = output_mismatch(shown, ran[run.id].stdout)
        assert why is None, why
    for block in BLOCKS:
        if block.kind == "output-part":
            printed = run_of(ran, block.arg).stdout
            assert block.body in printed, f"{block.id}: not in what {block.arg} printed:\n{printed}"


# --- its claims ---------------------------------------------------------------------------------

def held_out(stdout: str) -> tuple[str, int]:
    """The accuracy line: (accuracy as printed, samples counted)."""
    (m,) = re.findall(r"^held-out accuracy (\d+\.\d+%) \((\d+) samples\)$", stdout, re.M)
    return m[0], int(m[1])


def test_ddp_and_fsdp_print_once_and_count_every_held_out_sample_once(ran):
    for script in ("your_model/single.py", "your_model/ddp.py", "your_model/fsdp.py"):
        out = run_of(ran, script).stdout
        assert len(re.findall(r"^epoch \d+: train loss", out, re.M)) == EPOCHS, f"{script}: one line per epoch\n{out}"
        accuracy, count = held_out(out)
        assert count == N_EVAL and float(accuracy.rstrip("%")) > 90, f"{script}\n{out}"


SET_EPOCH = "        sampler.set_epoch(epoch)  # a new order each epoch"


@pytest.fixture(scope="module")
def fsdp_without_set_epoch(ran, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The negative control of the FSDP check: the page's own fsdp.py command, as written, on a copy of fsdp.py that
    forgets sampler.set_epoch (every epoch repeats epoch 0's order: a classic bug, and one that runs without an
    error). Returns its model.pt. One more 2-rank launch (~18 CPU-s: 5 epochs of FSDP2)."""
    copy = tmp_path_factory.mktemp("your_model_control")
    shutil.copytree(HERE, copy / "your_model", ignore=shutil.ignore_patterns("__pycache__", "runs"))
    script = copy / "your_model" / "fsdp.py"
    text = script.read_text()
    assert text.count(SET_EPOCH) == 1, "fsdp.py's set_epoch line changed: update SET_EPOCH"
    script.write_text(text.replace(SET_EPOCH, SET_EPOCH.replace("sampler.set_epoch(epoch)", "pass")))
    (block,) = [b for b in RUNS if "your_model/fsdp.py" in b.body.split("\n")[0]]
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    run = run_job([["bash", "-euo", "pipefail", "-c", block.body]], copy, env=env, timeout=block_limit(block),
                  cwd=copy)
    assert run.returncode == 0 and not run.survivors, run.describe()
    return copy / "runs" / "fsdp" / "model.pt"


def weight_gap(a: Path, b: Path) -> float:
    x, y = (torch.load(p, weights_only=True) for p in (a, b))
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def test_fsdp_computes_the_training_of_ddp(ran, fsdp_without_set_epoch):
    """Same data, same seed, same global batch: FSDP2 ends at DDP's weights, to float32 rounding (measured here: 0,
    bit for bit, as 2 ranks' gradients average exactly; another reduction order would leave ~1e-6 after 5 epochs,
    what stage 01 and DDP differ by). The tolerance, 1e-4, sits far below what a bug does: the control, the same
    command with fsdp.py forgetting set_epoch, ends 0.20 from DDP."""
    ddp, fsdp = (run_of(ran, f"your_model/{s}.py").out / "runs" / s / "model.pt" for s in ("ddp", "fsdp"))
    gap = weight_gap(ddp, fsdp)
    assert gap < 1e-4, f"FSDP2's weights are {gap:.2e} from DDP's"
    control = weight_gap(ddp, fsdp_without_set_epoch)
    assert control > 1e-4, f"fsdp.py without set_epoch ends {control:.2e} from DDP: the check cannot see that bug"


def test_every_saved_file_loads_into_a_plain_model_and_scores_as_its_training_said(ran):
    out = run_of(ran, "your_model/to_one_file.py").stdout
    scored = dict(re.findall(r"^(runs/\S+): .* accuracy (\d+\.\d+%) \(1001 samples\)$", out, re.M))
    trained = {f"runs/{s}/model.pt": held_out(run_of(ran, f"your_model/{s}.py").stdout)[0]
               for s in ("single", "ddp", "fsdp")}
    assert scored == {**trained, "runs/fsdp/from_checkpoint.pt": trained["runs/fsdp/model.pt"]}, out
    runs = run_of(ran, "your_model/fsdp.py").out / "runs"
    gathered, converted = (torch.load(runs / "fsdp" / f, weights_only=True) for f in ("model.pt", "from_checkpoint.pt"))
    assert gathered.keys() == converted.keys() and all(torch.equal(gathered[k], converted[k]) for k in gathered), \
        "dcp_to_torch_save of the sharded checkpoint is not the gathered model"
    assert not [k for k in torch.load(runs / "ddp" / "model.pt", weights_only=True) if k.startswith("module.")]


def test_an_iterable_dataset_split_by_rank_and_worker_reads_every_sample_once():
    """Its split, played here reader by reader (get_worker_info as 2 workers would see it); the run with real
    DataLoader workers is checked below."""
    shards = load(HERE / "iterable_shards.py", "your_model_iterable_shards")
    n, seen = 1000, []
    real = shards.get_worker_info
    try:
        for rank in range(2):
            for worker in range(2):
                shards.get_worker_info = lambda worker=worker: SimpleNamespace(id=worker, num_workers=2)
                seen += list(shards.Stream(n, rank, 2))
    finally:
        shards.get_worker_info = real
    assert sorted(seen) == list(range(n)), "2 ranks x 2 workers: every sample once"


def test_the_iterable_snippet_saw_every_sample_once_with_real_workers(ran):
    out = run_of(ran, "your_model/iterable_shards.py").stdout
    assert re.findall(r"^  of 1000 samples: (.*)$", out, re.M) == ["1000 seen once, 0 twice, 0 never",
                                                                   "0 seen once, 1000 twice, 0 never"], out
    assert out.count("rank 0 got 10 batches") == out.count("rank 1 got 10 batches") == 1, out


def test_sampler_padding_and_drop_last_measured(ran):
    out = run_of(ran, "your_model/samplers.py").stdout
    lines = out.splitlines()
    orders = [line.split(":", 1)[1].strip() for line in lines[:3]]
    assert orders[0] == orders[1] != orders[2], "without set_epoch the order repeats; with it, it changes"
    exact = re.search(r"each once: (\d+\.\d+%)", out).group(1)
    rows = {(int(w), split.strip()): (int(scored), int(twice), int(never), acc)
            for w, split, scored, twice, never, acc in
            re.findall(r"^ ?(\d+)  (.{30}) +(\d+) +(\d+) +(\d+) +(\d+\.\d+%)", out, re.M)}
    for world in (2, 8, 64):  # DistributedSampler's arithmetic, computed here from torch itself
        padded = sum(len(DistributedSampler(range(N_EVAL), world, r, shuffle=False)) for r in range(world))
        dropped = sum(len(DistributedSampler(range(N_EVAL), world, r, shuffle=False, drop_last=True))
                      for r in range(world))
        assert padded == math.ceil(N_EVAL / world) * world and dropped == N_EVAL // world * world
        assert rows[world, "DistributedSampler"][:3] == (padded, padded - N_EVAL, 0)
        assert rows[world, "drop_last=True"][:3] == (dropped, 0, N_EVAL - dropped)
        assert rows[world, "Subset(range(r, N, W))"] == (N_EVAL, 0, 0, exact), "the exact split: each sample once"
        assert rows[world, "DistributedSampler"][3] != exact != rows[world, "mean of per-rank accuracies"][3]
    assert "twice: [0]" in out and "never: [1000]" in out, "on 2 ranks: sample 0 twice, or sample 1000 never"


# --- the learning rate when the global batch grows -----------------------------------------------

CSV = ROOT / "benchmarks" / "lr_scaling.csv"
INT_COLUMNS = ("epochs", "world_size", "batch_per_rank", "global_batch", "seed", "steps")


@pytest.fixture(scope="module")
def lr_scaling():
    return load(ROOT / "benchmarks" / "lr_scaling.py", "benchmark_lr_scaling")


def read_rows(path: Path) -> list[dict]:
    rows = read_csv(path)
    for r in rows:
        r.update({k: int(r[k]) for k in INT_COLUMNS})
        r.update({k: float(r[k]) for k in ("lr", "train_loss", "eval_loss", "eval_accuracy")})
    return rows


def test_lr_scaling_csv_is_complete_and_is_the_table_on_the_page(lr_scaling):
    with open(CSV, newline="") as f:
        assert next(csv.reader(f)) == lr_scaling.COLUMNS
    rows = read_rows(CSV)
    configs = [(r["epochs"], r["world_size"], r["lr_rule"], r["seed"]) for r in rows]
    assert sorted(configs) == sorted((e, w, rule, s) for e in (5, 20) for w in (1, 2, 4, 8, 16)
                                     for rule in lr_scaling.RULES for s in range(5))
    for r in rows:
        assert r["batch_per_rank"] == 32 and r["global_batch"] == 32 * r["world_size"], r
        assert r["steps"] == r["epochs"] * 4096 // r["global_batch"], r
        assert r["lr"] == pytest.approx(0.05 * (r["world_size"] if r["lr_rule"] == "linear" else 1)), r
        assert 0 < r["train_loss"] < 2 and 0 < r["eval_loss"] < 2 and 0.25 < r["eval_accuracy"] <= 1, r
    assert lr_scaling.table(rows) in PAGE.read_text(), "the page's table is not the CSV's: paste the script's table"
    (command,) = [b for b in BLOCKS if b.kind == "not-run"]
    assert command.body.strip() == "python benchmarks/lr_scaling.py --out benchmarks", "the command that made the CSV"


def test_lr_scaling_claims_on_the_page_hold():
    rows = read_rows(CSV)

    def runs(epochs, world, rule):
        return sorted((r for r in rows if (r["epochs"], r["world_size"], r["lr_rule"]) == (epochs, world, rule)),
                      key=lambda r: r["seed"])

    def mean(rs, key):
        return sum(r[key] for r in rs) / len(rs)

    for epochs in (5, 20):  # "at W = 4 and 8, keeping 0.05 did better ... in at least 4 of the 5 seeds"
        for world in (4, 8):
            same, linear = runs(epochs, world, "unchanged"), runs(epochs, world, "linear")
            assert mean(same, "train_loss") < mean(linear, "train_loss"), (epochs, world)
            assert mean(same, "eval_accuracy") > mean(linear, "eval_accuracy"), (epochs, world)
            assert sum(a["train_loss"] < b["train_loss"] for a, b in zip(same, linear, strict=True)) >= 4
            assert sum(a["eval_accuracy"] > b["eval_accuracy"] for a, b in zip(same, linear, strict=True)) >= 4
    slow, fast = runs(5, 16, "unchanged"), runs(5, 16, "linear")  # "0.8 ... lower in each of the 5 seeds"
    assert all(b["train_loss"] < a["train_loss"] for a, b in zip(slow, fast, strict=True))
    assert mean(slow, "train_loss") > 3 * mean(runs(5, 8, "unchanged"), "train_loss")
    spreads = sorted((100 * (max(a) - min(a)), key) for key in {(r["epochs"], r["world_size"], r["lr_rule"])
                                                                 for r in rows}
                     for a in [[r["eval_accuracy"] for r in runs(*key)]])
    assert f"{spreads[-1][0]:.1f}" == "6.6" and spreads[-1][1] == (5, 16, "unchanged"), spreads[-3:]
    assert (f"{spreads[0][0]:.1f}", f"{spreads[-2][0]:.1f}") == ("0.6", "3.2"), "the other settings: 0.6 to 3.2 points"
    text = " ".join(PAGE.read_text().split())
    assert "varies by 0.6 to 3.2 points between the 5 seeds (6.6 at W = 16, 5 epochs, lr 0.05)" in text


def test_lr_scaling_reruns_a_row_of_its_csv(lr_scaling, tmp_path, capsys):
    """The script, run here on its smallest setting (W = 16, 5 epochs: 40 steps), gives the CSV's row of seed 0."""
    threads = torch.get_num_threads()
    try:
        lr_scaling.main(["--worlds", "16", "--epochs", "5", "--seeds", "1", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # main() sets one thread; the other tests in this process keep theirs
    assert "| 5 | 16 | 512 | 40 | 0.05 |" in capsys.readouterr().out
    fresh = read_rows(tmp_path / "lr_scaling.csv")
    kept = [r for r in read_rows(CSV) if (r["epochs"], r["world_size"], r["seed"]) == (5, 16, 0)]
    assert [(r["lr_rule"], r["steps"]) for r in fresh] == [(r["lr_rule"], r["steps"]) for r in kept] != []
    for a, b in zip(fresh, kept, strict=True):  # the same code and seed; another CPU may round float32 otherwise
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-3), (a, b)
        assert abs(a["eval_accuracy"] - b["eval_accuracy"]) <= 0.003, (a, b)


def test_lr_scaling_refuses_a_bad_world_in_one_line(lr_scaling, capsys):
    with pytest.raises(SystemExit) as exit_:
        lr_scaling.main(["--worlds", "3"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--worlds" in err, err
