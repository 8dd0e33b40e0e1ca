# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 06: snapshots, and resuming exactly where a run stopped
#
# A long job on many machines will see a failure: a node reboots, a process is killed, the
# scheduler's time runs out. The answer is a **snapshot** every few epochs, and a script that
# resumes from it when it starts. Done right, a run that was stopped and resumed ends at exactly the
# weights, bit for bit, of a run that was never stopped. And `torchrun --max-restarts=N` does the
# restarting by itself when a worker dies.

# %%
import matplotlib.pyplot as plt
import nbtools as nb
import torch

cfg = nb.setup()

# %% [markdown]
# ## The timeline of a failure
#
# Every `--save-every` epochs, global rank 0 writes a snapshot and then **all ranks wait at a
# barrier**, so that once anyone has moved on, the snapshot is complete on disk. When a worker dies,
# torchrun stops the others and starts the whole group again; the new processes load the last
# snapshot and carry on. What is lost is the work since that snapshot, plus the restart itself.

# %%
fig, ax = plt.subplots(figsize=(11, 2.8))
crash, restart_cost, save_every = 4.6, 0.8, 2
for epoch in range(4):  # attempt 1: epochs 1-4 done, epoch 5 cut short
    ax.broken_barh([(epoch, 0.95)], (1.1, 0.6), color="C0")
    ax.text(epoch + 0.47, 1.4, f"epoch {epoch + 1}", ha="center", va="center", color="white", fontsize=8)
ax.broken_barh([(4, crash - 4)], (1.1, 0.6), facecolor="none", edgecolor="C3", hatch="///")
ax.text(crash + 0.05, 1.4, "✗ a worker dies", color="C3", va="center", fontsize=9)
ax.broken_barh([(crash, restart_cost)], (0.1, 0.6), color="0.7")
ax.text(crash + restart_cost / 2, 0.4, "restart", ha="center", va="center", fontsize=8)
for epoch in range(4, 8):  # attempt 2 (torchrun's restart): resumes after epoch 4
    x = crash + restart_cost + (epoch - 4)
    ax.broken_barh([(x, 0.95)], (0.1, 0.6), color="C2")
    ax.text(x + 0.47, 0.4, f"epoch {epoch + 1}", ha="center", va="center", color="white", fontsize=8)
for t, y in [(2, 1.7), (4, 1.7), (crash + restart_cost + 2, 0.7), (crash + restart_cost + 4, 0.7)]:
    ax.plot([t - 0.025, t - 0.025], [y - 0.6, y + 0.15], "k:", lw=1)
    ax.plot(t - 0.025, y + 0.15, "kD", ms=6)
ax.annotate("attempt 2 loads\nthe snapshot of epoch 4", (3.97, 1.1), (2.2, 0.4), fontsize=8, va="center",
            arrowprops={"arrowstyle": "->"})
ax.text(3.2, 2.0, "◆ snapshot by rank 0, then a barrier for all", fontsize=8)
ax.text(crash - 0.3, 0.85, "lost", color="C3", fontsize=8, ha="center")
ax.set(yticks=[0.4, 1.4], yticklabels=["attempt 2", "attempt 1"], xlabel="time (in epochs)", ylim=(0, 2.3),
       title=f"--save-every {save_every}, torchrun --max-restarts=3")
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## What a snapshot must hold
#
# Exactness decides the contents. The **unwrapped** model's weights; the optimizer's state (SGD's
# momentum buffers: without them the first steps after resuming differ); the epochs done, the losses
# so far and the step count; the RNG state; and the seed and global batch it was made with, so that a
# snapshot from other settings is refused rather than silently continued. The data order needs no
# saving: epoch `e` is shuffled with `seed + e`.
#
# How it is written matters as much. Only global rank 0 writes (the replicas are identical, and
# several writers of one file would race). It writes a temporary file and renames it over the old
# one: the rename is atomic, so a crash mid-write leaves the previous snapshot whole. Every rank loads
# it with `map_location` (its own device, not the one it was saved from) and `weights_only=True`
# (a `.pt` file is a pickle, and unpickling arbitrary files can run code).

# %%
nb.show_diff("05_multinode", "06_checkpoint")

# %% [markdown]
# ## Stop a run, resume it, compare with one that never stopped
#
# Three runs of two workers each, all with `--snapshot`:
#
# 1. **uninterrupted**: the tour's 5 epochs in one go;
# 2. **stopped**: the same, but it stops after epoch 2 (`--epochs 2`), leaving its snapshot behind;
# 3. **resumed**: the same command as 1 with the snapshot of run 2: it finds the snapshot, says so,
#    and trains epochs 3 to 5 only.
#
# The snapshot is deleted first, so that a previous execution of this notebook cannot be resumed from.

# %%
ref = nb.reference(cfg)
step = cfg.step("06_checkpoint")
whole = nb.run(step, "06_uninterrupted", quiet=True)
snapshot = nb.RUNS / "06_snapshot.pt"
snapshot.unlink(missing_ok=True)
stopped = nb.run(nb.with_args(step, epochs=2, snapshot=snapshot), "06_stopped")
resumed = nb.run(nb.with_args(step, snapshot=snapshot), "06_resumed")

# %% [markdown]
# The resumed run's log starts with `resumed from … after epoch 2` and then prints epochs 3 to 5.
# Inside the snapshot the stopped run left (and which the resumed one then updated):

# %%
snap = torch.load(snapshot, map_location="cpu", weights_only=True)
print({k: (v if k in ("epochs_run", "steps", "seed", "global_batch") else type(v).__name__) for k, v in snap.items()})

# %% [markdown]
# ## Bit for bit
#
# The resumed run is not merely close to the uninterrupted one: its weights and its per-epoch
# losses are *equal*. Both are also within rounding of stage 01, like every stage.

# %%
exact = nb.max_abs_diff(whole.model, resumed.model)
print(f"max |Δw| resumed vs uninterrupted: {exact}")
assert exact == 0.0 and resumed.summary["losses"] == whole.summary["losses"], "resuming changed the result"
runs = {"06 uninterrupted": whole, "06 stopped after 2": stopped, "06 resumed from 2": resumed}
diffs = nb.compare(ref, runs)
assert max(diffs[k] for k in ("06 uninterrupted", "06 resumed from 2")) <= nb.ATOL, diffs
nb.plot_runs(ref, runs, "06 over 01: stopped, resumed, one curve", ref_label="01, 1 × 64")

# %% [markdown]
# ## Letting torchrun restart it
#
# Above we restarted by hand. With `--max-restarts`, torchrun does it: when a worker dies it stops
# the others and starts the whole group again, up to N times, and the script resumes from the
# snapshot as it did here.
#
# ```
# torchrun --standalone --nproc_per_node=2 --max-restarts=3 06_checkpoint/train.py --snapshot runs/snapshot.pt
# ```
#
# The test suite kills workers of such a job three times with SIGKILL and checks that it still ends
# at the uninterrupted run's weights. `06_checkpoint/README.md` has the log of such a run, and the
# store fix that makes restarts reliable on gloo.
#
# Next, [07_model_parallel](07_model_parallel.ipynb): a model split over two devices, inside DDP.
