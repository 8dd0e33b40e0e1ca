# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 12: one sequence split over processes, attention passed round a ring
#
# Stage 11's GPT with context parallelism (cp): every window is cut into pieces, one per process of a
# cp group. Embeddings, norms, the MLP and the head work position by position, so each process runs
# them on its own positions; only attention needs the others', and `12_context_parallel/train.py`
# computes it by passing keys and values round a ring of the cp processes (or by gathering them all).
# This notebook shows who holds which positions, why the zigzag split balances a causal mask, and
# checks on a tiny copy of the model that cp 2 computes one process's training.

# %%
import matplotlib.pyplot as plt
import nbtools as nb
import torch

cp12 = nb.load_stage("12_context_parallel")

# %% [markdown]
# ## Who holds which positions
#
# A window of 16 positions over cp = 4 processes. Contiguous: process *r* holds the *r*-th quarter.
# Zigzag: the window is cut into 2·cp = 8 chunks and process *r* holds chunks *r* and 7 − *r*. Under
# the causal mask, position *i* reads positions 0 … *i*: the work of a process is the number of
# (query, key) pairs its queries see.

# %%
T, CP = 16, 4
fig, axes = plt.subplots(1, 2, figsize=(10, 2.6))
for ax, zigzag in zip(axes, (False, True), strict=True):
    owner = torch.empty(T)
    work = []
    for r in range(CP):
        positions = cp12.local_positions(T, CP, r, zigzag)
        owner[positions] = r
        work.append(int((positions + 1).sum()))  # position i sees i + 1 keys
    ax.imshow(owner[None], cmap="tab10", vmin=0, vmax=9, aspect="auto")
    ax.set_yticks([])
    ax.set_xticks(range(T))
    ax.set_title(f"{'zigzag' if zigzag else 'contiguous'}: causal work per process {work}")
    print(f"{'zigzag' if zigzag else 'contiguous':<10} positions of each process:",
          [cp12.local_positions(T, CP, r, zigzag).tolist() for r in range(CP)])
axes[1].set_xlabel("position (colour: the process that holds it)")
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## One training, split or not
#
# A tiny copy of the GPT (2 blocks, width 32, context 24) in float64, 6 steps at a global batch of 4
# windows: one process, and cp 2 with ring attention (each process holds 12 positions of every
# window: chunks 0 and 3, or 1 and 2, of 4). Each writes `model.pt`, the whole model.

# %%
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24", "--dtype", "float64", "--device", "cpu",
        "--max-steps", "6", "--eval-every", "3", "--sample", "0", "--lr", "0.01", "--batch-size", "4")
ways = {"1 process": nb.Step("12_context_parallel", "python", TINY),
        "cp 2, ring": nb.Step("12_context_parallel", "torchrun", (*TINY, "--cp", "2"), nproc=2)}
done = {label: nb.run(step, f"12_cp_{i}", quiet=True) for i, (label, step) in enumerate(ways.items())}
one, split = done["1 process"], done["cp 2, ring"]
gap = nb.max_abs_diff(split.model, one.model)
print(f"cp 2 vs 1 process: max |Δw| {gap:.1e}; losses {[round(x, 6) for x in split.summary['losses']]}")
assert gap <= nb.ATOL, gap

# %% [markdown]
# Equal to float64's rounding. `tests/test_context_parallel.py` checks more layouts (dp 2 × cp 2
# under FSDP2, cp 2 × tp 2 with the all-gather, cp 3 with accumulation) and a ring one hop short as
# its negative control; `tests/test_ring_attention.py` checks the attention alone at cp 2, 3 and 4.
# The README has the balance, the bytes, the memory against the context, and the speed.
