# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 08: FSDP2 shards the model, and still reaches stage 01's weights
#
# Every stage so far, 07 included, kept a whole replica on every process: all the parameters, all
# their gradients and all of the optimizer's state (SGD's momentum: one more copy of the weights).
# With W processes that is W identical copies. **FSDP** (fully sharded data parallel) keeps one
# copy in all, cut into W shards: each rank holds 1/W of every parameter, of its gradient and of its
# momentum, and gathers a block of the model whole only while it computes with it. The training is
# still data parallel (each rank its own slice of the batch), and still stage 01's training.
#
# | what a rank holds | DDP (stages 03–07) | FSDP2 (`fully_shard`) |
# |---|---|---|
# | parameters | all | 1/W, plus one block gathered whole while it runs |
# | gradients | all (all-reduced) | 1/W (reduce-scattered) |
# | optimizer state | all | 1/W: the step updates only this rank's shards |
#
# In the ZeRO paper's terms, sharding the optimizer state is stage 1, adding the gradients stage 2,
# adding the parameters stage 3: FSDP2 as used here is ZeRO-3.

# %%
import matplotlib.pyplot as plt
import nbtools as nb
from matplotlib.patches import Patch, Rectangle

cfg = nb.setup()

# %% [markdown]
# ## What changed from stage 06
#
# `DDP(model)` is gone. `shard_model()` calls `fully_shard` on each block (`body`, `head`: in a
# transformer, each transformer block), then on the whole model; each call makes a **unit**, the
# set of parameters gathered and freed together. It needs an explicit CPU mesh on the CPU (the
# default is CUDA wherever a GPU is visible). No broadcast happens, unlike DDP's constructor: every
# rank builds the same weights from the same seed and keeps its slice of them.
#
# The rest follows from the weights no longer being whole anywhere:
#
# - the checkpoint is written by every rank, each its own shards (`torch.distributed.checkpoint`),
#   and can be resumed on another number of ranks;
# - the held-out set is scored by the sharded model itself (`evaluate_sharded`). Its forward is a
#   collective (each unit all-gathers its weights), so every rank runs as many batches as the others;
# - the whole model is gathered only for `--out`'s `model.pt`, once, at the end, onto rank 0's CPU
#   (`full_model`). Gathering it on every rank would cost what sharding saves;
# - there is no replica check: there are no replicas, as each rank holds other rows;
# - the script counts its collectives and the bytes each rank holds, which the rest of this notebook
#   draws.
#
# Like every stage, it records the weights and momentum after each epoch (the trajectory the tour
# replays) only with `--out`. Here each record is an all-gather of the whole model, which a run that
# keeps no files should not pay for. The notebook's runs pass `--out`.

# %%
nb.show_diff("06_checkpoint", "08_fsdp")

# %% [markdown]
# ## Run it
#
# Stage 01 with one process of batch 64, then stage 08 under `torchrun` with two ranks of batch 32.

# %%
ref = nb.reference(cfg)
fsdp = nb.run(cfg.step("08_fsdp"), "08_fsdp")
s = fsdp.summary

# %% [markdown]
# ## Who holds which shard
#
# `fully_shard` cuts every parameter along its first dimension, `torch.chunk`-style: with two
# ranks, rank 0 keeps the first half of the rows of each weight matrix (and of each bias), rank 1
# the second half. Each parameter's gradient and momentum are cut the same way, so the optimizer
# updates a rank's rows with that rank's gradient rows: no communication. Below, the final weights
# (gathered whole into `model.pt`), coloured by the rank whose shard holds each row; the rows are
# read off the `shard_shapes` the run recorded.

