# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 09: every layer split over processes, on a 2-D mesh, and still stage 01's weights
#
# Stage 07 split the model *between* layers: `body` on one device, `head` on another, the
# activations carried across once. **Tensor parallelism** splits *inside* every layer: each matrix
# multiplication is cut into pieces that several processes compute at the same time, on the same
# samples, and they talk inside the layers to put the pieces together.
#
# | | 07: model parallel | 09: tensor parallel |
# |---|---|---|
# | what is cut | the model, between layers | every layer, inside its matrix |
# | who computes | one device at a time (the other waits) | all tp ranks at once, each a slice |
# | talk | activations across the cut, forward and back | collectives inside the layers, every step |
#
# Stage 09 combines it with stage 08's FSDP2 on a two-dimensional **device mesh** of `dp` rows and
# `tp` columns (`W = dp × tp`): the ranks of a row split every layer between them and see the same
# samples; the rows see different samples, and FSDP2 shards each rank's slices over its column.
#
# ```text
#               tp 0      tp 1
#    dp 0     rank 0    rank 1      <- a row: the same samples, each rank half of every layer
#    dp 1     rank 2    rank 3      <- another row: other samples
#               ^ a column: the same half of every layer, sharded by FSDP2 over the column
# ```
#
# Rank `r` sits in row `r // tp`, column `r % tp`, and torchrun numbers the processes of a node
# consecutively, so with `--tp` = the processes per node (the default) **each row is one node**.
# That is where tp belongs: it talks inside every layer, forward and backward, and the computation
# waits for each collective, so it needs the fastest links (NVLink between the GPUs of a node).
# FSDP2's collectives are a few per block and overlap the computation: they can cross the network.

# %%
from dataclasses import replace

import matplotlib.pyplot as plt
import nbtools as nb
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

cfg = nb.setup()

# %% [markdown]
# ## What changed from stage 08
#
# `make_mesh` builds the `(dp, tp)` mesh; `parallelize` (08's `shard_model`) first splits the
# layers over `mesh["tp"]` with three lines of plan, then shards each block over `mesh["dp"]` as 08
# did over the whole world. The sampler takes the **dp** coordinate and size, not the global rank:
# the tp ranks of a row must see the same samples, since together they compute one forward. For the
# same reason the held-out set is split over the dp rows only (`evaluate_sharded` is given the dp
# coordinate and the dp group): the tp ranks of a row score the same samples together, with the
# model as it is split, and only the rows' sums are added. The epoch's loss is averaged over the dp
# column only, and the collectives of one step are counted per mesh dimension (DTensor's beside
# FSDP's). Checkpoints, `model.pt` (gathered onto rank 0's CPU, only with `--out`) and the lack of a
# replica check are 08's, unchanged.

# %%
nb.show_diff("08_fsdp", "09_tensor_parallel")

# %% [markdown]
# ## Run it
#
# Stage 01 with one process of batch 64, then stage 09 under `torchrun` with two processes and
# `--tp 2`: a mesh of dp 1 × tp 2. Both processes compute on the *same* 64 samples each step,
# each with half of every layer, so `--batch-size 64` is the global batch (dp × 64), stage 01's.

# %%
ref = nb.reference(cfg)
tp_run = nb.run(cfg.step("09_tensor_parallel"), "09_tensor_parallel")
s = tp_run.summary
print(f"mesh: dp {s['dp']} × tp {s['tp']}; global batch {s['global_batch']}")

# %% [markdown]
# ## Who holds which slice of each layer
#
# `parallelize` gives every `Linear` a style (train.py's plan, restated below). A `Linear` computes
# `y = x Aᵀ + b` with `A` of shape [out, in]:
#
# - **column-wise** (`body.0`, `head.2`): the **rows** of `A` (the outputs) are split, and `b` with
#   them; each tp rank computes its slice of `y` from the whole `x`, without talking. (Torch names it
#   after the columns of `Aᵀ`.)
# - **row-wise** (`head.0`): the **columns** of `A` (the inputs) are split, matching the slice of
#   hidden units that `body.0` left on each rank; each rank gets a *partial sum* of the whole output,
#   and an all-reduce adds them. Its bias is added once, after the sum, so each tp rank keeps it
#   **whole**.
#
# Below, the final weights (gathered whole into `model.pt`) coloured by the tp rank that holds each slice.
# The slices are not drawn from the plan: they are read off the `shard_shapes` the run recorded
# (which dimension of each parameter is smaller on a rank than in the whole), and checked against it.

