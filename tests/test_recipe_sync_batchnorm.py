"""Recipe sync_batchnorm: BatchNorm statistics over the global batch (GPUs only in torch).

Claims:
- on the CPU the script refuses in one line, and the reason it gives is torch's: the conversion itself works,
  DDP's constructor refuses the module ("SyncBatchNorm layers only work with GPU modules"), and a training
  forward of it refuses CPU input even without DDP (checked in process, no launch);
- on 2+ GPUs (skipped elsewhere): 2 ranks of 32 with SyncBatchNorm compute one process's training at batch 64,
  running statistics included (so the running mean is that of the global batch, not of each rank's 32), and
  without the conversion (--batchnorm local) they do not.
"""
from __future__ import annotations

import argparse
import contextlib
import io

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import Step, check, group_of_one, launch, load_stage, max_abs_diff, tolerance

RECIPE = "recipes/sync_batchnorm"
CPU_REASON = "SyncBatchNorm layers only work with GPU modules"  # torch's words, quoted by the refusal


@pytest.mark.parametrize("argv", [["--device", "cpu"], *([[]] if not torch.cuda.is_available() else [])])
def test_refuses_the_cpu_in_one_line(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        load_stage(RECIPE).parse_args(argv)
    lines = err.getvalue().strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{RECIPE}/train.py: error: argument --device: SyncBatchNorm runs on GPUs only")
    assert CPU_REASON in lines[0] and "--batchnorm local" in lines[0]
    assert load_stage(RECIPE).parse_args([*argv, "--batchnorm", "local"]).batchnorm == "local"  # which runs there




def recipe_model(batchnorm: str) -> nn.Module:
    recipe = load_stage(RECIPE)
    args = argparse.Namespace(seed=0, lr=0.05, dtype="float32", batchnorm=batchnorm)
    cpu = torch.device("cpu")
    return recipe.with_batchnorm(recipe.load_train_objs(args, cpu)[2], args, cpu)


def test_on_the_cpu_ddp_refuses_the_converted_model():
    """Where torch refuses: not at the conversion (done here), but in DDP()'s constructor, and in a training
    forward (which checks the input's device before it looks at the world size, so even a group of one fails)."""
    model = recipe_model("sync")
    assert isinstance(model.body[1], nn.SyncBatchNorm)
    x = torch.randn(8, load_stage(RECIPE).N_FEATURES)
    with group_of_one():
        with pytest.raises(ValueError, match=CPU_REASON):
            DDP(model)
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            model(x)
        DDP(recipe_model("local"))(x)  # control: plain BatchNorm is accepted on the CPU


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="SyncBatchNorm across 2 ranks needs 2 GPUs (nccl)")
def test_statistics_span_the_global_batch(tmp_path):
    """2 ranks of 32 with SyncBatchNorm = one process of 64 (plain BatchNorm, on the CPU), in float64."""
    common = ("--dtype", "float64", "--epochs", "2")
    synced = check(launch(Step(RECIPE, "torchrun", (*common, "--device", "cuda", "--batch-size", "32"), nproc=2),
                          out=tmp_path / "sync"))
    local = check(launch(Step(RECIPE, "torchrun", (*common, "--device", "cuda", "--batch-size", "32",
                                                   "--batchnorm", "local"), nproc=2), out=tmp_path / "local"))
    one = check(launch(Step(RECIPE, "python", (*common, "--device", "cpu", "--batch-size", "64",
                                               "--batchnorm", "local")), out=tmp_path / "one"))
    assert synced.summary["batchnorm"] == "SyncBatchNorm" and one.summary["batchnorm"] == "BatchNorm1d"
    assert synced.summary["global_batch"] == one.summary["global_batch"] == 64
    stats = ["body.1.running_mean", "body.1.running_var"]
    gap = max_abs_diff(synced.model, one.model)  # weights and running statistics
    assert gap <= tolerance("float64"), f"SyncBatchNorm 2 x 32 vs one process of 64: {gap:.2e}"
    # Negative control: per-rank statistics (what DDP does without the conversion) are another training.
    per_rank = max(max_abs_diff({k: local.model[k]}, {k: one.model[k]}) for k in stats)
    assert per_rank > 1e-3, f"per-rank BatchNorm's running statistics within {per_rank:.2e} of the global batch's"
