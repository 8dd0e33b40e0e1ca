# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 07: a model split over two devices, inside DDP
#
# Every stage so far kept a whole copy of the model on each device. When one copy does not fit on
# one GPU, split it: each process puts the first half of the network on one GPU and the second
# half on another, and `forward` carries the activations across. This is model parallelism, and it
# combines with DDP without changing DDP at all: the processes still each hold one (now two-device)
# replica, and DDP still averages the gradients of all its parameters.

# %%
import inspect

import matplotlib.pyplot as plt
import nbtools as nb
import torch

cfg = nb.setup()

# %% [markdown]
# ## The picture
#
# Two processes, each owning two GPUs: local rank `r` puts `body` on `cuda:2r` and `head` on
# `cuda:2r+1`. Within a process, activations go forward across the split and gradients come back the
# same way (autograd does that by itself). Between the processes, DDP all-reduces the gradients of
# both halves, exactly as before.

# %%
fig, ax = plt.subplots(figsize=(11, 3.6))
for proc in range(2):
    x0 = proc * 5.6
    ax.add_patch(plt.Rectangle((x0, 0.2), 5.0, 2.6, fill=False, ls="--", color="0.5"))
    ax.text(x0 + 2.5, 2.6, f"process {proc} (local rank {proc})", ha="center", fontsize=10)
    for half, (name, color) in enumerate([("body", "C0"), ("head", "C1")]):
        bx = x0 + 0.9 + 2.3 * half
        ax.add_patch(plt.Rectangle((bx, 1.0), 1.6, 1.1, color=color, alpha=0.85))
        ax.text(bx + 0.8, 1.55, f"{name}\ncuda:{2 * proc + half}", ha="center", va="center", color="white",
                fontsize=10)
    ax.annotate("", (x0 + 0.9, 1.75), (x0 + 0.2, 1.75), arrowprops={"arrowstyle": "->"})
    ax.text(x0 + 0.45, 1.9, "x", ha="center")
    ax.annotate("", (x0 + 3.2, 1.75), (x0 + 2.5, 1.75), arrowprops={"arrowstyle": "->", "color": "k"})
    ax.annotate("", (x0 + 2.5, 1.3), (x0 + 3.2, 1.3), arrowprops={"arrowstyle": "->", "color": "C3"})
    ax.text(x0 + 2.85, 2.2, "activations", ha="center", fontsize=8)
    ax.text(x0 + 2.85, 0.75, "gradients", ha="center", fontsize=8, color="C3")
    ax.annotate("", (x0 + 5.0, 1.55), (x0 + 4.8, 1.55), arrowprops={"arrowstyle": "->"})
for half in (0, 1):
    ax.annotate("", (5.6 + 1.7 + 2.3 * half, 1.0), (1.7 + 2.3 * half, 1.0),
                arrowprops={"arrowstyle": "<->", "color": "C2", "connectionstyle": f"arc3,rad={0.25 + 0.1 * half}"})
ax.text(5.3, -0.35, "DDP all-reduces the gradients of both halves across the processes", ha="center", color="C2")
ax.set(xlim=(-0.2, 10.8), ylim=(-0.6, 3.0), xticks=[], yticks=[])
ax.spines[:].set_visible(False)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## The split model
#
# `ModelParallelNet` is stage 01's `Net` with its two halves moved to two devices: the same layers, so
# the same initial weights and the same `state_dict` keys. Stage 01's weights and stage 06's
# snapshots load into it unchanged. Its `forward` is the whole idea:

# %%
s01, s07 = nb.load_stage("01_single_gpu"), nb.load_stage("07_model_parallel")
print(inspect.getsource(s07.ModelParallelNet.forward))
devices = (torch.device("cuda", 0), torch.device("cuda", 1)) if cfg.gpus >= 2 else (torch.device("cpu"),) * 2
torch.manual_seed(0)
split = s07.ModelParallelNet(*devices)
torch.manual_seed(0)
whole = s01.Net()
for name, p in split.named_parameters():
    print(f"{name:15} {str(tuple(p.shape)):9} on {p.device}")
x = torch.randn(5, 8)
assert split.state_dict().keys() == whole.state_dict().keys()
assert torch.allclose(split(x).cpu(), whole(x), atol=1e-5), "the split model computes something else"
print(f"same keys, same outputs as stage 01's Net; the output comes out on {split(x).device}")

# %% [markdown]
# On the CPU, "two devices" are the same CPU: the `.to()` calls do nothing, but every line of the
# code runs as it would on GPUs. That proves the bookkeeping (same weights as stage 01), not the speed.
#
# ## What changed from stage 06
#
# The new class; devices *computed* from the local rank (`cuda:2r`, `cuda:2r+1`), never hard-coded;
# `DDP(model)` **without** `device_ids`, because those would tell DDP to move inputs and outputs to one
# device, which is wrong for a module that spans two; labels and metrics on the second device, where
# the outputs come out; and `--nproc_per_node` checked against *half* the GPU count.

# %%
nb.show_diff("06_checkpoint", "07_model_parallel")

# %% [markdown]
# ## Run it
#
# On the CPU: two processes of batch 32, each "splitting" its model over the CPU. With GPUs, each
# process needs two of them, so the plan makes the world size of 2 into one process of batch 64 whose
# model spans `cuda:0` and `cuda:1`: the same global batch. (With four GPUs and
# `--nproc_per_node=2`, it would be two processes of two GPUs each, as in the picture.)

# %%
ref = nb.reference(cfg)
mp_run = nb.run(cfg.step("07_model_parallel"), "07_model_parallel")

# %% [markdown]
# ## Same weights as stage 01, once more
#
# Seven stages, one set of weights: one device, several GPUs in one process, processes started by
# `mp.spawn` or `torchrun`, several nodes, a stop and a resume, and a model cut in two. Only the way
# the work is split changed.

# %%
label = f"07, {mp_run.summary['world_size']} process(es), model split"
diffs = nb.compare(ref, {label: mp_run})
assert max(diffs.values()) <= nb.ATOL, diffs
nb.plot_runs(ref, {label: mp_run}, "07 over 01: one curve", ref_label="01, 1 × 64")