# %%
PLAN = {"body.0": "column-wise", "head.0": "row-wise", "head.2": "column-wise"}  # train.py's parallelize()
SPLIT_DIMS = {("column-wise", "weight"): [0], ("column-wise", "bias"): [0],  # the rows (outputs)
              ("row-wise", "weight"): [1], ("row-wise", "bias"): []}  # the columns (inputs); the bias whole

state, shapes, tp = tp_run.model, s["shard_shapes"], s["tp"]
names = list(shapes[0])
coord = {p["rank"]: (p["dp"], p["tp"]) for p in s["layout"]}


def split_dims(name: str, rank: int = 0) -> list[int]:
    """The dimensions in which `rank` holds less of parameter `name` than the whole."""
    pairs = zip(state[name].shape, shapes[rank][name], strict=True)
    return [d for d, (whole, mine) in enumerate(pairs) if mine < whole]


for name in names:
    layer, kind = name.rsplit(".", 1)
    assert split_dims(name) == SPLIT_DIMS[PLAN[layer], kind], (name, split_dims(name), PLAN[layer])
    assert all(shapes[r][name] == shapes[0][name] for r in range(s["world_size"])), f"{name}: unequal slices"

fig, ax = plt.subplots(figsize=(11, 5.6))
x = 0.0
for name in names:
    w = state[name]
    dims, layer = split_dims(name), name.rsplit(".", 1)[0]
    copies = 1 if dims or w.ndim == 2 else tp  # a bias kept whole: one full copy per tp rank, side by side
    for copy in range(copies):
        mat = w if w.ndim == 2 else w[:, None]
        rows, cols = mat.shape
        width = cols if w.ndim == 2 else 3  # a bias: drawn as a column, a little wider than one
        limit = mat.abs().max().item()
        ax.imshow(mat, cmap="gray", vmin=-limit, vmax=limit, extent=(x, x + width, rows, 0), interpolation="nearest")
        for rank in range(s["world_size"]):
            t = coord[rank][1]
            if not dims:  # whole: this copy is tp rank `copy`'s
                if t == copy:
                    ax.add_patch(Rectangle((x, 0), width, rows, facecolor=f"C{t}", alpha=0.4, edgecolor=f"C{t}", lw=2))
                continue
            n = shapes[rank][name][dims[0]]
            if dims == [0]:  # rows: the outputs
                ax.add_patch(Rectangle((x, t * n), width, n, facecolor=f"C{t}", alpha=0.4, edgecolor=f"C{t}", lw=2))
                if w.ndim == 2 and n < 8:  # few rows: the words go below the matrix
                    ax.text(x + width / 2, rows + 2 + 4 * t, f"tp {t}: rows {t * n}–{(t + 1) * n - 1}", ha="center",
                            va="top", color=f"C{t}", fontsize=9, weight="bold")
                elif w.ndim == 2:  # a narrow matrix: the words turned
                    ax.text(x + width / 2, t * n + n / 2, f"tp {t}: rows {t * n}–{(t + 1) * n - 1}", ha="center",
                            va="center", rotation=90 if cols < 32 else 0, color="white", fontsize=9, weight="bold")
            else:  # columns: the inputs
                ax.add_patch(Rectangle((x + t * n, 0), n, rows, facecolor=f"C{t}", alpha=0.4, edgecolor=f"C{t}", lw=2))
                ax.text(x + t * n + n / 2, rows / 2, f"tp {t}:\ncolumns\n{t * n}–{(t + 1) * n - 1}", ha="center",
                        va="center", color="white", fontsize=10, weight="bold")
        if w.ndim == 2:
            ax.text(x + width / 2, -2, f"{name}\n{' × '.join(map(str, w.shape))}\n{PLAN[layer]}", ha="center",
                    va="bottom", fontsize=9)
        else:
            ax.text(x + width / 2, -2, "bias" + (f", whole (tp {copy})" if copies > 1 else ""), ha="center",
                    va="bottom", fontsize=8, rotation=90)
        x += width + (1 if copy < copies - 1 else 7 if w.ndim == 1 else 2 if width >= 32 else 8)  # room for labels
ax.legend(handles=[Patch(color=f"C{t}", alpha=0.5, label=f"tp rank {t}'s slice") for t in range(tp)],
          loc="lower right", fontsize=9)
