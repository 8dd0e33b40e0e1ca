"""The GPU paths, in one command: `pytest -m gpu` on a machine with GPUs (skipped elsewhere, with the reason).

Every stage runs as the tour runs it (tour.plan, float64, its launchers, each launch bounded in time, no fixed
port) and is checked as the tour checks it: each epoch replays with stage 01's code (on the CPU) to sqrt(eps),
and it ends at the weights of stage 01 run on the same GPU. float64 rounds ~1e-16 on GPUs too, so the CPU's
tolerance holds.
- one GPU (the first, alone visible): the single-process runs, and 03-10 as one process on it (DDP and
  FSDP on nccl, 07 with both halves of the model on it); float16 autocast with a GradScaler;
- stages 11 and 12 (a tiny GPT): their training steps after the first two under torch.cuda.set_sync_debug_mode
  ("error"), so that a step that waits for the GPU fails (tests/sync_debug_step.py; 12's cp 2 on two GPUs), and
  a step of each one's model on one GPU, 12's ring and all-gather through a fake process group, without a tensor
  on the host (tests/host_copies.py, which the suite runs on the meta device);
- two or more: the same with W processes (W = 2, or 4 with 4 or more GPUs; the first W visible), nccl;
  02's DataParallel split over the W GPUs; 07 with two GPUs per process; SyncBatchNorm; the DataParallel
  vs DDP benchmark at a small setting.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import sys

import pytest
import torch

from harness import ROOT, Run, Step, assert_same_training, check, launch, max_abs_diff, plan, run_command, tolerance

GPUS = torch.cuda.device_count()
NO_GPU = "no GPU visible (torch.cuda.device_count() == 0): run `pytest -m gpu` on a machine with GPUs"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason=NO_GPU)]
needs_two = pytest.mark.skipif(GPUS < 2, reason=NO_GPU if GPUS == 0 else "needs 2 or more GPUs, found 1")
# W = 3 is left out: 4096 samples are not a multiple of the global batch 96, and DistributedSampler pads the
# last step with repeated samples, which one process does not do.
W = 4 if GPUS >= 4 else 2  # processes of the multi-GPU runs (shown, and skipped, with fewer than 2 GPUs)
B = 32  # per-process batch, as in the tour
TIMEOUT = 300.0  # seconds one launch may take (the tour's default)


def gpu_steps(n: int) -> list[Step]:
    """The tour's plan with every run on the GPUs: n processes of batch B (nccl), or for n = 1 each run as one
    process of batch 2B on the one GPU. (plan(gpus=1) is the tour's choice there: its W = 2 runs as CPU processes;
    gpus=0 with --device cuda keeps every run on cuda, and at world size 1 each is one process.)"""
    return plan(1, 2 * B, device="cuda", gpus=0) if n == 1 else plan(n, B, device="cuda", gpus=n)


def visible(n: int) -> dict[str, str]:
    """The environment that shows the runs only the first n GPUs (DataParallel uses every GPU it sees)."""
    ids = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(GPUS)))).split(",")
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids[:n])}


def processes(step: Step) -> int:
    if step.launcher == "torchrun":
        return step.nproc * step.nnodes
    return int(step.args[step.args.index("--world-size") + 1]) if "--world-size" in step.args else 1


def several_gpus(step: Step) -> bool:
    """Whether a run of the multi-GPU plan uses more than one GPU (the others are the one-GPU plan's runs again)."""
    return processes(step) > 1 or step.stage.startswith(("02", "07"))  # DataParallel's split, 07's two per process


CASES = [pytest.param(n, i, id=f"{n}gpu-{s.stage[:2]}-{re.sub(r'[^0-9A-Za-z]+', '-', s.label).strip('-')}",
                      marks=[needs_two] if n > 1 else [])
         for n in (1, W) for i, s in enumerate(gpu_steps(n)) if n == 1 or several_gpus(s)]


@pytest.fixture(scope="module")
def stage01(tmp_path_factory: pytest.TempPathFactory):
    """Stage 01 on the GPU, as gpu_steps(n) runs it first: the reference of that plan, launched once per batch."""
    done: dict[tuple, Run] = {}

    def run(n: int) -> Run:
        step = gpu_steps(n)[0]
        if step.args not in done:
            out = tmp_path_factory.mktemp("01")
            done[step.args] = check(launch(step, out, env=visible(n), timeout=TIMEOUT))
        return done[step.args]
    return run


@pytest.mark.parametrize(("n", "index"), CASES)
def test_stage_on_gpus_computes_stage_01s_training(n, index, stage01, tmp_path):
    step = gpu_steps(n)[index]
    assert step.args[step.args.index("--device") + 1] == "cuda" and "cpu" not in step.args, step
    reference = stage01(n)
    run = reference if index == 0 else check(launch(step, tmp_path, env=visible(n), timeout=TIMEOUT))
    s, distributed = run.summary, step.stage[:2] not in ("01", "02")
    assert (s["device"], s["backend"], s["world_size"]) == ("cuda", "nccl" if distributed else None,
                                                            processes(step)), run.describe()
    if step.stage.startswith("02"):
        assert s["data_parallel_gpus"] == n, run.describe()  # DataParallel split every batch over the n GPUs
    if step.stage.startswith("07"):  # two GPUs per process where there are two for each, else both halves on one
        assert f"body on cuda:0, head on cuda:{int(n >= 2 * step.nproc)}" in run.stdout, run.describe()
    assert_same_training(run, reference)


@needs_two
def test_sync_batchnorm_statistics_span_the_global_batch(tmp_path):
    """The recipe's GPU command (its README): 2 ranks x 32 with SyncBatchNorm end where one process of 64 with
    plain BatchNorm (on the CPU) ends, running statistics included; per-rank statistics (--batchnorm local) do not."""
    recipe, common = "recipes/sync_batchnorm", ("--dtype", "float64", "--epochs", "2")
    gpu = (*common, "--device", "cuda", "--batch-size", "32")
    synced, local = (check(launch(Step(recipe, "torchrun", (*gpu, *extra), nproc=2), tmp_path / name,
                                  env=visible(2), timeout=TIMEOUT))
                     for name, extra in (("sync", ()), ("local", ("--batchnorm", "local"))))
    one = check(launch(Step(recipe, "python", (*common, "--device", "cpu", "--batch-size", "64", "--batchnorm",
                                               "local")), tmp_path / "one", timeout=TIMEOUT))
    assert (synced.summary["batchnorm"], synced.summary["backend"], one.summary["batchnorm"]) == \
        ("SyncBatchNorm", "nccl", "BatchNorm1d")
    assert synced.summary["global_batch"] == one.summary["global_batch"] == 64
    gap = max_abs_diff(synced.model, one.model)  # the weights and the layer's running mean and variance
    assert gap <= tolerance("float64"), f"SyncBatchNorm 2 x 32 vs one process of 64: {gap:.2e}"
    stats = ("body.1.running_mean", "body.1.running_var")
    per_rank = max(max_abs_diff({k: local.model[k]}, {k: one.model[k]}) for k in stats)
    assert per_rank > 1e-3, f"per-rank BatchNorm's running statistics within {per_rank:.2e} of the global batch's"


def test_float16_with_grad_scaler_learns_as_stage_01(stage01, tmp_path):
    """recipes/mixed_precision's GPU recipe at global batch 64 (2 processes, or 1 on one GPU): a float16 forward,
    float32 gradients, the scaler's scale kept finite, and the loss and accuracy of stage 01 (float64, on the GPU)
    within the margins tests/test_recipe_mixed_precision.py measured for bfloat16 (float16 rounds 8x finer)."""
    n = min(2, GPUS)
    ref = stage01(1).summary  # the tour's epochs: the recipe runs as many (its margins hold in every epoch)
    step = Step("recipes/mixed_precision", "torchrun", ("--device", "cuda", "--batch-size", str(2 * B // n),
                                                         "--autocast", "float16", "--clip-grad-norm", "1",
                                                         "--epochs", str(ref["epochs"])), nproc=n)
    s = check(launch(step, tmp_path, env=visible(n), timeout=TIMEOUT)).summary
    assert s["autocast_dtypes"] == {"logits": "torch.float16", "loss": "torch.float32", "grads": ["torch.float32"]}
    assert (s["backend"], s["global_batch"], s["replica_max_abs_diff"]) == ("nccl", ref["global_batch"], 0.0)
    assert math.isfinite(s["grad_scale"]) and s["grad_scale"] >= 1
    gaps = [abs(a - b) for a, b in zip(s["losses"], ref["losses"], strict=True)]
    assert max(gaps) <= 0.07, f"per-epoch train loss {max(gaps):.4f} from stage 01's: {gaps}"
    assert abs(s["eval_accuracy"] - ref["eval_accuracy"]) <= 0.015, (s["eval_accuracy"], ref["eval_accuracy"])


@needs_two
def test_dataparallel_vs_ddp_benchmark_writes_its_table(tmp_path):
    out = tmp_path / "dp_vs_ddp"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "dp_vs_ddp.py"), "--gpus", str(W), "--batch-size", str(B),
           "--epochs", "1", "--out", str(out)]
    run = check(run_command(cmd, timeout=TIMEOUT))
    with open(out / "dp_vs_ddp.csv", newline="") as f:
        table = csv.DictReader(f)
        header, rows = table.fieldnames, list(table)
    assert header == ["stage", "launcher", "processes", "gpus", "per_process_batch", "global_batch", "epochs",
                      "samples_per_s", "vs_dataparallel", "wall_s"], run.describe()
    assert [(r["stage"], int(r["processes"]), int(r["gpus"]), int(r["global_batch"])) for r in rows] == \
        [("02_dataparallel", 1, W, W * B), ("03_ddp_spawn", W, W, W * B), ("04_ddp_torchrun", W, W, W * B)]
    # The rates are the runs' own: each stage's training, at the rate it reports (4096 samples an epoch), took less
    # than its wall time (start-up included); vs DP is the ratio of the rates; the table printed is the CSV's.
    for r in rows:
        rate = float(r["samples_per_s"])
        assert 0 < int(r["epochs"]) * 4096 / rate < float(r["wall_s"]), r
        assert float(r["vs_dataparallel"]) == pytest.approx(rate / float(rows[0]["samples_per_s"]), rel=1e-5), r
        printed = re.search(rf"^{r['stage']} .* ([\d,]+) +([\d.]+)x$", run.stdout, re.M)
        assert printed, (r, run.stdout)
        assert float(printed[1].replace(",", "")) == pytest.approx(rate, rel=1e-5, abs=1), (printed[0], r)
        assert float(printed[2]) == pytest.approx(float(r["vs_dataparallel"]), abs=0.006), (printed[0], r)
    assert (out / "dp_vs_ddp.png").stat().st_size > 0