# %%
state, shapes = fsdp.model, s["shard_shapes"]
world, names = s["world_size"], list(shapes[0])
units = list(dict.fromkeys(name.split(".")[0] for name in names))  # body, head: the blocks given to fully_shard
fig, ax = plt.subplots(figsize=(11, 5.4))
x, spans = 0.0, {u: [] for u in units}
for name in names:
    w = state[name]
    mat = w if w.ndim == 2 else w[:, None]
    rows, cols = mat.shape
    width = cols if w.ndim == 2 else 3  # a bias: drawn as a column, a little wider than one
    limit = mat.abs().max().item()
    ax.imshow(mat, cmap="gray", vmin=-limit, vmax=limit, extent=(x, x + width, rows, 0), interpolation="nearest")
    start = 0
    for rank in range(world):
        n = shapes[rank][name][0]
        ax.add_patch(Rectangle((x, start), width, n, facecolor=f"C{rank}", alpha=0.4, edgecolor=f"C{rank}", lw=2))
        if cols > 32:  # room for words: which rank, which rows (below the matrix if it has few)
            few = n < 8
            ax.text(x + width / 2, rows + 1 + 3 * rank if few else start + n / 2,
                    f"rank {rank}: rows {start}–{start + n - 1}", ha="center", va="top" if few else "center",
                    color=f"C{rank}" if few else "white", fontsize=9 if few else 10, weight="bold")
        start += n
    assert start == rows, f"{name}: the ranks' rows add up to {start}, not {rows}"
    label = f"{name}\n{' × '.join(map(str, w.shape))}" if w.ndim == 2 else "bias"  # each weight's bias follows it
    ax.text(x + width / 2, -2, label, ha="center", va="bottom", fontsize=8, rotation=0 if w.ndim == 2 else 90)
    spans[name.split(".")[0]].append((x, x + width))
    x += width + (2 if w.ndim == 2 else 7)
for unit, parts in spans.items():  # the unit: what is gathered and freed together
    left, right = parts[0][0], parts[-1][1]
    ax.annotate("", (left, -12), (right, -12), arrowprops={"arrowstyle": "-", "lw": 1.5})
    ax.text((left + right) / 2, -13, f"unit `{unit}`", ha="center", va="bottom", fontsize=10)
ax.legend(handles=[Patch(color=f"C{r}", alpha=0.5, label=f"rank {r}'s shard (its rows)") for r in range(world)],
          loc="lower right", fontsize=9)
ax.set(xlim=(-1, x - 6), ylim=(state[names[0]].shape[0] + 2, -22), xticks=[], yticks=[],
       title=f"Who holds which rows: {world} ranks, each parameter cut along its first dimension")
ax.set_aspect("equal")
ax.spines[:].set_visible(False)
fig.tight_layout()
nb.show(fig)
for rank in range(world):
    print(f"rank {rank}: " + ", ".join(f"{n} {tuple(shp)}" for n, shp in shapes[rank].items()))

# %% [markdown]
# ## What each rank holds, in bytes
#
# From the run's summary: `bytes_per_rank`, what each rank held after its last step (its shards of
# the parameters, gradients and momentum), next to `full_bytes`, what a DDP replica holds. Half each,
# with two ranks. The hatched part is not kept: while a unit computes, its weights are gathered
# whole, so a rank briefly holds one whole unit more (the largest one is drawn; in its backward,
# the unit's whole gradient too, until the reduce-scatter). Here one unit is
# most of the model, so the peak is not much below a replica's weights; in a real model of many
# blocks the largest unit is a small part of the whole, which is why each block is its own unit.

# %%
parts = ("params", "grads", "optimizer")
per_rank, full = s["bytes_per_rank"], s["full_bytes"]
unit_bytes = {u: sum(state[n].numel() * state[n].element_size() for n in names if n.startswith(u + ".")) for u in units}
assert sum(unit_bytes.values()) == full["params"], (unit_bytes, full)
fig, ax = plt.subplots(figsize=(11, 3.6))
bars = [f"rank {r}\n(FSDP2)" for r in range(world)] + ["a DDP replica\n(every rank)"]
for i, held in enumerate([*per_rank, full]):
    bottom = 0
    for j, part in enumerate(parts):
        ax.bar(i, held[part], bottom=bottom, color=f"C{j + 2}", label=part if i == 0 else None)
        bottom += held[part]
    ax.text(i, bottom, f"{bottom:,} B", ha="center", va="bottom", fontsize=9, bbox={"fc": "white", "lw": 0})
    if i < world:
        biggest = max(unit_bytes, key=unit_bytes.get)
        ax.bar(i, unit_bytes[biggest], bottom=bottom, fill=False, hatch="//", edgecolor="0.5",
               label=f"+ unit `{biggest}`'s whole weights,\n  while it computes (not kept)" if i == 0 else None)
ax.set_xticks(range(len(bars)), bars)
n_params = sum(state[n].numel() for n in names)
ax.set(ylabel="bytes", title=f"Model state per rank ({s['dtype']}, {n_params:,} parameters)")
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
ax.spines[["top", "right"]].set_visible(False)
fig.tight_layout()
nb.show(fig)
for r, held in enumerate(per_rank):
    total = sum(held.values())
    print(f"rank {r}: {held} = {total:,} bytes, {total / sum(full.values()):.0%} of a DDP replica's "
          f"{sum(full.values()):,}")
