"""Recipe ddp_options: DDP(static_graph=True, gradient_as_bucket_view=True).

Claims, with both flags on (one launch, 2 ranks x 32, float64, the tour's epochs: runs["01"]'s settings):
- the training is still stage 01's at the global batch (epoch replay and final weights within sqrt(eps));
- the gradients live in DDP's bucket: after a step every .grad is a view into one storage, as large as all
  the gradients together and as DDP's buckets, instead of a tensor of its own (the memory saved is the
  gradients' size);
- with stage 04's zero_grad(set_to_none=True), backward still writes each gradient to a fresh tensor,
  which DDP copies into the bucket (torch's docs: the view "is destroyed every iteration").
"""
from __future__ import annotations

import pytest

from harness import Run, Step, assert_same_training, check, gradient_bytes, launch
from tour import EPOCHS

RECIPE = "recipes/ddp_options"
W, B = 2, 32  # global batch 64: stage 01's in runs["01"]
ARGS = ("--device", "cpu", "--dtype", "float64", "--batch-size", str(B), "--epochs", str(EPOCHS), "--static-graph",
        "--gradient-as-bucket-view")


@pytest.fixture(scope="module")
def both(tmp_path_factory) -> Run:
    return check(launch(Step(RECIPE, "torchrun", ARGS, nproc=W), out=tmp_path_factory.mktemp("both")))


def test_both_options_compute_stage_01s_training(runs, both):
    s, ref = both.summary, runs["01"].summary
    assert s["static_graph"] and s["gradient_as_bucket_view"] and s["global_batch"] == ref["global_batch"]
    assert_same_training(both, runs["01"])
    assert s["losses"] == pytest.approx(ref["losses"], rel=1e-9)
    assert s["eval_accuracy"] == ref["eval_accuracy"]


def test_gradients_are_views_into_ddps_bucket(both):
    g = both.summary["grad_memory"]
    grad_bytes = gradient_bytes()  # from the model, not from the run
    assert g["grad_bytes"] == grad_bytes == g["ddp_bucket_bytes"]
    # One storage holds all the gradients (without the flag: one per parameter, plus DDP's bucket beside them).
    assert (g["storages_after_step"], g["storage_bytes_after_step"]) == (1, grad_bytes), g
    # set_to_none=True: autograd writes every gradient to a new tensor; DDP copies it in and re-points .grad.
    assert g["written_in_place"] == 0, g
