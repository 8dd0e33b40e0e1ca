# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 03: DistributedDataParallel, one process per device, started by `mp.spawn`
#
# DDP turns stage 02 inside out. Instead of one process that copies the model to every GPU at each
# step, there are `W` processes (ranks), one per device, each with its own full copy of the model
# and its own optimizer. Each rank trains on its share of every global batch. In `backward()`, DDP
# averages the gradients over the ranks, so every rank takes the same optimizer step and the copies
# stay identical. Weights travel once, when `DDP(model)` broadcasts rank 0's to the others; after
# that only gradients do. The script starts its processes itself, with `torch.multiprocessing.spawn`.

# %%
import matplotlib.pyplot as plt
import nbtools as nb
import torch
from torch.utils.data import DistributedSampler, RandomSampler

cfg = nb.setup()

# %% [markdown]
# ## How the gradients are averaged: the ring all-reduce
#
# Averaging means every rank must end with the sum of everyone's gradients (then divide by `W`).
# The obvious design is a **parameter server**: every worker sends its gradient to one server,
# which sums and sends the result back. Drawn here as a **separate server process**: each of the
# `W` workers sends one gradient and receives one, so the server's link carries `2·W` gradients per
# step (`W` in, `W` out), and it gets slower with every worker you add. (`collectives/` implements
# the other common form, **rank 0 as the server**: rank 0 is also a worker, so it receives `W − 1`
# gradients and sends `W − 1`, `2(W − 1)` in all; see `collectives/README.md`.)
#
# A **ring all-reduce** has no centre. The ranks sit in a ring and each talks only to its right
# neighbour. Every gradient is cut into `W` chunks, and it takes two phases of `W − 1` steps:
#
# - **scatter-reduce**: in each step, every rank sends one chunk to its neighbour, which adds it to
#   its own copy of that chunk. After `W − 1` steps, each rank holds one chunk that is complete (the
#   sum over all ranks);
# - **all-gather**: the complete chunks travel round the ring once more, now copied rather than added,
#   until every rank has all of them.
#
# The simulation below does this with 4 ranks, recording for each rank and chunk *whose* gradients
# are summed in it. Each rank sends `2(W − 1)` chunks of size `1/W`: less than two whole gradients,
# however many ranks there are. The last panel compares the busiest node's traffic: the separate
# server's `2·W` gradients against a ring rank's `4(W − 1)/W` (sent plus received). (nccl and gloo
# use rings, trees and other schemes depending on size and topology; the ring is the one that shows
# why the cost stays flat.)

# %%
def ring_allreduce(n: int) -> list[tuple[str, list[list[frozenset]], set]]:
    """Simulate a ring all-reduce of n ranks: per step, which ranks' gradients each (rank, chunk) holds."""
    have = [[frozenset([rank]) for _chunk in range(n)] for rank in range(n)]
    frames = [("start: each rank has only its own", have, set())]
    for phase in ("scatter-reduce", "all-gather"):
        for step in range(n - 1):
            before, have = have, [row[:] for row in have]
            for rank in range(n):
                right = (rank + 1) % n
                # scatter-reduce: rank r passes on chunk r - step; all-gather: its complete chunk r + 1 - step
                chunk = (rank - step) % n if phase == "scatter-reduce" else (rank + 1 - step) % n
                have[right][chunk] = before[right][chunk] | before[rank][chunk] if phase == "scatter-reduce" \
                    else before[rank][chunk]
            frames.append((f"{phase} {step + 1}/{n - 1}", have, {((rank + 1) % n, c) for rank in range(n)
                           for c in range(n) if have[(rank + 1) % n][c] != before[(rank + 1) % n][c]}))
    assert all(chunk == frozenset(range(n)) for row in have for chunk in row), "not every rank has the sum"
    return frames


W_DEMO = 4
frames = ring_allreduce(W_DEMO)
fig, axes = plt.subplots(2, 4, figsize=(13, 6.4))
for ax, (title, have, received) in zip(axes.flat, frames, strict=False):
    ax.imshow([[len(c) for c in row] for row in have], cmap="Blues", vmin=0, vmax=W_DEMO + 1)
    for rank in range(W_DEMO):
        for chunk in range(W_DEMO):
            complete = len(have[rank][chunk]) == W_DEMO
            ax.text(chunk, rank, "all" if complete else "+".join(map(str, sorted(have[rank][chunk]))),
                    ha="center", va="center", fontsize=9, color="white" if complete else "black")
            if (rank, chunk) in received:
                ax.add_patch(plt.Rectangle((chunk - 0.5, rank - 0.5), 1, 1, fill=False, lw=2.5, color="C3"))
    ax.set(title=title, xticks=range(W_DEMO), yticks=range(W_DEMO), xlabel="chunk", ylabel="rank")