# A tiny GPT, 6 steps: 2 to warm up, then 4 under set_sync_debug_mode("error").
GPT_TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24", "--max-steps", "6", "--eval-every",
            "6", "--sample", "0", "--device", "cuda")


@pytest.mark.parametrize(("stage", "nproc", "args"), [
    pytest.param("11_gpt", 1, (), id="11"),
    pytest.param("12_context_parallel", 2, ("--cp", "2"), marks=needs_two, id="12-cp2-ring"),
    pytest.param("12_context_parallel", 2, ("--cp", "2", "--cp-impl", "allgather"), marks=needs_two,
                 id="12-cp2-allgather")])
def test_a_gpt_training_step_never_waits_for_the_gpu(stage, nproc, args):
    """A copy from ordinary host memory, a mask made on the CPU, an .item() in the step: each would raise."""
    step = Step(stage, "torchrun", (stage, *GPT_TINY, *args), nproc=nproc)  # the driver takes the stage first
    run = check(launch(step, script=ROOT / "tests" / "sync_debug_step.py", env=visible(nproc), timeout=TIMEOUT))
    assert run.stdout.count("ran under set_sync_debug_mode('error')") == 4, run.describe()


def test_a_gpt_step_on_the_gpu_makes_nothing_on_the_host():
    """tests/host_copies.py on the GPU: 11's and 12's models, two steps each, no operation on a host tensor (scalars
    taken by value apart) and no waiting (set_sync_debug_mode("error")); its planted controls seen."""
    from host_copies import problems
    run = check(run_command([sys.executable, str(ROOT / "tests" / "host_copies.py"), "--device", "cuda"],
                            env=visible(1), timeout=TIMEOUT))
    report = json.loads(run.stdout)
    assert report["device"].startswith("cuda") and not problems(report), problems(report)