assert all(sum(held.values()) * world == sum(full.values()) for held in per_rank), "not 1/W each"
print("units, whole: " + ", ".join(f"`{u}` {b:,} B ({b / full['params']:.0%} of the weights)"
                                   for u, b in unit_bytes.items()))

# %% [markdown]
# The stage's model is tiny on purpose (it trains in seconds). `--hidden N` widens it, to see the
# same halving on a model of many megabytes: the script prints the bytes per rank at the end.
#
# ## When it is gathered, and when it talks
#
# One training step, as FSDP2 runs it on every rank (the ranks call each collective together):
#
# - **forward**: before a unit's forward, all-gather its shards into whole weights; after it, free
#   them again (`reshard_after_forward=True`, which the script passes unless told otherwise);
# - **backward**, last unit first: all-gather the unit again, compute its gradients, then
#   **reduce-scatter** them: the ranks' gradients are averaged, and each rank keeps only its rows
#   of the result (DDP's all-reduce gives every rank all of it);
# - **optimizer step**: each rank updates its own shards with its own gradient and momentum shards.
#   No communication.
#
# With `--no-reshard-after-forward` a unit stays whole from its forward to the end of its backward:
# no second all-gather, in exchange for holding the whole weights of every unit during the
# backward, ZeRO-2's trade. The script counts the collectives of its first step
# (`collectives_per_step`); a one-epoch run with that flag gives the other count, and the same
# weights as the first epoch of the run above.

# %%
no_reshard = nb.with_args(cfg.step("08_fsdp"), epochs=1, no_reshard_after_forward=True)
kept = nb.run(no_reshard, "08_no_reshard", quiet=True)
after_one = dict(zip(names, fsdp.trajectory[1]["params"], strict=True))  # the first run, after epoch 1
same = max((kept.model[n] - after_one[n]).abs().max().item() for n in names)
print(f"max |Δw| after epoch 1, reshard_after_forward False vs True: {same:.1e}")
assert same <= nb.ATOL, same
counted = {s["reshard_after_forward"]: s["collectives_per_step"],
           kept.summary["reshard_after_forward"]: kept.summary["collectives_per_step"]}
for flag, counts in counted.items():
    print(f"reshard_after_forward={flag}: {counts}")

# %% [markdown]
# The timeline below is drawn from the order in which FSDP2 works through the units (durations are
# schematic, not measured), and its number of all-gathers and reduce-scatters is checked against the
# counts the two runs recorded. On GPUs FSDP2 also *prefetches*: the next unit's all-gather runs on
# its own stream while the current unit computes, so most of the communication is hidden.

# %%
SECONDS = {"all-gather": 1.0, "forward": 1.0, "loss": 0.6, "backward": 2.0, "reduce-scatter": 1.0,
           "optimizer step": 1.5}


def schedule(units: list[str], reshard: bool):
    """One step, unit by unit: the operations (kind, unit, start, length) and when each unit is held whole."""
    ops, whole, since, t = [], {u: [] for u in units}, {}, 0.0

    def do(kind: str, unit: str) -> None:
        nonlocal t
        ops.append((kind, unit, t, SECONDS[kind]))
        t += SECONDS[kind]

    for u in units:  # forward, first unit first
        since[u] = t
        do("all-gather", u)
        do("forward", u)
        if reshard:  # freed at once: only this rank's rows stay
            whole[u].append((since[u], t))
    do("loss", "")
    for u in reversed(units):  # backward, last unit first
        if reshard:
            since[u] = t
            do("all-gather", u)
        do("backward", u)
        whole[u].append((since[u], t))  # resharded after its backward, whatever the flag
        do("reduce-scatter", u)
    do("optimizer step", "all")
    return ops, whole


fig, axes = plt.subplots(2, 1, figsize=(11, 5.6), sharex=True)
lanes = ["compute", "collectives\n(all ranks)", *[f"`{u}` whole" for u in units]]
colors = {"all-gather": "C0", "reduce-scatter": "C3", "forward": "C2", "loss": "C8", "backward": "C1",
          "optimizer step": "C4"}
