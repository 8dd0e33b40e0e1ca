# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 01: one device
#
# Every later stage is measured against this one. A small MLP learns a synthetic task on one
# device (a GPU if one is visible, else the CPU). The task has a known answer: 8 Gaussian features,
# and the label is the argmax of a fixed random linear map of them. So the loss can really fall,
# and the held-out accuracy says whether the model learned.
#
# The later stages split the same work over several processes, machines or devices. They use the
# same data, the same initial weights and the same order of samples, so with the same *global*
# batch they must end at the weights this stage reaches. This notebook makes that reference.
#
# How the notebooks work: each one runs the stage's real `train.py` in a subprocess, as you would in
# a terminal, with small settings, and reads the `summary.json` that `--out DIR` writes. The helper
# module `nbtools.py`, next to the notebooks, prints each command (as typed at the repository's
# root), runs it under a time limit and raises if it fails. Open the notebooks from `notebooks/`
# (Jupyter and VS Code start the kernel there).

# %%
import json

import nbtools as nb

cfg = nb.setup()

# %% [markdown]
# ## What is in the script
#
# There is no previous stage to compare with, so here is the map of `01_single_gpu/train.py`. The
# pieces to remember: `make_data` (the task), `Net` (two halves, `body` and `head`, which stage 07
# puts on two devices), the `Trainer` loop, and `evaluate`, which returns *sums* (loss, correct,
# count) rather than means, because sums can be added across processes in stage 03.

# %%
nb.show_outline("01_single_gpu")

# %% [markdown]
# ## Run it
#
# Batch 64, 5 epochs, in float64, as the tour runs it (the script's default is 20 epochs). The script prints one
# line per epoch and the held-out result, and writes three files into the `--out` directory:
# `summary.json`, `model.pt`, and `trajectory.pt`, the weights and SGD momentum at the start and after
# every epoch. The later notebooks replay each epoch of a stage's run from that file with this stage's
# code (the "epoch replay" column of their tables). Only `--out` records it (the `Trajectory` below the
# lesson's end, which `Trainer.train` calls after each epoch): a run without `--out` copies nothing.

# %%
ref = nb.reference(cfg, quiet=False)  # the run the later notebooks compare with (nbtools.reference)

# %% [markdown]
# The summary is plain JSON: per-epoch mean training loss (`losses`), the held-out loss and
# accuracy over all 1001 held-out samples, the number of optimizer `steps`, timings, and the flags.

# %%
summary = json.loads((ref.out / "summary.json").read_text())
{k: v for k, v in summary.items() if k != "losses"}

# %% [markdown]
# ## Same settings, same weights; another batch, other weights
#
# Everything random comes from `--seed`: the data, the initial weights (`torch.manual_seed` before
# the model is built) and the shuffle (its own generator, reseeded with `seed + epoch`). Run the
# same command again and the weights are equal bit for bit. Change the batch size and the run takes
# other steps and ends elsewhere. That is why the later stages must keep the *global* batch: the
# number of processes may change, the global batch may not.

# %%
again = nb.run(cfg.step("01_single_gpu"), "01_batch64_again", quiet=True, reuse=False)  # really run again
batch32 = nb.run(nb.with_args(cfg.step("01_single_gpu"), batch_size=32), "01_batch32", quiet=True)
diffs = nb.compare(ref, {"01 again, batch 64": again, "01, batch 32": batch32})
assert diffs["01 again, batch 64"] == 0.0, "the same command gave other weights"
assert diffs["01, batch 32"] > 1e-3, "another batch size should end at other weights"

# %% [markdown]
# ## The result
#
# The loss falls from about 0.6 to below 0.1 within a few epochs and ends near 0.05; the held-out
# accuracy ends near 97%. The rerun lies exactly on the reference curve; batch 32 takes twice as many
# steps per epoch and follows a curve of its own.

# %%
nb.plot_runs(ref, {"01 again, batch 64": again, "01, batch 32": batch32}, "stage 01", ref_label="01, batch 64")

# %% [markdown]
# Next, [02_dataparallel](02_dataparallel.ipynb): the same model on several GPUs in one process.