ax.set(xlim=(-1, x - 6), ylim=(state[names[0]].shape[0] + 2, -26), xticks=[], yticks=[],
       title=f"Who holds which slice: tp {tp}, every Linear split, Megatron's pairing (column-wise, then row-wise)")
ax.set_aspect("equal")
ax.spines[:].set_visible(False)
fig.tight_layout()
nb.show(fig)
for rank in range(s["world_size"]):
    print(f"rank {rank} (dp {coord[rank][0]}, tp {coord[rank][1]}): "
          + ", ".join(f"{n} {tuple(shp)}" for n, shp in shapes[rank].items()))

# %% [markdown]
# So each rank holds 1/tp of every parameter but one: `head.0.bias`, whole on both. The bytes each
# rank reported (`bytes_per_rank`: parameters, gradients and momentum) say the same: half a DDP
# replica (`full_bytes`), plus the other half of that bias, three times.

# %%
per_rank, full = s["bytes_per_rank"], s["full_bytes"]
whole = [n for n in names if not split_dims(n)]
whole_bytes = sum(state[n].numel() * state[n].element_size() for n in whole)
replica = sum(full.values())
for r, held in enumerate(per_rank):
    total = sum(held.values())
    print(f"rank {r}: {held} = {total:,} bytes = {replica:,} / {tp} + 3 × {whole_bytes * (tp - 1) // tp} "
          f"({', '.join(whole)} whole)")
    assert total * tp == replica + 3 * whole_bytes * (tp - 1), (total, replica, whole_bytes)

# %% [markdown]
# ## Where tp talks, in one step
#
# Follow one step on the two tp ranks. The activations between `body.0` and `head.0` stay split
# (each rank has its own 32 hidden units, and the ReLU works on them alone): the column-wise layer's
# output is already the slice the row-wise layer takes in, so nothing is gathered between them.
#
# - **forward**: an **all-reduce** after `head.0` (its partial sums), an **all-gather** after `head.2`
#   (each rank computed 2 of the 4 logits; the loss needs all 4, on both ranks);
# - **backward**: the all-gather's backward is a slice (no talk); `head.2`'s backward gives each rank
#   only its classes' part of the gradient of its input, and one **all-reduce** sums them for
#   `head.0`; the row-wise `head.0` then gives each rank exactly its slice of the hidden units'
#   gradient (no talk). In Megatron's MLP the last all-reduce sits at the input of the first
#   column-wise layer, but `body.0`'s input is the data, which needs no gradient.
#
# The drawing below lists those operations (durations schematic, not measured); its count of
# collectives is checked against what the run counted in its first step (`collectives_per_step`).

# %%
FORWARD = [  # (what, label, detail): the same on every tp rank, in order; a collective is called by all together
    ("compute", "body.0", "its 32 hidden units"), ("compute", "ReLU", "on its 32"),
    ("compute", "head.0", "partial sums [B, 64]"), ("allreduce", "all-reduce", "adds the\npartial sums"),
    ("compute", "ReLU", "[B, 64], whole"), ("compute", "head.2", "its 2 classes"),
    ("allgather", "all-gather", "all 4 logits"), ("compute", "loss", "the same on both"),
]
BACKWARD = [
    ("compute", "∂logits", "a slice: its 2"), ("compute", "∂head.2", "a part of ∂input"),
    ("allreduce", "all-reduce", "adds the\nparts"), ("compute", "∂ReLU", "[B, 64], whole"),
    ("compute", "∂head.0", "∂h: its 32"), ("compute", "∂ReLU", "on its 32"),
    ("compute", "∂body.0", "weights only"), ("compute", "SGD step", "its slices"),
]
COLORS = {"allreduce": "C3", "allgather": "C2"}

drawn = {op: sum(kind == op for kind, _, _ in FORWARD + BACKWARD) for op in COLORS}
counted = s["collectives_per_step"]
print(f"collectives_per_step: {counted}")
assert counted["tp"] == drawn, (counted["tp"], drawn)

