# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 11: a GPT learns Shakespeare, with what the stages taught
#
# Every stage so far trained a 4,996-parameter MLP on synthetic data with a known answer. Stage 11
# trains a real model on real text: a decoder-only transformer (a small GPT, written out in
# `11_gpt/train.py`) on tiny Shakespeare, 1.1 MB of plays, one character per token. The techniques
# are the stages', each a flag: DDP or FSDP2 (`--parallel`), tensor parallelism (`--tp`), gradient
# accumulation (`--accumulate`), bf16 autocast (`--amp bf16`), `--compile`, and sharded checkpoints
# that resume on any number of ranks (`--snapshot`).
#
# | | stages 01–09 | stage 11 |
# |---|---|---|
# | model | MLP 8 → 64 → 64 → 4, 4,996 parameters | GPT: 4 blocks, width 128, 818,176 parameters |
# | data | 4,096 synthetic samples | 1,003,854 characters of Shakespeare (the last 10% held out) |
# | length of training | `--epochs` | `--max-steps`: random windows of the text, one order from `--seed` |
# | optimizer | SGD with momentum | AdamW: warm-up then cosine decay, decay on the matrices, clipping |
# | "it learned" | held-out accuracy > 95% | held-out loss below the bigram baseline |
#
# This notebook computes the baselines from the text, looks at the model, checks on a tiny copy of
# it that one process, DDP, FSDP2 and FSDP2 + tp compute the same training, and shows the default
# run as measured (2 minutes on 2 CPU cores: too long to repeat here).

# %%
import json
import math
import sys

import matplotlib.pyplot as plt
import nbtools as nb
import torch
from torch.utils.flop_counter import FlopCounterMode

gpt = nb.load_stage("11_gpt")
corpus = gpt.load_corpus(gpt.DATA)
print(f"{gpt.DATA.relative_to(nb.ROOT)}: {len(corpus.train) + len(corpus.held_out):,} characters, "
      f"{len(corpus.chars)} distinct: {corpus.chars!r}")
print(f"train on the first {len(corpus.train):,}, hold out the last {len(corpus.held_out):,}")

# %% [markdown]
# ## What "it learned" is measured against
#
# A loss alone says little: 2.0 nats per character, is that good? `baselines()` computes, from the
# text itself, the held-out loss of three models that need no training. **Uniform**: every character
# equally likely, ln 65 = 4.17. **Unigram**: each character as frequent as in the training text (a
# space is 15% of it). **Bigram**: the next character given this one, counted in the training text:
# after `q` comes `u`. A model below the bigram line has learned more than which letter follows
# which: spelling, words, the layout of a play. (Counts start at 1, so no held-out character gets
# probability 0; on the training text itself the same models score 3.31 and 2.45.)

# %%
floor = gpt.baselines(corpus)
print(" | ".join(f"{name} {value:.3f}" for name, value in floor.items()), "nats per character, held out")
v = len(corpus.chars)
counts = torch.bincount(corpus.train, minlength=v)
top = counts.argsort(descending=True)[:24]  # the most frequent characters
pairs = (torch.bincount(corpus.train[:-1] * v + corpus.train[1:], minlength=v * v).double() + 1).view(v, v)
following = (pairs / pairs.sum(1, keepdim=True))[top][:, top]
label = [repr(corpus.chars[i])[1:-1].replace(" ", "␣") for i in top]
fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw={"width_ratios": [1, 1.3]})
ax.bar(range(len(top)), (counts[top] / counts.sum()).tolist(), color="C0")
ax.set_xticks(range(len(top)), label, fontsize=8)
ax.set(title="unigram: how often each character comes (top 24)", ylabel="share of the training text")
im = bx.imshow(following, cmap="Blues")
bx.set_xticks(range(len(top)), label, fontsize=7)
bx.set_yticks(range(len(top)), label, fontsize=7)
bx.set(title="bigram: P(next | this), among the top 24", xlabel="next character", ylabel="this character")
fig.colorbar(im, ax=bx, fraction=0.046)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## The model
#
# `GPT` in `train.py`: a token embedding (what each character is) and a position embedding (where it
# is), then blocks of causal self-attention and an MLP, each reading a normalised copy of the
# residual stream and adding its result back (pre-norm), a final norm, and a head that scores the 65
# possible next characters at every position. `scaled_dot_product_attention(..., is_causal=True)`
# lets position *i* see positions 0..*i* only: the model predicts each character from those before
# it, 64 predictions per window. Almost every parameter sits in the blocks' matrices, which is
# what FSDP2 shards and tensor parallelism splits.

# %%
nb.show_outline("11_gpt")
cfg = gpt.Config(vocab=v)
model = gpt.GPT(cfg)
parts: dict[str, int] = {}
for name, p in model.named_parameters():
    part = name.split(".")[0] if not name.startswith("blocks") else "blocks: " + name.split(".")[2]
    parts[part] = parts.get(part, 0) + p.numel()