workers = range(2, 17)
bx = axes.flat[-1]
bx.plot(workers, [2 * w for w in workers], "o-", label="parameter server: the server")
bx.plot(workers, [4 * (w - 1) / w for w in workers], "s-", label="ring: every rank")
bx.set(xlabel="workers W", ylabel="gradients sent + received per step", title="the busiest node's traffic")
bx.legend(fontsize=8)
fig.suptitle("ring all-reduce, 4 ranks: whose gradients each chunk holds (all = the full sum); red: just received")
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## Why `W` ranks of batch `b` compute what one process computes at batch `W·b`
#
# DDP's averaged gradient is the mean over the ranks of each rank's mean over its `b` samples: the
# mean over the `W·b` samples of the global batch. So if, at every step, the ranks together see
# exactly the samples stage 01 sees at batch `W·b`, they take the same steps. `DistributedSampler`
# makes sure of it: epoch `e` shuffles with `torch.randperm(N, seed + e)`, the permutation stage 01
# uses, and rank `r` takes positions `r, r + W, r + 2W, …` of it. `set_epoch(e)` at the start of each
# epoch selects the permutation; forget it and every epoch repeats epoch 0's order.
#
# Checked here directly, with the samplers of both stages, for one step of one epoch:

# %%
N, W, b, seed, epoch, step = 4096, nb.WORLD, nb.BATCH, 0, 3, 10
order_01 = list(RandomSampler(range(N), generator=torch.Generator().manual_seed(seed + epoch)))
per_rank = []
for rank in range(W):
    sampler = DistributedSampler(range(N), num_replicas=W, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    per_rank.append(list(sampler)[step * b:(step + 1) * b])
    print(f"rank {rank}, step {step}: samples {per_rank[-1][:6]} ...")
print(f"stage 01, step {step} at batch {W * b}: samples {order_01[step * W * b:][:6]} ...")
assert sorted(sum(per_rank, [])) == sorted(order_01[step * W * b:(step + 1) * W * b])
print("the ranks' step together = stage 01's step")

# %% [markdown]
# That needs `W` to divide the 4,096 samples. With 3 ranks it does not, and `DistributedSampler`
# evens the ranks out by padding: it repeats the first samples of the epoch's order, so that every
# rank takes as many. The stages say so before training (the line below is theirs, `padding_note`),
# and the tour replays such a run with stage 01's code on that same padded order (`epoch_samples` in
# `summary.json`).

# %%
s03 = nb.load_stage("03_ddp_spawn")
print(s03.padding_note(N, 3))
ranks3 = []
for rank in range(3):
    sampler = DistributedSampler(range(N), num_replicas=3, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    ranks3.append(list(sampler))
padded = [i for position in range(len(ranks3[0])) for i in (r[position] for r in ranks3)]  # back in order
extra = len(padded) - N  # what the sampler added
assert extra == 2 and padded == order_01 + order_01[:extra], "not stage 01's order with its first samples repeated"
print(f"3 ranks × {len(ranks3[0])} = {len(padded)} samples an epoch: stage 01's order, then its first {extra} "
      f"again ({padded[N:]})")

# %% [markdown]
# ## What changed from stage 02
#
# The main additions: `main` picks `MASTER_ADDR`/`MASTER_PORT` and calls `mp.spawn`; `ddp_setup`
# joins the process group (nccl on GPUs, gloo on the CPU, with `cores // W` threads each so the ranks
# do not fight over the cores); the `DistributedSampler` with `set_epoch`; `DDP(model)`; an epoch
# loss all-reduced so the log shows the mean over all ranks; an exact distributed evaluation; and the
# replica check, which all-gathers every rank's parameters at the end and fails if any differs from
# rank 0's by anything at all.

# %%
nb.show_diff("02_dataparallel", "03_ddp_spawn")

# %% [markdown]
# ## Run it
#
# `mp.spawn(main_worker, nprocs=W)` starts `W` fresh Python processes and, in each, calls
# `main_worker(rank, ...)`. They cannot share the parent's memory, so the function is *pickled*: by
# name, to be looked up again in the child, which re-imports the script. That is why
# `main_worker` is defined at the top level of a file and the spawning sits under
# `if __name__ == "__main__":`. It is also why this notebook does not call `mp.spawn` itself: a
# function defined in a notebook cell lives in the kernel's `__main__`, which a child process cannot
# import: each child stops with `AttributeError: Can't get attribute 'main_worker' on <module
# '__main__' (built-in)>` and `mp.spawn` raises `ProcessExitedException`. So we run the script as a
# subprocess, the way you would in a terminal: two ranks of batch 32, next to stage 01 at batch 64.

# %%
ref = nb.reference(cfg)
ddp = nb.run(cfg.step("03_ddp_spawn"), "03_ddp_spawn")

# %% [markdown]
# Only rank 0 prints. The last line is the replica check: exactly 0, not merely small, since every
# rank applied the same averaged gradient to the same weights.
#
# ## Same weights as stage 01
#
# Two processes of batch 32 end within rounding of one process at batch 64: the gradients of the
# two halves of each batch are summed in another order, and that is the only difference. The
# held-out metric is exact too: `eval_count` is 1001, each held-out sample counted once, even though
# 1001 does not split evenly over 2 ranks.

# %%
diffs = nb.compare(ref, {"03, 2 ranks × 32 (mp.spawn)": ddp})
assert max(diffs.values()) <= nb.ATOL and ddp.summary["eval_count"] == 1001, diffs
nb.plot_runs(ref, {"03, 2 ranks × 32 (mp.spawn)": ddp}, "03 over 01: one curve", ref_label="01, 1 × 64")

# %% [markdown]
# Next, [04_ddp_torchrun](04_ddp_torchrun.ipynb): the same training, with `torchrun` starting the
# processes.
