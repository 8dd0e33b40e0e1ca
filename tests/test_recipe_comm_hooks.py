"""Recipe comm_hooks: DDP communication hooks (fp16 compression, PowerSGD), with the bytes they send measured.

Claims, on 2 ranks x 32 in float64 (5 epochs; stage 01's trajectory gives its weights after epoch 5):
- the bytes each step hands to all-reduce, as the recipe MEASURES them (a dispatch mode on c10d ops, see
  CommBytes), equal what the hook is documented to send, computed here from the model's shapes: fp16 sends
  2 bytes per gradient element (a quarter of float64's 8; half of float32's 4); PowerSGD sends, after its
  plain all-reduce warm-up steps, (n + m)·r numbers per n x m matrix it compresses and every other tensor whole;
- the model still learns (held-out accuracy within 1 point of stage 01's after as many epochs, loss down 5x);
- the training is no longer stage 01's (lossy): the epoch replay is off by far more than rounding;
- the replicas stay identical (every rank applies the same decompressed gradient).
"""
from __future__ import annotations

import pytest
import torch

from conftest import readme_run
from harness import Run, load_stage, max_gap, replay_error, tolerance

RECIPE = "recipes/comm_hooks"
W, B, EPOCHS, RANK = 2, 32, 5, 2  # global batch 64: stage 01's in runs["01"]
# The README's two lossy runs: the tests read what they made (conftest.readme_run) rather than launch them again.
RUN = f"torchrun --standalone --nproc_per_node={W} {RECIPE}/train.py --dtype float64 --batch-size {B} --epochs {EPOCHS}"
FP16_RUN = f"{RUN} --hook fp16 --out runs/fp16"
POWERSGD_RUN = f"{RUN} --hook powersgd --powersgd-rank {RANK} --out runs/powersgd"
pytestmark = pytest.mark.readme_run(FP16_RUN, POWERSGD_RUN)
FLOAT64, FP16 = torch.float64.itemsize, torch.float16.itemsize
MIN_COMPRESSION_RATE = 2  # PowerSGDState's default: compress only when n*m > 2 * (n + m) * r (torch docs)
LOSSY = 1e3 * tolerance("float64")  # a replay error this large is not rounding (that is ~1e-15 here)


@pytest.fixture(scope="module")
def fp16(readme_runs) -> Run:
    return readme_run(readme_runs, FP16_RUN)


@pytest.fixture(scope="module")
def powersgd(readme_runs) -> Run:
    return readme_run(readme_runs, POWERSGD_RUN)


def shapes() -> list[torch.Size]:
    return [p.shape for p in load_stage("01_single_gpu").Net().parameters()]


def elements() -> int:
    return sum(s.numel() for s in shapes())


def powersgd_elements(rank: int) -> int:
    """What PowerSGD all-reduces per step after its warm-up, from the docs: each n x m matrix (a tensor seen as
    shape[0] x the rest) as P (n x r) and Q (m x r), r = min(n, m, rank), if that compresses it more than
    MIN_COMPRESSION_RATE times; otherwise, and for every 1-D tensor, the tensor itself."""
    total = 0
    for shape in shapes():
        n, m = shape[0], shape.numel() // shape[0]
        r = min(n, m, rank)
        total += (n + m) * r if len(shape) > 1 and (n + m) * r * MIN_COMPRESSION_RATE < n * m else n * m
    return total


def allreduce_per_step(run: Run) -> list[tuple[int, int]]:
    """[(calls, bytes)] of all_reduce for every step, from the recipe's run-length coded record."""
    per_step = []
    for block in run.summary["comm_bytes"]:
        assert block["first_step"] == len(per_step) + 1
        per_step += [tuple(block["per_step"]["c10d::allreduce_"])] * block["steps"]
    assert len(per_step) == run.summary["steps"], "the record must cover every step"
    return per_step


def test_fp16_sends_2_bytes_per_gradient_element(fp16, powersgd):
    uncompressed = allreduce_per_step(powersgd)[0]  # PowerSGD's first step is a plain all-reduce: DDP's own
    assert uncompressed == (1, elements() * FLOAT64) == (1, fp16.summary["grad_bytes"])
    per_step = allreduce_per_step(fp16)
    assert set(per_step) == {(1, elements() * FP16)}, f"all-reduce (calls, bytes) per step: {set(per_step)}"
    assert per_step[0][1] / uncompressed[1] == FP16 / FLOAT64  # a quarter in float64 (a half in float32)


def test_powersgd_sends_the_low_rank_factors_after_its_warm_up(powersgd):
    s = powersgd.summary
    per_step = allreduce_per_step(powersgd)
    warm_up, compressed = per_step[:s["powersgd_start"]], per_step[s["powersgd_start"]:]
    assert set(warm_up) == {(1, elements() * FLOAT64)}
    # One bucket, three all-reduces: the uncompressed tensors, then the Ps, then the Qs.
    assert set(compressed) == {(3, powersgd_elements(RANK) * FLOAT64)}, f"measured: {set(compressed)}"
    # The fallback matters here: at rank 2 the 4 x 64 output layer would not shrink 2x, so it is sent whole.
    assert powersgd_elements(RANK) != sum((s[0] + s[1]) * RANK if len(s) > 1 else s[0] for s in shapes())


def accuracy(params: list[torch.Tensor]) -> float:
    """Held-out accuracy of a model with these weights, with stage 01's own code."""
    s01 = load_stage("01_single_gpu")
    model = s01.Net().to(torch.float64)
    with torch.no_grad():
        for p, w in zip(model.parameters(), params, strict=True):
            p.copy_(w)
    _, eval_set = s01.make_data(0, torch.float64)
    _, correct, count = s01.evaluate(model, eval_set, torch.device("cpu"))
    return correct / count


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_still_learns_but_is_not_stage_01s_training(request, runs, hook):
    run = request.getfixturevalue(hook)
    s, reference = run.summary, runs["01"].trajectory[EPOCHS]["params"]  # stage 01 after as many epochs
    assert s["global_batch"] == runs["01"].summary["global_batch"] and s["dtype"] == "float64"
    assert s["losses"][0] / s["losses"][-1] >= 5
    assert s["eval_accuracy"] >= accuracy(reference) - 0.01
    assert s["replica_max_abs_diff"] == 0.0  # every rank applied the same (decompressed) gradient
    replay, final = replay_error(s, run.trajectory), max_gap(list(run.model.values()), reference)
    assert replay > LOSSY and final > LOSSY, f"replay {replay:.2e}, final |Δw| vs 01 {final:.2e}"

