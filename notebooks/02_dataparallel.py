# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 02: `nn.DataParallel`, one process driving several GPUs
#
# The first thing most people try: wrap the model in `nn.DataParallel` and every visible GPU
# works on a slice of each batch. It takes one line, and it shows why the later stages exist,
# because one GPU ends up doing much more than its share.

# %%
import matplotlib.pyplot as plt
import nbtools as nb

cfg = nb.setup()

# %% [markdown]
# ## What happens in every step
#
# DataParallel lives in one Python process. The optimizer updates only GPU 0's copy of the model,
# so on **every** forward pass it has to:
#
# 1. **scatter** the batch: cut it into one chunk per GPU and copy each chunk to its GPU;
# 2. **replicate** the model: copy the current weights from GPU 0 to every other GPU;
# 3. **apply** the replicas in parallel, one Python thread per GPU;
# 4. **gather** the outputs on GPU 0, where the loss is computed.
#
# Backward runs the same way in reverse and sums every replica's gradients on GPU 0, and the
# optimizer step runs there alone. The picture shows the traffic and, on the right, what each GPU
# has to hold (illustrative sizes, not a measurement): GPU 0 keeps the whole batch, all the outputs,
# the summed gradients and the optimizer state, so it runs out of memory first, and the others wait
# for it. All the threads also share one interpreter and its GIL.

# %%
gpus, phases = 4, ["1 scatter the batch", "2 replicate the weights", "3 forward, one thread per GPU",
                   "4 gather outputs, loss", "5 backward, sum grads", "6 optimizer step"]
fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
for row, phase in enumerate(phases):
    y = len(phases) - 1 - row
    ax.text(-0.7, y, phase, ha="right", va="center", fontsize=9)
    for g in range(gpus):
        busy = g == 0 or row in (2, 4)  # every GPU computes forward and backward; GPU 0 does the rest
        ax.add_patch(plt.Rectangle((g - 0.3, y - 0.3), 0.6, 0.6, color="C3" if g == 0 else "C0",
                                   alpha=0.9 if busy else 0.15))
        if g and row in (0, 1):  # from GPU 0 to the others
            ax.annotate("", (g - 0.3, y + 0.1), (0.3, y + 0.1), arrowprops={"arrowstyle": "->", "color": "k",
                        "connectionstyle": f"arc3,rad={-0.08 * g}"})
        if g and row in (3, 4):  # from the others back to GPU 0
            ax.annotate("", (0.3, y - 0.1), (g - 0.3, y - 0.1), arrowprops={"arrowstyle": "->", "color": "k",
                        "connectionstyle": f"arc3,rad={-0.08 * g}"})
ax.set(xlim=(-3.6, gpus - 0.5), ylim=(-0.8, len(phases) - 0.2), xticks=range(gpus),
       xticklabels=[f"GPU {g}" for g in range(gpus)], yticks=[], title="one training step of nn.DataParallel")
ax.spines[:].set_visible(False)
ax.tick_params(length=0)
parts = {"weights": [1] * gpus, "batch": [1] + [0.25] * (gpus - 1), "activations": [0.25] * gpus,
         "gathered outputs": [1, 0, 0, 0], "summed gradients": [1, 0, 0, 0], "optimizer state": [1, 0, 0, 0]}
bottom = [0.0] * gpus
for i, (part, sizes) in enumerate(parts.items()):
    bx.bar(range(gpus), sizes, bottom=bottom, label=part, color=f"C{i}")
    bottom = [b + s for b, s in zip(bottom, sizes, strict=True)]
bx.set(xticks=range(gpus), xticklabels=[f"GPU {g}" for g in range(gpus)], ylabel="memory (illustrative units)",
       title="what each GPU holds")
bx.legend(fontsize=8)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# Stage 03 removes both problems: one process per GPU, each with its own optimizer and its own copy
# of the model, so there is no master GPU and only gradients travel.
#
# ## What changed from stage 01
#
# The model is wrapped when there are GPUs to split over, and `raw_model` keeps a handle on the
# unwrapped model: that is what is evaluated and saved. Saving the wrapper would prefix every key of
# the `state_dict` with `module.`, and it would no longer load into stage 01's `Net`.

# %%
nb.show_diff("01_single_gpu", "02_dataparallel")

# %% [markdown]
# ## Run it, next to stage 01
#
# DataParallel splits only across **GPUs**. On the CPU there is one device, nothing to split over,
# and the script says so in one line and trains exactly as stage 01 does. With GPUs, the same
# batch of 64 is cut into one chunk per GPU. Either way, the batch is the whole batch: one process,
# so per process and global are the same thing.

# %%
ref = nb.reference(cfg)
dp = nb.run(cfg.step("02_dataparallel"), "02_dataparallel")

# %% [markdown]
# ## Same weights as stage 01
#
# On the CPU the difference is exactly 0, because the computation is the same. On GPUs it is
# rounding: the chunks are multiplied separately and their gradients summed in another order.

# %%
diffs = nb.compare(ref, {"02, DataParallel": dp})
assert max(diffs.values()) <= nb.ATOL, diffs
nb.plot_runs(ref, {"02, DataParallel": dp}, "02 over 01: one curve")

# %% [markdown]
# Next, [03_ddp_spawn](03_ddp_spawn.ipynb): one process per device, and the ring all-reduce.