total = sum(parts.values())
for part, n in parts.items():
    print(f"{part:<16} {n:>9,}  {n / total:6.1%}")
print(f"{'total':<16} {total:>9,}; training FLOPs per token (6N + attention): {gpt.flops_per_token(cfg):,}")

# %% [markdown]
# ## One training, however it is split
#
# As in every stage, the data order comes from `--seed` alone: step *s* draws its global batch of
# windows from a generator seeded with seed + *s*, and dp rank *r* of *W* takes rows *r*, *r + W*, …;
# so *W* ranks of batch *b* see exactly the windows of one process of batch *W·b*. A tiny copy of
# the model (2 blocks, width 32, context 32) in float64, global batch 4, 8 steps, six ways: one
# process; DDP over 2 processes of batch 1 with `--accumulate 2`; FSDP2 over 2 processes of batch 2;
# FSDP2 + tp on a dp 1 × tp 2 mesh (both processes on the same 4 windows, each with one of the 2
# heads of every block); the same with `--sp`; and HSDP on 4 processes. Each writes `model.pt`, the
# whole model.
#
# `--sp` (sequence parallelism) splits what tp leaves whole on every tp rank, the norms, the residual
# stream and dropout, by position over the tp group: each tp rank holds t/tp of the sequence between
# the blocks' matmuls, an all-gather before them and a reduce-scatter after them replace the
# all-reduce, and the loss is taken on the vocabulary-sharded logits (`loss_parallel`) without
# gathering them. The norms' weights see only their rank's positions, so their gradients are summed
# over tp. `--replicate R` (HSDP) splits the dp processes into R replicas of dp/R: FSDP2 shards inside
# a replica (its all-gathers on a node's fast links) and all-reduces the sharded gradients across
# replicas.

# %%
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "32", "--dtype", "float64", "--device", "cpu",
        "--max-steps", "8", "--eval-every", "4", "--sample", "0", "--lr", "0.01")
ways = {
    "1 process, batch 4": nb.Step("11_gpt", "python", (*TINY, "--batch-size", "4")),
    "DDP 2 x 1, accumulate 2": nb.Step("11_gpt", "torchrun", (*TINY, "--batch-size", "1", "--accumulate", "2"),
                                       nproc=2),
    "FSDP2 2 x 2": nb.Step("11_gpt", "torchrun", (*TINY, "--batch-size", "2", "--parallel", "fsdp"), nproc=2),
    "FSDP2 + tp, 1 x 2": nb.Step("11_gpt", "torchrun", (*TINY, "--batch-size", "4", "--parallel", "fsdp", "--tp", "2"),
                                 nproc=2),
    "FSDP2 + tp --sp, 1 x 2": nb.Step("11_gpt", "torchrun", (*TINY, "--batch-size", "4", "--parallel", "fsdp",
                                                             "--tp", "2", "--sp"), nproc=2),
    "HSDP 2 x 2 of batch 1": nb.Step("11_gpt", "torchrun", (*TINY, "--batch-size", "1", "--parallel", "fsdp",
                                                            "--replicate", "2"), nproc=4),
}
done = {label: nb.run(step, f"11_gpt_{i}", quiet=True) for i, (label, step) in enumerate(ways.items())}

# %%
one = done["1 process, batch 4"]
fig, ax = plt.subplots(figsize=(9, 3.6))
for i, (label, r) in enumerate(done.items()):
    s = r.summary
    gap = nb.max_abs_diff(r.model, one.model)
    print(f"{label:<26} world {s['world_size']}, dp {s['dp']} x tp {s['tp']}, global batch {s['global_batch']}: "
          f"max |Δw| vs 1 process {gap:.1e}, held-out {s['eval_loss']:.6f}")
    assert gap <= nb.ATOL, (label, gap)
    style = {"lw": 7, "color": "0.75"} if i == 0 else {"marker": "ox^sv"[i - 1], "ls": "--", "lw": 1, "color": f"C{i}"}
    ax.plot(range(1, len(s["losses"]) + 1), s["losses"], label=label, zorder=1 + i, **style)
ax.set(xlabel="step", ylabel="training loss", title="six ways to split one training: one curve")
ax.legend(fontsize=8)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# All within float64's rounding of each other (the tolerance is the tour's, 1.5e-8). The tests
# (`tests/test_gpt.py`) check this state by state, AdamW's moments included, resume a checkpoint
# written by 2 FSDP ranks on a dp 1 × tp 2 mesh, resume one process bit for bit, and drop the causal
# mask on one rank of a DDP run as a negative control: that run is off by 5.8e-2 after 3 steps.
#
# ## The default run, as measured
#
# `torchrun --standalone --nproc_per_node=2 11_gpt/train.py --out runs/11_gpt`: 2 processes of 16
# windows of 64 characters, 800 steps of 2,048 tokens. Its summary is kept beside the stage
# (`11_gpt/default_run.json`); it took 126 s on a 2-core CPU, nanoGPT's CPU run 145 s beside it
# (the README shows what it printed, and both runs' curves).