fig, axes = plt.subplots(2, 1, figsize=(11, 5.4))
for ax, ops, title in zip(axes, (FORWARD, BACKWARD), ("forward", "backward, then the optimizer step"), strict=True):
    for i, (kind, label, detail) in enumerate(ops):
        if kind == "compute":
            for t in range(tp):  # each tp rank on its own lane, on its own slice
                y = tp - 1 - t
                ax.add_patch(FancyBboxPatch((i + 0.06, y + 0.12), 0.88, 0.76, boxstyle="round,pad=0.02",
                                            color=f"C{t}", alpha=0.85))
                ax.text(i + 0.5, y + 0.6, label, ha="center", va="center", fontsize=9, color="white", weight="bold")
                ax.text(i + 0.5, y + 0.32, detail, ha="center", va="center", fontsize=7, color="white")
        else:  # a collective: every tp rank takes part, and waits for the others
            ax.add_patch(FancyBboxPatch((i + 0.1, 0.12), 0.8, tp - 0.24, boxstyle="round,pad=0.02",
                                        color=COLORS[kind]))
            ax.text(i + 0.5, tp / 2, f"{label}\nover tp\n\n{detail}", ha="center", va="center", fontsize=8,
                    color="white", weight="bold")
    ax.set_yticks([tp - 1 - t + 0.5 for t in range(tp)], [f"tp rank {t}" for t in range(tp)])
    ax.set(xlim=(0, len(ops)), ylim=(0, tp), xticks=[])
    ax.set_title(title, fontsize=10, loc="left")
    ax.spines[:].set_visible(False)
counts = ", ".join(f"{n} {op}" for op, n in sorted(counted["tp"].items()))
fig.suptitle(f"One step on the tp ranks: {drawn['allreduce']} all-reduces, {drawn['allgather']} all-gather "
             f"(the run counted {counts})", fontsize=11)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# Over dp the run counted nothing: with a dp of 1, FSDP2's column holds one rank, and there is no one
# to gather from or reduce with. Three collectives a step for this MLP; in a transformer the same
# pairing splits the attention (its heads column-wise, the output projection row-wise) and the MLP:
# two all-reduces forward and two backward in every block, each one waited for. Hence tp inside a node.
#
# ## The 2 × 2 mesh
#
# Four processes with `--tp 2`: two rows of two, each row splitting the layers as above and
# training on its own 32 samples a step (`--batch-size 32`, 64 global: still stage 01's batch).
# Four processes on a 2-core CPU are slow, so two epochs only. The grid is drawn from the
# coordinates each rank reported (`layout`), with the slices it holds (`shard_shapes`: split over tp,
# then in half again over dp by FSDP2) and the collectives counted per dimension.

# %%
mesh_step = replace(nb.with_args(cfg.step("09_tensor_parallel"), batch_size=32, epochs=2), nproc=4)
mesh_run = nb.run(mesh_step, "09_mesh_2x2")
m = mesh_run.summary
assert (m["dp"], m["tp"], m["global_batch"]) == (2, 2, s["global_batch"]), (m["dp"], m["tp"], m["global_batch"])

fig, ax = plt.subplots(figsize=(11, 4.6))
for p in m["layout"]:
    d, t = p["dp"], p["tp"]
    assert p["rank"] == d * m["tp"] + t, p  # consecutive ranks share a row: one node's processes
    x0, y0 = 3.6 * t, 2.3 * (m["dp"] - 1 - d)
    ax.add_patch(FancyBboxPatch((x0, y0), 2.6, 1.5, boxstyle="round,pad=0.05", color=f"C{t}", alpha=0.85))
    held = ", ".join(f"{n.removesuffix('.weight')} {'×'.join(map(str, shp))}"
                     for n, shp in m["shard_shapes"][p["rank"]].items() if n.endswith("weight"))
    ax.text(x0 + 1.3, y0 + 1.05, f"rank {p['rank']}\ndp {d}, tp {t}", ha="center", va="center", color="white",
            fontsize=11, weight="bold")
    ax.text(x0 + 1.3, y0 + 0.3, held.replace(", head.0", ",\nhead.0"), ha="center", va="center", color="white",
            fontsize=7)
ops = {dim: ", ".join(f"{n} {op}" for op, n in sorted(c.items())) for dim, c in m["collectives_per_step"].items()}
for d in range(m["dp"]):  # a row: tp's collectives, every layer
    y = 2.3 * (m["dp"] - 1 - d) + 0.75
    ax.annotate("", (3.55, y), (2.65, y), arrowprops={"arrowstyle": "<->", "color": "C3", "lw": 2})
    ax.text(3.1, y + 0.12, "tp", ha="center", va="bottom", color="C3", fontsize=10, weight="bold")
    ax.text(6.4, y, f"row dp {d}: its own 32 samples a step,\nthe same on both ranks;\ntp: {ops['tp']} a step",
            va="center", fontsize=9)
