# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 14: a mixture of experts, its experts over ep processes
#
# `14_experts/` turns every block's MLP of stage 13's GPT into E experts and a router that sends each
# token to k of them (`experts.py`); under `--ep N` the experts are shared out over N processes and
# each token travels to its experts and back by all-to-all. This notebook routes a handful of tokens
# by hand, shows what the balancing loss measures and which process holds which expert, and checks
# on a tiny copy of the model that ep 2 computes one process's training.

# %%
import nbtools as nb
import torch

ex14 = nb.load_stage("14_experts")

# %% [markdown]
# ## Routing a handful of tokens
#
# One `MoE` layer (width 8, E = 4 experts, k = 2), 6 tokens: the router's probabilities, each
# token's two experts and their gates (renormalised to sum to 1), and the tokens each expert takes.

# %%
torch.manual_seed(0)
moe = ex14.MoE(width=8, experts=4, top_k=2)
tokens = torch.randn(6, 8)
probs = moe.router(tokens).softmax(-1)
gates, chosen = probs.topk(2, dim=-1)
for t in range(6):
    print(f"token {t}: probabilities {[round(p, 2) for p in probs[t].tolist()]} -> experts {chosen[t].tolist()}, "
          f"gates {[round(g, 2) for g in (gates[t] / gates[t].sum()).tolist()]}")
print("tokens per expert:", torch.bincount(chosen.flatten(), minlength=4).tolist())

# %% [markdown]
# ## What the balancing loss measures
#
# E · Σᵢ fᵢ·Pᵢ: fᵢ the share of the routed pairs that went to expert i, Pᵢ the router's mean
# probability for it. 1 when both are even; up to E when one expert takes everything.

# %%
E, n = 4, 1000
even_probs = torch.full((n, E), 1 / E)
even_chosen = torch.arange(2 * n).remainder(E).view(n, 2)  # every expert equally often
print(f"even load: {ex14.balance_loss(even_probs, even_chosen, []).item():.3f}")
skewed_probs = torch.tensor([0.7, 0.2, 0.05, 0.05]).expand(n, E)
skewed_chosen = torch.tensor([0, 1]).expand(n, 2)  # experts 0 and 1 take every token
print(f"two experts take all: {ex14.balance_loss(skewed_probs, skewed_chosen, []).item():.3f}")

# %% [markdown]
# ## Who holds which experts
#
# ep consecutive dp × cp processes share out each block's experts, E/ep each (the expert weights
# are DTensors sharded by expert); the processes at the same place of each ep group hold the same
# experts and average their gradients (grid.py makes both groups). Eight dp processes, E = 8:

# %%
for ep in (2, 4, 8):
    holds = {r: list(range((r % ep) * 8 // ep, (r % ep + 1) * 8 // ep)) for r in range(8)}
    print(f"ep {ep}: " + " | ".join(f"rank {r}: {e}" for r, e in holds.items()))

# %% [markdown]
# ## One training, split or not
#
# A tiny copy of the GPT (2 blocks, width 32, context 24, 4 experts a block, k = 2) in float64, 6
# steps at a global batch of 4 windows: one process, and ep 2 (2 experts a process, 2 windows each,
# DDP for the rest). Each writes `model.pt`, the whole model, its experts gathered.

# %%
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "24", "--dtype", "float64", "--device", "cpu",
        "--max-steps", "6", "--eval-every", "3", "--sample", "0", "--lr", "0.01")
ways = {"1 process": nb.Step("14_experts", "python", (*TINY, "--batch-size", "4")),
        "ep 2": nb.Step("14_experts", "torchrun", (*TINY, "--ep", "2", "--batch-size", "2"), nproc=2)}
done = {label: nb.run(step, f"14_ep_{i}", quiet=True) for i, (label, step) in enumerate(ways.items())}
one, split = done["1 process"], done["ep 2"]
gap = nb.max_abs_diff(split.model, one.model)
print(f"ep 2 vs 1 process: max |Δw| {gap:.1e}; losses {[round(x, 6) for x in split.summary['losses']]}")
print("tokens per expert, step 6, block 0:", split.summary["experts"]["load"][-1][0],
      "(1 process:", one.summary["experts"]["load"][-1][0], ")")
assert gap <= nb.ATOL, gap
assert split.summary["experts"]["load"] == one.summary["experts"]["load"]

# %% [markdown]
# Equal to float64's rounding, and every expert took the same tokens. `tests/test_experts.py`
# checks more layouts (ep 4; dp 2 × ep 2 under FSDP2; all five dimensions on 16 processes, resumed
# from a checkpoint) and five planted bugs. The README has the load with and without the balancing
# loss, the speed, and the refusals.
