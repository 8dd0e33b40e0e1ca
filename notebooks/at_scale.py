# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # At scale: which layout for my model on my GPUs
#
# `at_scale/` answers the question stage 14 leaves: at 8 to 405 billion weights on thousands of GPUs, what does
# each method cost and save, and which combination fits and runs fastest? This notebook simulates one rank of a
# large job with the stages' own code (the fake process group and fake tensors), checks the planner's formulas
# against it, and then lets the planner weigh every layout of Llama 3 8B, 70B and 405B.

# %%
import dataclasses
import sys

import matplotlib.pyplot as plt
import nbtools as nb

sys.path.insert(0, str(nb.ROOT / "at_scale"))
import costs  # noqa: E402  (the formulas)
import hardware  # noqa: E402  (the GPUs, each figure with its source)
import plan  # noqa: E402  (the planner)
import simulate  # noqa: E402  (one rank, simulated)

# %% [markdown]
# ## One rank of a 1,024-GPU job, simulated
#
# The tutorial's GPT at 2.7 billion weights (8 blocks of width 4,096, 4,096 tokens, Llama 3's vocabulary), on
# dp 32 × tp 8 × pp 4 under FSDP2 with 8 micro-batches a step: rank 0, of the first pipeline stage. Stage 13's code
# builds its part of the model and runs its step; nothing of that size is allocated.

# %%
flags = ["--layers", "8", "--width", "4096", "--heads", "32", "--context", "4096", "--vocab", "128256",
         "--world", "1024", "--tp", "8", "--pp", "4", "--parallel", "fsdp", "--accumulate", "8", "--rank", "0"]
measured = simulate.measure(simulate.parse_args(flags))
simulate.show(measured)

# %% [markdown]
# ## The formulas, beside it
#
# costs.py counts the same by formula (what tp splits, what FSDP2 gathers and when, what the pipeline sends,
# Korthikanti et al.'s count of what a block saves, redone for this code). The planner is built on these.

# %%
model = costs.tutorial_gpt(layers=8, width=4096, heads=32, context=4096, vocab=128256)
layout = costs.Layout(dp=32, tp=8, pp=4, parallel="fsdp", accumulate=8)
predicted = costs.rank_costs(model, layout, stage=0)
MiB = 2**20
rows = [("parameters", predicted.parameters, measured["state_bytes"]["parameters"]),
        ("gradients", predicted.gradients, measured["state_bytes"]["gradients"]),
        ("AdamW's moments", predicted.optimizer, measured["state_bytes"]["optimizer"]),
        ("activation peak", predicted.activation_peak, measured["activation_peak_bytes"])]
rows += [(f"sent over {dim}", sent, measured["sent_bytes_by_dimension"].get(dim, 0.0))
         for dim, sent in predicted.sent_by_dimension().items()]
for name, formula, simulated in rows:
    print(f"{name:32} formula {formula / MiB:12,.1f} MiB   simulated {simulated / MiB:12,.1f} MiB")

# %% [markdown]
# ## Memory: what each method divides
#
# Llama 3 70B (70.6 billion weights; 16 bytes each of float32 weights, gradients and AdamW's moments: 1.1 TB),
# 8K tokens, one sequence a micro-batch, on 64 H100s: the busiest rank's memory for a few layouts. DDP divides
# nothing; FSDP divides the state by the dp ranks; tp and pp divide the weights, and tp and cp the activations;
# sequence parallelism (--sp) divides by tp too what stays whole on every tp rank without it (under --ac full, the
# block's input, all it keeps).

# %%
llama70 = costs.PRESETS["llama3-70b"]
h100 = hardware.GPUS["h100"]
examples = {"DDP, dp 64": costs.Layout(dp=64, parallel="ddp"),
            "FSDP, dp 64": costs.Layout(dp=64, parallel="fsdp"),
            "FSDP, dp 8 x tp 8": costs.Layout(dp=8, tp=8, parallel="fsdp"),
            "FSDP, dp 2 x tp 4 x pp 8, 8 micro-batches": costs.Layout(dp=2, tp=4, pp=8, parallel="fsdp",
                                                                        accumulate=8),
            "the same, --ac selective": costs.Layout(dp=2, tp=4, pp=8, parallel="fsdp", accumulate=8,
                                                     ac="selective"),
            "the same, --ac full": costs.Layout(dp=2, tp=4, pp=8, parallel="fsdp", accumulate=8, ac="full"),
            "the same, --ac full --sp": costs.Layout(dp=2, tp=4, pp=8, parallel="fsdp", accumulate=8, ac="full",
                                                     sp=True)}
examples = {k: dataclasses.replace(v, precision="bf16") for k, v in examples.items()}
preds = {name: plan.predict(llama70, lay, h100) for name, lay in examples.items()}
fig, ax = plt.subplots(figsize=(9, 3.6))
for i, p in enumerate(preds.values()):
    left = 0.0
    for j, part in enumerate(plan.MEMORY_PARTS):
        ax.barh(i, p.memory[part] / 1e9, left=left, color=f"C{j}", label=part if i == 0 else None)
        left += p.memory[part] / 1e9
ax.axvline(80, color="black", linestyle="--", linewidth=1)
ax.set_yticks(range(len(preds)), list(preds), fontsize=8)
ax.set_xscale("log")
ax.set_xlabel("GB on the busiest GPU (log scale); the dashed line: an H100's 80 GB")
ax.invert_yaxis()
ax.legend(fontsize=8)
nb.show(fig)

# %% [markdown]
# ## The planner: every layout, weighed
#
# For Llama 3 8B on one node, 70B on 64 GPUs and 405B on 16,384, the fastest layouts that fit (the planner's
# table; `python at_scale/plan.py --model ... --gpus ... --global-batch-tokens ...` prints the same).

# %%
for name, gpus, tokens in (("llama3-8b", 8, 2**20), ("llama3-70b", 64, 2**22), ("llama3-405b", 16384, 2**24)):
    plan.main(["--model", name, "--gpus", str(gpus), "--global-batch-tokens", str(tokens), "--show", "3"])
    print()

# %% [markdown]
# ## Against Llama 3 405B's published runs, and the bubble
#
# Meta's Table 4 (the Llama 3 paper): three layouts and the TFLOP/s per GPU each reached, beside the planner's
# prediction for each. Under 1F1B each stage is idle (pp − 1) micro-batches of every step; Llama 3 ran interleaved
# 1F1B (V chunks a rank: the idle time divided by V), and the planner weighs it too, as stages 13 and 14 run it
# (`--pp-schedule interleaved1f1b --stages-per-rank V`; here V = 7, the most 126 blocks allow on 16 ranks). The
# curve below is the idle share at pp 16 against the micro-batches a step.

# %%
print("\n".join(plan.llama3_rows()))
micro = range(16, 129, 8)
fig, ax = plt.subplots(figsize=(6, 3))
ax.plot(micro, [15 / (m + 15) for m in micro], marker="o", label="1F1B (the stages)")
ax.plot(micro, [15 / 7 / (m + 15 / 7) for m in micro], marker="o", label="interleaved, V = 7 (the planner's)")
ax.set_xlabel("micro-batches a step, pp = 16")
ax.set_ylabel("share of the step idle")
ax.legend()
nb.show(fig)