for t in range(m["tp"]):  # a column: FSDP2's collectives over dp
    x = 3.6 * t + 1.3
    ax.annotate("", (x, 1.55 + 0.05), (x, 2.3 - 0.05), arrowprops={"arrowstyle": "<->", "color": "C2", "lw": 2})
    ax.text(x + 0.1, 1.92, f"dp: {ops['dp']}", va="center", color="C2", fontsize=8, weight="bold")
ax.text(3.1, -0.45, "a column: the same slice of every layer, sharded over dp by FSDP2", ha="center", fontsize=9)
ax.set(xlim=(-0.2, 9.6), ylim=(-0.7, 2.3 * m["dp"]), xticks=[], yticks=[],
       title=f"The {m['dp']} × {m['tp']} mesh, as the run reported it ({m['world_size']} processes)")
ax.spines[:].set_visible(False)
fig.tight_layout()
nb.show(fig)
print(f"collectives per step: {m['collectives_per_step']}")
print(f"bytes per rank: {[sum(b.values()) for b in m['bytes_per_rank']]}, of a replica's "
      f"{sum(m['full_bytes'].values()):,}")

# %% [markdown]
# The same training, once more: after its two epochs the 2 × 2 run holds the weights the 1 × 2 run
# held after two (its `trajectory`), within rounding. Two rows of 32 samples are stage 08's data
# parallelism: FSDP2's reduce-scatter averages the rows' gradients, as it did over 08's ranks, while
# within each row the two tp ranks still compute one forward between them. Its held-out evaluation,
# split over the two rows, counted each of the 1001 samples once, as stage 01's `evaluate()` does
# on its `model.pt`.

# %%
after_two = dict(zip(names, tp_run.trajectory[2]["params"], strict=True))
gap = max((mesh_run.model[n] - after_two[n]).abs().max().item() for n in names)
print(f"max |Δw| after epoch 2, dp 2 × tp 2 vs dp 1 × tp 2: {gap:.1e}")
assert gap <= nb.ATOL, gap
loss01, acc01, count01 = nb.held_out_by_01(mesh_run)
print(f"held-out, dp 2 × tp 2: loss {m['eval_loss']:.12f} over {m['eval_count']} samples; "
      f"stage 01's evaluate(model.pt): {loss01:.12f} over {count01}")
assert m["eval_count"] == count01 and abs(m["eval_loss"] - loss01) <= nb.ATOL, (m["eval_loss"], loss01)

# %% [markdown]
# ## Same weights as stage 01
#
# The run above against stage 01: the same final weights within the tour's float64 tolerance, and
# every epoch replayed by stage 01's code. As in 08 there are no replicas to compare (each rank holds
# other slices; `replica_max_abs_diff` is `None`). Instead, the held-out numbers the run computed
# with its split layers equal stage 01's own `evaluate()` on the gathered `model.pt`.

# %%
label = f"09, tp {s['tp']}, dp {s['dp']}"
assert s["replica_max_abs_diff"] is None, s["replica_max_abs_diff"]  # no replicas: each rank holds other slices
loss01, acc01, count01 = nb.held_out_by_01(tp_run)
print(f"held-out, the split model (the run):       loss {s['eval_loss']:.12f} | accuracy {s['eval_accuracy']:.2%} "
      f"({s['eval_count']} samples)")
print(f"held-out, stage 01's evaluate(model.pt):   loss {loss01:.12f} | accuracy {acc01:.2%} ({count01} samples)")
assert (s["eval_count"], s["eval_accuracy"]) == (count01, acc01), (s["eval_count"], s["eval_accuracy"], count01, acc01)
assert abs(s["eval_loss"] - loss01) <= nb.ATOL, (s["eval_loss"], loss01)
diffs = nb.compare(ref, {label: tp_run})
assert max(diffs.values()) <= nb.ATOL, diffs
nb.plot_runs(ref, {label: tp_run}, "09 over 01: one curve", ref_label="01, 1 × 64")

# %% [markdown]
# ## Also in the stage, not run here
#
# Checkpoints are 08's: `--snapshot DIR` writes each rank's pieces with their place in the whole
# tensor, so a checkpoint written by one mesh resumes on another at the same global batch (the test
# writes one with dp 2 × tp 1 and resumes it with dp 2 × tp 2; see `09_tensor_parallel/README.md`).
#
# When to pick which: DDP while a replica fits on one device; FSDP when the model state does not;
# tensor parallelism when even one layer's weights or activations are too large for one device, or
# to spread one forward over the GPUs of a node, inside the node, with FSDP or DDP across nodes.
