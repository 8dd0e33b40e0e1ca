# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Sharding by hand: ZeRO-1, ZeRO-2, ZeRO-3
#
# DDP keeps a whole copy of the training on every rank: the weights, their gradients and the optimizer's state.
# ZeRO removes that redundancy in three steps, and FSDP (stage 08) is the third. This notebook follows
# [zero_by_hand/](../zero_by_hand/): what each rank keeps, on paper and counted; the third step run and replayed
# against stage 01; its gathers watched in order, the prefetch among them; and the three scripts against torch's
# DDP, `ZeroRedundancyOptimizer` and FSDP2, weight for weight.

# %%
import contextlib
import csv
import io
import sys

import matplotlib.pyplot as plt
import nbtools as nb
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

cfg = nb.setup()
ZERO = nb.ROOT / "zero_by_hand"
sys.path.insert(0, str(ZERO))
import vs_library  # noqa: E402  (it imports zero1.py, zero2.py and zero3.py, and tools/)
import zero3  # noqa: E402

from tools.cli import free_port, gloo_group  # noqa: E402

# %% [markdown]
# ## What each rank keeps, on paper
#
# With AdamW in float32, a weight costs 16 bytes in training: 4 for itself, 4 for its gradient, 8 for AdamW's two
# moments (a running mean of the gradient and of its square). Each ZeRO step keeps 1/W of one more of the three
# on each rank. For the 100 MB MLP that `memory.py` measures (Ψ = 25.2 M weights):

# %%
PSI = 25_210_896
ways = {"DDP": lambda w: 16, "ZeRO-1": lambda w: 8 + 8 / w, "ZeRO-2": lambda w: 4 + 12 / w,
        "ZeRO-3 (FSDP)": lambda w: 16 / w}
worlds = [1, 2, 4, 8, 16, 64]
fig, ax = plt.subplots(figsize=(7, 3.5))
for name, per_weight in ways.items():
    ax.plot(worlds, [per_weight(w) * PSI / 2**20 for w in worlds], marker="o", label=name)
ax.set_xscale("log", base=2)
ax.set_xlabel("W (ranks)")
ax.set_ylabel("MiB per rank")
ax.set_title("weights + gradients + AdamW's moments, per rank")
ax.legend()
nb.show(fig)
print("at W = 64:", ", ".join(f"{name} {f(64) * PSI / 2**20:.0f} MiB" for name, f in ways.items()))

# %% [markdown]
# ZeRO-1 and ZeRO-2 level off at the weights they keep whole (8Ψ and 4Ψ bytes); only ZeRO-3 keeps falling, because
# it shards the weights too, and pays for it by gathering each unit of the model before it computes, twice a step.

# %% [markdown]
# ## ZeRO-3 by hand, against stage 01
#
# `zero3.py` at the notebooks' settings (2 ranks, float64, AdamW). Its `--out` files are the stages', so stage 01's
# replay applies: each recorded epoch, replayed with stage 01's loop and torch's AdamW from the run's weights and
# moments, must land on the run's next state.

# %%
step = cfg.step("04_ddp_torchrun", "torchrun")
cmds = step.commands(out=nb.RUNS / "zero3", script=ZERO / "zero3.py")
run = nb.run(cmds, "zero3", env=step.env)
replay = nb.replay_error(run.summary, run.trajectory)
print(f"epoch replay against stage 01's code: {replay:.1e} (tolerance {nb.ATOL:.1e})")
assert replay <= nb.ATOL and run.summary["optimizer"] == "AdamW"

# %% [markdown]
# ## The gathers, in order
#
# Two ranks forked from this kernel run one step of `zero3.py`'s `HandFSDP` on the stages' model, with a spy on
# the all-gather and a hook on every Linear's forward and every parameter's gradient. Watch the order: the head's
# gather is posted before the body computes (prefetch), the head is gathered again for its backward with the
# body's gather posted right behind it, and each unit's gradients come only after its weights are whole.

# %%
def one_step(rank: int, world: int, port: int, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, port, timeout=60):
        torch.manual_seed(0)
        net = zero3.Net().double()
        model = zero3.HandFSDP(net, [net.body, net.head])
        optimizer = zero3.ShardedOptimizer(model, torch.optim.AdamW, lr=0.01)
        events, real = [], zero3.dist.all_gather_single

        def gather(output, shard, *args, **kwargs):
            events.append(f"all-gather of unit {[s is shard for s in model.param_shards].index(True)} posted")
            return real(output, shard, *args, **kwargs)
        zero3.dist.all_gather_single = gather  # this forked rank's torch.distributed only
        for name, module in net.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda m, a, name=name: events.append(f"  forward of {name}"))
        for name, p in net.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"  gradient of {name}"))
        g = torch.Generator().manual_seed(rank)
        F.cross_entropy(model(torch.randn(16, 8, generator=g, dtype=torch.float64)),
                        torch.randint(0, 4, (16,), generator=g)).backward()
        model.sync_gradients()
        optimizer.step()
        if rank == 0:
            results.put(events)


results = mp.get_context("fork").SimpleQueue()
mp.start_processes(one_step, args=(2, free_port(), results), nprocs=2, start_method="fork")
events = results.get()
print("\n".join(events))
assert events.index("all-gather of unit 1 posted") < events.index("  forward of body.0")  # prefetched
backward = events[events.index("  forward of head.2") + 1:]
assert backward[:2] == ["all-gather of unit 1 posted", "all-gather of unit 0 posted"], backward

# %% [markdown]
# ## Against the library, weight for weight
#
# `vs_library.py` trains a few steps every way on each rank's own batch and compares the weights: with DDP +
# AdamW, with `HandDDP` (DDP's averaging by hand, nothing sharded) + AdamW, and with FSDP2 + AdamW. At W = 2 a
# sum of two numbers does not depend on its order and halving is exact: every way must be every other, to the bit.

# %%
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    vs_library.main(["--world-sizes", "2", "--steps", "3"])
print(printed.getvalue())
rows = [line.split() for line in printed.getvalue().splitlines() if line.startswith("2 ")]
assert len(rows) == 6 and all(cell == "0" for row in rows for cell in row[-6:]), rows

# %% [markdown]
# At W = 3 the order of additions shows: the README's table has each family (torch's DDP and ZeRO-1; the hand-built
# ZeRO-1 and ZeRO-2 with `HandDDP`) exact within itself, and ZeRO-3 within 1e-16 of FSDP2.
#
# ## What each rank keeps, counted
#
# `memory.py` counted it on the 100 MB MLP (the README's run, committed as `memory.csv`): the live tensors' bytes on
# rank 0 after a step, against the formula, the transient peak during a step, and what each rank sends.

# %%
with open(ZERO / "memory.csv", newline="") as f:
    measured = list(csv.DictReader(f))
print(f"{'way':18} {'W':>2} {'kept MiB':>9} {'formula':>8} {'transient':>9} {'sent MiB':>9}")
for r in measured:
    print(f"{r['way']:18} {r['W']:>2} {float(r['total_MiB']):9.1f} {float(r['formula_MiB']):8.1f} "
          f"{float(r['transient_MiB']):9.1f} {float(r['sent_MiB']):9.1f}")
assert all(abs(float(r["ratio"]) - 1) <= 0.05 for r in measured)

# %% [markdown]
# FSDP2's `reshard_after_forward=False` keeps each unit whole from its forward to its backward: it sends what ZeRO-2
# sends (one all-gather a step, not two) and its transient grows towards the whole model's weights; between steps it
# keeps 1/W of everything, as ZeRO-3 does. `True` (the default) is ZeRO-3.