# %%
run = json.loads((nb.ROOT / "11_gpt" / "default_run.json").read_text())
fig, ax = plt.subplots(figsize=(9, 4.2))
losses, k = run["losses"], 20
ax.plot(range(1, len(losses) + 1), losses, color="C0", alpha=0.25, lw=0.8)
ax.plot(range(k, len(losses) + 1), [sum(losses[j - k:j]) / k for j in range(k, len(losses) + 1)], color="C0",
        label="training loss (20-step mean)")
ax.plot([c[0] for c in run["curve"]], [c[2] for c in run["curve"]], "o--", color="C1", ms=3,
        label="held-out (16 windows)")
ax.plot([run["steps"]], [run["eval_loss"]], "D", color="C1", ms=8, label=f"held-out, all: {run['eval_loss']:.3f}")
for (name, value), style in zip(run["baselines"].items(), (":", "-.", "--"), strict=True):
    ax.axhline(value, color="0.4", ls=style, lw=1)
    ax.text(1, value, f" {name} {value:.2f}", va="bottom", fontsize=8, color="0.3")
ax.set(xlabel="step", ylabel="nats per character", ylim=(1.0, 4.5),
       title=f"the default run: {run['world_size']} processes, {run['tokens_per_s']:,.0f} tokens/s")
ax.legend(fontsize=8)
fig.tight_layout()
nb.show(fig)
below = floor["bigram"] - run["eval_loss"]
print(f"held-out {run['eval_loss']:.3f} nats/char: {below:.2f} below the bigram baseline, perplexity "
      f"{math.exp(run['eval_loss']):.1f} characters (uniform: {v})")
assert run["eval_loss"] < floor["bigram"]
print(f"\nits sample:\n{run['sample']}")

# %% [markdown]
# ## Recomputing instead of keeping: `--ac`
#
# A block's forward keeps tensors for its backward: the norms' inputs, q, k and v, the MLP's wide
# hidden layer. `--ac full` keeps the block's input alone and runs the block's forward again in
# backward; `--ac selective` keeps the outputs of the matmuls and of attention and recomputes the
# cheap ops between them (`parallelize.checkpointed`). Below, one forward and backward of the
# default model (4 blocks, width 128, context 64) on 16 windows, in float64, each way: the
# gradients are the same to the bit, and backward's FLOPs show what each way recomputes.

# %%
par = sys.modules["stage_11_gpt.parallelize"]  # the stage's parallelize.py, as load_stage imported it
idx = torch.randint(0, len(corpus.chars), (16, 65), generator=torch.Generator().manual_seed(0))
grads, flops = {}, {}
for ac in ("none", "full", "selective"):
    torch.manual_seed(0)
    model = gpt.GPT(gpt.Config(len(corpus.chars))).double()
    if ac != "none":
        for block in model.blocks:
            par.checkpointed(block, ac)
    loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    grads[ac] = [p.grad for p in model.parameters()]
    flops[ac] = counter.get_total_flops()
for ac in grads:
    same = all(torch.equal(a, b) for a, b in zip(grads[ac], grads["none"], strict=True))
    print(f"--ac {ac:<9} backward {flops[ac] / 1e9:6.2f} GFLOP ({flops[ac] / flops['none'] - 1:+.0%}), "
          f"gradients bit-equal to --ac none: {same}")
    assert same
assert flops["full"] > flops["selective"] >= flops["none"]

# %% [markdown]
# Full recomputes the blocks' forward (a third more FLOPs than backward alone here; torch stops
# each recomputation once backward has what it needs, before the block's last matmul); selective
# recomputes no matmul, so its FLOPs are backward's own. What each keeps is
# counted in the README's `--ac` table and `tests/test_activation_checkpointing.py`: per block, 16
# residual streams without it, 1 with full, 11 with selective.

# %% [markdown]
# ## Also in the stage, not run here
#
# - `--parallel fsdp --tp 2` with more processes: a dp × tp mesh as in stage 09, the attention split
#   by heads (q, k, v column-wise, the output projection row-wise) and the MLP as 09's pair.
# - `--snapshot DIR`: stage 08's sharded checkpoints, resumed exactly on any layout (the data of a
#   step depends on `--seed` and the step alone, so no random state needs saving).
# - On a GPU: `--amp bf16 --compile`, and the model FLOPs utilisation (MFU) against the GPU's data
#   sheet (on a CPU the run measures its own matmul peak: the default run printed 49.7%). Not run by
#   this tutorial (no GPU); `11_gpt/GPU.md` lists settings for one GPU and for several.
