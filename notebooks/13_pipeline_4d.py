# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 13: the GPT's blocks cut into pipeline stages, on top of every other split
#
# Stage 10 cut an MLP's layers into pipeline stages; `13_pipeline_4d/` does it to stage 12's GPT.
# Each pp process holds a run of consecutive blocks (the first also the embeddings, the last the
# final norm and the head), and a step's `--accumulate` micro-batches go through the stages under
# torch's GPipe or 1F1B schedule (`pipeline.py`). Each stage is itself stage 12's (dp × cp) × tp
# grid, so the GPT trains on all four dimensions at once. This notebook shows which blocks each
# stage holds, what the schedule leaves idle, and checks on a tiny copy of the model that two
# pipeline stages compute one process's training.

# %%
import nbtools as nb

pp13 = nb.load_stage("13_pipeline_4d")

# %% [markdown]
# ## Who holds which blocks
#
# `stage_blocks(layers, pp, rank)`: consecutive blocks, as many on each stage as can be, the first
# stages one more where pp does not divide the blocks. The names stay the whole model's (`blocks.2`
# on whichever stage holds it), so a checkpoint written by one layout resumes on another.

# %%
for layers, pp in [(4, 2), (5, 2), (6, 3), (4, 4)]:
    print(f"{layers} blocks over pp {pp}:", [list(pp13.stage_blocks(layers, pp, r)) for r in range(pp)])

# %% [markdown]
# ## The bubble
#
# With p stages and m micro-batches, a step takes m + p − 1 slots of a micro-batch's forward and
# backward, and each stage is busy in m of them: the idle part, the *bubble*, is (p − 1)/(m + p − 1),
# under GPipe and 1F1B alike (1F1B changes how many micro-batches' activations a stage holds at
# once: at most p, where GPipe holds all m). More micro-batches shrink the bubble; 1F1B needs at
# least p of them.

# %%
print("micro-batches m:   " + "".join(f"{m:>7}" for m in (1, 2, 4, 8, 16)))
for p in (2, 4):
    print(f"bubble at pp {p}:     " + "".join(f"{(p - 1) / (m + p - 1):>7.0%}" for m in (1, 2, 4, 8, 16)))

# %% [markdown]
# ## One training, cut or not
#
# A tiny copy of the GPT (2 blocks, width 32, context 24) in float64, 6 steps at a global batch of 4
# windows: one process, and pp 2 under 1F1B, the 4 windows as 4 micro-batches of 1 (FSDP2 over a
# dp of 1: `--pp` trains under FSDP2). Each writes `model.pt`, the whole model, gathered from both
# stages.

# %%
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24", "--dtype", "float64", "--device", "cpu",
        "--max-steps", "6", "--eval-every", "3", "--sample", "0", "--lr", "0.01")
ways = {"1 process": nb.Step("13_pipeline_4d", "python", (*TINY, "--batch-size", "4")),
        "pp 2, 1F1B": nb.Step("13_pipeline_4d", "torchrun", (*TINY, "--pp", "2", "--parallel", "fsdp",
                                                              "--batch-size", "1", "--accumulate", "4"), nproc=2)}
done = {label: nb.run(step, f"13_pp_{i}", quiet=True) for i, (label, step) in enumerate(ways.items())}
one, cut = done["1 process"], done["pp 2, 1F1B"]
gap = nb.max_abs_diff(cut.model, one.model)
print(f"pp 2 vs 1 process: max |Δw| {gap:.1e}; losses {[round(x, 6) for x in cut.summary['losses']]}")
assert gap <= nb.ATOL, gap

# %% [markdown]
# Equal to float64's rounding. `tests/test_pipeline_4d.py` checks more layouts (dp 2 × pp 2 under
# GPipe, and dp 2 × pp 2 × cp 2 × tp 2 on 16 processes, resumed from the other's checkpoint) and a
# pipeline whose stages clip by their own blocks' gradient norm as its negative control. The README
# has what the pipeline changes in stage 12's files, the speed, and the refusals.