for ax, reshard in zip(axes, (True, False), strict=True):
    ops, whole = schedule(units, reshard)
    drawn = {kind: sum(op[0] == kind for op in ops) for kind in ("all-gather", "reduce-scatter")}
    measured = counted[reshard]
    assert (drawn["all-gather"], drawn["reduce-scatter"]) == (measured["allgather"], measured["reduce_scatter"]), \
        (reshard, drawn, measured)
    for kind, unit, start, length in ops:
        lane = 1 if kind in ("all-gather", "reduce-scatter") else 0
        ax.broken_barh([(start, length * 0.95)], (len(lanes) - 1 - lane - 0.35, 0.7), color=colors[kind])
        ax.text(start + length * 0.47, len(lanes) - 1 - lane, unit, ha="center", va="center", color="white",
                fontsize=8)
    for i, u in enumerate(units):
        y = len(lanes) - 3 - i
        ax.broken_barh([(a, (b - a) * 0.98) for a, b in whole[u]], (y - 0.25, 0.5), color="0.6")
    ax.set_yticks(range(len(lanes)), lanes[::-1], fontsize=8)
    ax.set_title(f"reshard_after_forward={reshard}: {drawn['all-gather']} all-gathers, {drawn['reduce-scatter']} "
                 f"reduce-scatters per step (the run counted {measured['allgather']} and "
                 f"{measured['reduce_scatter']})", fontsize=10)
    ax.spines[["top", "right"]].set_visible(False)
axes[0].legend(handles=[Patch(color=c, label=k) for k, c in colors.items()] + [Patch(color="0.6", label="held whole")],
               fontsize=8, ncol=7, loc="upper center", bbox_to_anchor=(0.5, 1.45))
axes[1].set_xlabel("one training step (schematic time)")
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# With two units the difference is 2 all-gathers a step; in general it is one per unit that holds
# parameters (the root holds none here; left at its default, `None`, `fully_shard` keeps the root's
# own parameters whole after the forward, as the backward would gather them again at once). The flag
# moves the cost from traffic to memory: with it, at the end of the forward every unit is whole at
# once (the grey bars overlap), as in DDP; only the gradients and the optimizer state stay sharded.
#
# ## Same weights as stage 01, once more
#
# Sharding changes where each number is kept, not what is computed: the reduce-scatter averages the
# same gradients DDP's all-reduce did, and each rank's optimizer step applies stage 01's update to
# its rows. The weights gathered into `model.pt` agree with stage 01's within rounding, and every
# epoch replays with stage 01's code.
#
# DDP's stages also compared the replicas, to catch ranks whose weights drifted apart. Here there is
# nothing to compare: one copy of the model exists, in pieces (`replica_max_abs_diff` is `None`).
# What is left to check is that the pieces compute what the whole model would. The run scored the
# held-out set with the sharded model, which no rank held whole; stage 01's own `evaluate()` on the
# gathered `model.pt`, in this kernel, must give the same numbers.

# %%
label = f"08, {s['world_size']} ranks, FSDP2 shards"
assert s["replica_max_abs_diff"] is None, s["replica_max_abs_diff"]  # no replicas: each rank holds other rows
loss01, acc01, count01 = nb.held_out_by_01(fsdp)
print(f"held-out, the sharded model (the run):     loss {s['eval_loss']:.12f} | accuracy {s['eval_accuracy']:.2%} "
      f"({s['eval_count']} samples)")
print(f"held-out, stage 01's evaluate(model.pt):   loss {loss01:.12f} | accuracy {acc01:.2%} ({count01} samples)")
assert (s["eval_count"], s["eval_accuracy"]) == (count01, acc01), (s["eval_count"], s["eval_accuracy"], count01, acc01)
assert abs(s["eval_loss"] - loss01) <= nb.ATOL, (s["eval_loss"], loss01)
diffs = nb.compare(ref, {label: fsdp})
assert max(diffs.values()) <= nb.ATOL, diffs
nb.plot_runs(ref, {label: fsdp}, "08 over 01: one curve", ref_label="01, 1 × 64")

# %% [markdown]
# ## Also in the stage, not run here
#
# Sharded checkpoints: with `--snapshot DIR`, every rank writes its own shards of the weights and of
# the momentum, and a checkpoint written by 2 ranks resumes on another number at the same global batch
# and still ends at stage 01's weights (see `08_fsdp/README.md`):
#
# ```
# torchrun --standalone --nproc_per_node=2 08_fsdp/train.py --snapshot runs/08_snapshot --batch-size 32 --epochs 4
# torchrun --standalone --nproc_per_node=4 08_fsdp/train.py --snapshot runs/08_snapshot --batch-size 16
# ```
#
# When to pick which: DDP while a replica (weights, gradients, optimizer state, activations) fits on
# one device, as it talks least; FSDP when it does not, or to free memory for larger batches.
