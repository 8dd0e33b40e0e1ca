"""The benchmarks run and write well-formed results. Not timed tests: the numbers are only checked to exist.

Each benchmark runs once, on a tiny setting, as a real bounded subprocess (the harness's launcher);
the tests check its CSV (expected columns, every configuration present, positive numbers), its PNG
and its table. Where the README shows a quick run, that run is the one checked (the readme_run marker):
the same command is not launched twice. The DP-vs-DDP benchmark needs GPUs: here it must say so and
exit 0 without numbers.
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from conftest import readme_run
from harness import ROOT, Run, check, launch_commands, load_copy, load_stage, time_limit
from tools.cli import read_csv

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def columns_and_rows(path: Path) -> tuple[list[str], list[dict]]:
    rows = read_csv(path)
    return list(rows[0]) if rows else [], rows


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is suspiciously small ({len(data)} bytes): an empty figure?"


def run_script(script: str, *flags: str, programs: int, out: Path | None = None) -> Run:
    """`script` with `flags`, its time limit that of the `programs` processes it starts in all (itself among them)."""
    cmd = [sys.executable, str(ROOT / script), *flags, *(["--out", str(out)] if out else [])]
    return launch_commands([cmd], out, timeout=time_limit(programs=programs))


# --- collectives/benchmark.py -------------------------------------------------------------------

COLL_SIZES = [4096, 65536]
COLL_WORLDS = [2, 3]  # 3 ranks on 2 cores: also exercises the "oversubscribed" label
COLL_ALGORITHMS = {"all_reduce", "ring", "ps", "ring_simple"}


@pytest.fixture(scope="module")
def collectives_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("collectives_bench")
    return check(run_script("collectives/benchmark.py", "--world-sizes", "2,3", "--sizes", "4K,64K", "--repeats", "3",
                            "--warmup", "1", programs=6, out=out))  # itself, then 2 ranks, then 3


def test_collectives_benchmark_writes_every_point(collectives_run):
    columns, rows = columns_and_rows(collectives_run.out / "collectives.csv")
    assert columns == ["world_size", "oversubscribed", "algorithm", "bytes", "repeats", "median_ms", "algbw_GBps",
                       "busbw_GBps", "copy_GBps", "time_vs_all_reduce", "busiest_rank_sent_bytes", "rank0_sent_bytes"]
    points = {(int(r["world_size"]), r["algorithm"], int(r["bytes"])) for r in rows}
    assert points == {(w, a, s) for w in COLL_WORLDS for a in COLL_ALGORITHMS for s in COLL_SIZES}
    assert len(rows) == len(points), "one row per point"
    for r in rows:
        for col in ("median_ms", "algbw_GBps", "busbw_GBps", "copy_GBps", "time_vs_all_reduce"):
            assert float(r[col]) > 0, (col, r)
        assert int(r["repeats"]) >= 3
        w, algbw, busbw = int(r["world_size"]), float(r["algbw_GBps"]), float(r["busbw_GBps"])
        assert busbw == pytest.approx(algbw * 2 * (w - 1) / w, rel=1e-3), "busbw = algbw * 2(W-1)/W"
        assert algbw == pytest.approx(int(r["bytes"]) / float(r["median_ms"]) / 1e6, rel=1e-3)
        assert r["oversubscribed"] == str(w > (os.cpu_count() or 1))
        if r["algorithm"] == "all_reduce":
            assert float(r["time_vs_all_reduce"]) == 1.0
    assert_png(collectives_run.out / "collectives.png")


def test_collectives_benchmark_measures_the_traffic_the_readme_explains(collectives_run):
    """Bytes each rank sends, counted by the OS: the ring's 2(W-1)/W * N per rank against rank 0's (W-1) * N."""
    _, rows = columns_and_rows(collectives_run.out / "collectives.csv")
    n = max(COLL_SIZES)  # big enough that message headers are noise
    for r in (r for r in rows if int(r["bytes"]) == n):
        w, busiest, rank0 = int(r["world_size"]), int(r["busiest_rank_sent_bytes"]), int(r["rank0_sent_bytes"])
        ring_share = 2 * (w - 1) / w * n
        if r["algorithm"] in ("ring", "ring_simple", "all_reduce"):  # gloo's own all-reduce is a ring too
            assert busiest == pytest.approx(ring_share, rel=0.05), r
        else:
            assert rank0 == busiest == pytest.approx((w - 1) * n, rel=0.05), r


def test_collectives_benchmark_prints_progress_and_a_table(collectives_run):
    out = collectives_run.stdout
    for w in COLL_WORLDS:  # a progress line per (W, size)
        assert f"W={w}   4 KB: all_reduce" in out and f"W={w}  64 KB: all_reduce" in out
    table = out.split("ring/all_reduce", 1)[1]
    assert "busbw ring" in out and "copy GB/s" in out and "wrote " in out
    assert len([line for line in table.splitlines() if " KB " in line]) == len(COLL_WORLDS) * len(COLL_SIZES)


# --- benchmarks/ddp_scaling.py ------------------------------------------------------------------

BATCHES, CAPS = [8, 16], [1, 25, 100]


@pytest.fixture(scope="module")
def scaling_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = tmp_path_factory.mktemp("ddp_scaling")
    return check(run_script("benchmarks/ddp_scaling.py", "--batches", "8,16", "--sweep-batch", "8", "--steps", "2",
                            "--rounds", "2", "--warmup", "1", "--mlp-width", "32", "--accumulate", "2", programs=3,
                            out=out))  # itself and its 2 ranks (mp.spawn), every configuration in that one job


def test_ddp_scaling_writes_every_configuration(scaling_run):
    columns, rows = columns_and_rows(scaling_run.out / "ddp_scaling.csv")
    assert columns == ["experiment", "model", "params", "mode", "world_size", "per_rank_batch", "global_batch",
                       "bucket_cap_mb", "accumulate", "no_sync", "steps", "step_ms", "samples_per_s", "efficiency"]
    configs = {(r["experiment"], r["model"], r["mode"], int(r["world_size"]), int(r["per_rank_batch"]),
                r["bucket_cap_mb"], int(r["accumulate"]), r["no_sync"]) for r in rows}
    expected = set()
    for model in ("stage", "mlp"):
        for b in BATCHES:
            expected |= {("scaling", model, "single", 1, b, "", 1, "False"),
                         ("scaling", model, "independent", 2, b, "", 1, "False"),
                         ("scaling", model, "ddp", 2, b, "25", 1, "False")}
    expected |= {("buckets", "mlp", "single", 1, 8, "", 1, "False")}
    expected |= {("buckets", "mlp", "ddp", 2, 8, str(cap), 1, "False") for cap in CAPS}
    expected |= {("no_sync", "mlp", "single", 1, 8, "", 2, "False"), ("no_sync", "mlp", "ddp", 2, 8, "25", 2, "False"),
                 ("no_sync", "mlp", "ddp", 2, 8, "25", 2, "True")}
    assert configs == expected and len(rows) == len(expected)
    single = {(r["experiment"], r["model"], r["per_rank_batch"], r["accumulate"]): float(r["samples_per_s"])
              for r in rows if r["mode"] == "single"}
    for r in rows:  # samples/s is the step time's, and efficiency is against 1 process at the same setting
        assert int(r["global_batch"]) == int(r["per_rank_batch"]) * int(r["world_size"]) and int(r["params"]) > 0
        samples_per_step = int(r["global_batch"]) * int(r["accumulate"])
        assert float(r["samples_per_s"]) == pytest.approx(samples_per_step / float(r["step_ms"]) * 1e3, rel=1e-4), r
        base = single[r["experiment"], r["model"], r["per_rank_batch"], r["accumulate"]]
        assert float(r["efficiency"]) == pytest.approx(float(r["samples_per_s"]) / (int(r["world_size"]) * base),
                                                       rel=1e-4), r
    assert_png(scaling_run.out / "ddp_scaling.png")


def test_ddp_scaling_says_how_it_measured(scaling_run):
    out = scaling_run.stdout
    assert "torch.set_num_threads(1)" in out, "the one-thread-per-process setting is stated"
    # single, independent and ddp per model and batch; the bucket sweep (a single baseline + 3 caps);
    # accumulation (a single baseline, all synced, no_sync).
    n = 3 * 2 * len(BATCHES) + (1 + len(CAPS)) + 3
    progress = re.findall(rf"^\[(\d+)/{n}\] .+ ms/step, 2 blocks of 2 steps$", out, re.M)
    assert progress == [str(i) for i in range(1, n + 1)], "a progress line per configuration"
    assert re.findall(r"^round \d/2 done$", out, re.M) == ["round 1/2 done", "round 2/2 done"]
    assert "efficiency = " in out and "wrote " in out


# --- benchmarks/dp_vs_ddp.py --------------------------------------------------------------------

def test_dp_vs_ddp_needs_gpus_and_says_so(tmp_path):
    import torch
    if torch.cuda.device_count() >= 2:
        pytest.skip("GPUs present: this test checks the message shown without them")
    run = check(run_script("benchmarks/dp_vs_ddp.py", programs=1, out=tmp_path / "dp"))
    assert "needs 2 or more GPUs" in run.stdout and "Nothing measured" in run.stdout, run.describe()
    assert not (tmp_path / "dp").exists() or not any((tmp_path / "dp").iterdir()), "no numbers without GPUs"


# benchmarks/*'s bad values: test_faults.py (every flag of every tool, in this process, and one launched per tool).
@pytest.mark.parametrize(("script", "flags", "flag"), [
    ("collectives/benchmark.py", ["--sizes", "4K,6"], "--sizes"),
    ("collectives/benchmark.py", ["--world-sizes", "1"], "--world-sizes"),
])
def test_bad_flag_is_one_line_and_exit_2(script, flags, flag):
    run = run_script(script, *flags, programs=1)
    assert run.returncode == 2 and run.stdout == "", run.describe()
    assert run.stderr.strip().count("\n") == 0 and flag in run.stderr, run.stderr


# --- benchmarks/rounding.py ---------------------------------------------------------------------

# The README's quick run, with its check against real runs: its files and output are what the test checks.
ROUNDING_EPOCHS, ROUNDING_LRS = 5, (0.05,)
ROUNDING_QUICK = (f"python3 benchmarks/rounding.py --epochs {ROUNDING_EPOCHS} --lrs {','.join(map(str, ROUNDING_LRS))} "
                  f"--check-epochs 2 --out runs/rounding_quick")


@pytest.mark.readme_run(ROUNDING_QUICK)
def test_rounding_measures_drift_and_replay(readme_runs):
    """Stage 01 vs simulated DDP: float64 drifts less than float32, every correct epoch replays within
    sqrt(eps), every broken run is caught (`no set_epoch` from its second epoch: its first is stage 01's)."""
    from tour import tolerance

    run = readme_run(readme_runs, ROUNDING_QUICK)
    columns, rows = columns_and_rows(run.out / "rounding.csv")
    assert columns == ["run", "dtype", "lr", "world_size", "batch_per_rank", "global_batch", "epoch", "steps",
                       "max_dw_end", "max_dw_epoch_max", "replay_error", "tolerance", "train_loss", "batch_flips",
                       "relu_flips", "samples_with_flip", "max_abs_logit"]
    correct = [r for r in rows if not r["run"].startswith("broken")]
    broken = [r for r in rows if r["run"].startswith("broken")]
    assert {(r["dtype"], float(r["lr"])) for r in correct} == {(d, lr) for d in ("float32", "float64")
                                                              for lr in ROUNDING_LRS}
    assert {r["run"] for r in broken} == {"broken: no set_epoch", "broken: global batch b"}
    assert len(correct) == 2 * len(ROUNDING_LRS) * ROUNDING_EPOCHS and len(broken) == 2 * ROUNDING_EPOCHS
    for r in rows:
        assert [int(r["world_size"]), int(r["batch_per_rank"]), int(r["global_batch"])] == [2, 32, 64], r
        assert 1 <= int(r["epoch"]) <= ROUNDING_EPOCHS and float(r["train_loss"]) > 0, r
        assert float(r["tolerance"]) == pytest.approx(tolerance(r["dtype"]), rel=1e-5), r
        assert float(r["replay_error"]) >= 0 and float(r["max_abs_logit"]) > 0, r
    for r in correct:
        assert 0 <= float(r["max_dw_end"]) <= float(r["max_dw_epoch_max"]), r
        assert int(r["relu_flips"]) >= int(r["samples_with_flip"]) >= 0 and int(r["batch_flips"]) >= 0, r
    gap = {(r["dtype"], r["lr"], r["epoch"]): float(r["max_dw_end"]) for r in correct}
    for (dtype, lr, epoch), g in gap.items():
        if dtype == "float64":
            assert 0 <= g < gap["float32", lr, epoch], (lr, epoch, g)
    for r in correct:
        assert float(r["replay_error"]) <= tolerance(r["dtype"]), r
    for r in broken:
        first_epoch_of_stage_01 = r["run"] == "broken: no set_epoch" and r["epoch"] == "1"
        assert (float(r["replay_error"]) <= tolerance(r["dtype"])) if first_epoch_of_stage_01 else \
            (float(r["replay_error"]) > 1e-3), r
    assert_png(run.out / "rounding.png")
    assert "worst replay" in run.stdout and "caught" in run.stdout and "MISSED" not in run.stdout
    assert "FAILS" not in run.stdout and "wrote " in run.stdout


# --- benchmarks/fsdp_memory.py ------------------------------------------------------------------

FSDP_MODES, FSDP_WORLDS = ("ddp", "fsdp", "fsdp_no_reshard"), (1, 2, 4)
# The README's quick run (0.5 M parameters): its files and output are what these tests check.
FSDP_QUICK = "python3 benchmarks/fsdp_memory.py --width 256 --blocks 8 --steps 2 --out runs/fsdp_memory_quick"
from_fsdp_quick = pytest.mark.readme_run(FSDP_QUICK)


@pytest.fixture(scope="module")
def fsdp_memory_run(readme_runs) -> Run:
    return readme_run(readme_runs, FSDP_QUICK)


@from_fsdp_quick
def test_fsdp_memory_writes_every_rank_of_every_configuration(fsdp_memory_run):
    columns, rows = columns_and_rows(fsdp_memory_run.out / "fsdp_memory.csv")
    assert columns == ["mode", "world_size", "rank", "params", "blocks", "width", "batch", "steps", "param_bytes",
                       "unit_bytes", "rss_before_bytes", "peak_rss_bytes", "model_rss_bytes", "state_bytes",
                       "theory_state_bytes", "state_vs_theory", "theory_peak_bytes", "step_s"]
    keys = [(r["mode"], int(r["world_size"]), int(r["rank"])) for r in rows]
    assert sorted(keys) == sorted((m, w, rank) for m in FSDP_MODES for w in FSDP_WORLDS for rank in range(w))
    for r in rows:
        assert int(r["params"]) == 8 * (256 * 256 + 256) and int(r["param_bytes"]) == 4 * int(r["params"]), r
        assert int(r["unit_bytes"]) * 8 == int(r["param_bytes"]), r
        for col in ("rss_before_bytes", "peak_rss_bytes", "model_rss_bytes", "state_bytes", "theory_state_bytes",
                    "theory_peak_bytes", "step_s"):
            assert float(r[col]) > 0, (col, r)
        assert int(r["model_rss_bytes"]) == int(r["peak_rss_bytes"]) - int(r["rss_before_bytes"]), r
    assert_png(fsdp_memory_run.out / "fsdp_memory.png")


@from_fsdp_quick
def test_fsdp_memory_state_per_rank_is_zero3_arithmetic(fsdp_memory_run):
    """FSDP holds 3P/W per rank (parameters, gradients, momentum, all sharded), DDP 3P at every W: counted from
    the tensors each rank holds, so it is exact, not a measurement with noise."""
    _, rows = columns_and_rows(fsdp_memory_run.out / "fsdp_memory.csv")
    p = 8 * (256 * 256 + 256) * 4
    state: dict[tuple[str, int], set[int]] = {}
    for r in rows:
        mode, w, held = r["mode"], int(r["world_size"]), int(r["state_bytes"])
        expected = 3 * p if mode == "ddp" else 3 * p // w
        assert int(r["theory_state_bytes"]) == expected, r
        assert held == pytest.approx(expected, rel=0.10), r  # the target
        assert held == expected and float(r["state_vs_theory"]) == 1.0, r  # and in fact exact
        state.setdefault((mode, w), set()).add(held)
    assert all(len(v) == 1 for v in state.values()), f"ranks of one configuration hold different amounts: {state}"
    for mode in FSDP_MODES:
        held = [state[mode, w].pop() for w in FSDP_WORLDS]
        if mode == "ddp":
            assert held == [3 * p] * len(FSDP_WORLDS), held  # flat: every rank a whole replica
        else:
            assert held[0] > held[1] > held[2], (mode, held)  # falls with W


@from_fsdp_quick
def test_fsdp_memory_prints_progress_and_a_table(fsdp_memory_run):
    out = fsdp_memory_run.stdout
    assert "one torchrun job of 4" in out and "OMP_NUM_THREADS=1" in out
    progress = re.findall(r"^W=(\d) (\S+) +peak RSS +[\d,]+ MB/rank .+ s/step$", out, re.M)
    assert progress == [(str(w), m) for w in FSDP_WORLDS for m in FSDP_MODES], "a progress line per configuration"
    table = out.split("state/theory", 1)[1]
    lines = re.findall(r"^(ddp|fsdp|fsdp_no_reshard) +(\d) .+ 1\.0000 +[\d.]+$", table, re.M)
    assert lines == [(m, str(w)) for m in FSDP_MODES for w in FSDP_WORLDS], table
    assert "wrote " in out



# --- benchmarks/vs_nanogpt.py -------------------------------------------------------------------

NANOGPT = ROOT.parent / "nanoGPT"  # the script's default: a checkout beside the repository (never downloaded)


def test_nanogpt_trains_and_is_scored_on_11s_split(tmp_path):
    """The data made for nanoGPT is 11_gpt's corpus: the same ids, the first 90% to train on, the rest held out."""
    import numpy as np
    vs, gpt = load_copy(ROOT / "benchmarks" / "vs_nanogpt.py"), load_stage("11_gpt")
    corpus = gpt.load_corpus(gpt.DATA)
    vs.prepare_nanogpt_data(gpt.DATA.read_text(encoding="utf-8"), tmp_path)
    train, held = (np.fromfile(tmp_path / f"{name}.bin", dtype=np.uint16) for name in ("train", "val"))
    assert train.tolist() == corpus.train.tolist() and held.tolist() == corpus.held_out.tolist()


@pytest.mark.skipif(not (NANOGPT / "train.py").is_file(),
                    reason=f"no nanoGPT checkout at {NANOGPT}: nothing downloads it (benchmarks/README.md)")
def test_vs_nanogpt_quick_run_scores_both_models(tmp_path):
    """20 steps each: the table, and the one scoring function gives 11_gpt's model the loss 11_gpt printed."""
    # The script, then nanoGPT's train.py, then 11_gpt's torchrun (its agent and 2 ranks)
    run = check(run_script("benchmarks/vs_nanogpt.py", "--quick", programs=5, out=tmp_path))
    rows = {r["run"]: r for r in json.loads((tmp_path / "vs_nanogpt.json").read_text())["rows"]}
    assert set(rows) == {"nanoGPT", "11_gpt"} and "held-out loss" in run.stdout, run.describe()
    assert abs(rows["11_gpt"]["held_out_loss"] - rows["11_gpt"]["own_estimate"]) < 1e-4, rows
    assert rows["nanoGPT"]["context"] == 64 and rows["nanoGPT"]["tokens"] == 20 * 12 * 64, rows
    assert (tmp_path / "vs_nanogpt.png").stat().st_size > 0


def test_the_curves_are_read_from_both_logs():
    """The figure's curves: nanoGPT's per-iteration lines (its evaluation lines skipped) in means of 50 iterations at
    their summed times; 11_gpt's log intervals at the seconds their tokens/s imply (which add up to its training
    time)."""
    vs = load_copy(ROOT / "benchmarks" / "vs_nanogpt.py")
    log = "step 0: train loss 4.2, val loss 4.2\n" + "".join(
        f"iter {i}: loss {3 - i / 100:.4f}, time {10 + i % 2}.00ms, mfu -100.00%\n" for i in range(120))
    points = vs.nanogpt_curve(log)
    assert [round(t, 6) for t, _ in points] == [0.525, 1.05]  # 25 iterations of 10 ms and 25 of 11 in each 50
    assert points[0][1] == pytest.approx(3 - 24.5 / 100) and points[1][1] == pytest.approx(3 - 74.5 / 100)
    summary = {"global_batch": 4, "model": {"context": 8}, "curve": [[10, 2.5, 2.6, 320.0], [30, 2.0, 2.1, 640.0]]}
    assert vs.our_curve(summary) == [(1.0, 2.5), (2.0, 2.0)]
