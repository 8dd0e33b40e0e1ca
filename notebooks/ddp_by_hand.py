# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Data parallelism by hand: what DDP does during backward
#
# From stage 03 on, `DistributedDataParallel` averages the gradients over the ranks, and the READMEs say how:
# in ~25 MB buckets, in reverse order, each bucket's all-reduce launched while backward still computes the
# earlier layers, everything waited for before `optimizer.step()`. This notebook builds that by hand
# ([ddp_by_hand/](../ddp_by_hand/)), in two steps, runs both against stage 01 and DDP, watches the hooks fire
# in order, and then looks at a profiler trace where the overlap can be seen and measured.

# %%
import csv
import difflib
import importlib.util
import sys

import matplotlib.pyplot as plt
import nbtools as nb
import torch
import torch.distributed as dist
import torch.nn.functional as F

cfg = nb.setup()
HAND = nb.ROOT / "ddp_by_hand"


def markdown(text: str) -> None:
    """Rendered in Jupyter; printed when this file runs as a plain script."""
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(text))
            return
    except ImportError:
        pass
    print(text)


def lesson_diff(old: str, new: str) -> None:
    """`diff -u` of two scripts' lessons (the part above `The lesson ends here`: the machinery below is the same)."""
    def lesson(path: str) -> list[str]:
        return (nb.ROOT / path).read_text().split("# ═══ The lesson ends here")[0].rstrip().splitlines()
    lines = list(difflib.unified_diff(lesson(old), lesson(new), old, new, n=1, lineterm=""))
    added = sum(line.startswith("+") and not line.startswith("+++") for line in lines)
    removed = sum(line.startswith("-") and not line.startswith("---") for line in lines)
    markdown(f"**{new} vs {old}**: {added} lines added, {removed} removed\n\n```diff\n" + "\n".join(lines) + "\n```")


def load(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# %% [markdown]
# ## The idea, in a picture
#
# Backward computes the gradients from the last layer to the first. The naive way waits for all of them, then
# sends them. DDP's way sends a bucket as soon as backward has filled it, so the communication runs under the
# computation that is still to come, and only what is left when backward ends delays the step. (A sketch with
# made-up durations; the real thing, measured, is further down.)

# %%
def sketch(ax, title: str, overlapped: bool) -> None:
    layers, t = ["layer 4", "layer 3", "layer 2", "layer 1"], 0.0
    sends = []
    for i, layer in enumerate(layers):  # backward: one block per layer, last layer first
        ax.broken_barh([(t, 1.0)], (1.1, 0.8), color="tab:blue")
        ax.text(t + 0.5, 1.5, f"backward\n{layer}", ha="center", va="center", color="white", fontsize=8)
        t += 1.0
        if i % 2 == 1:  # a bucket holds two layers' gradients
            sends.append(t)
    start = 0.0
    for k, ready in enumerate(sends):
        start = max(start, ready if overlapped else t)  # one all-reduce at a time
        ax.broken_barh([(start, 1.3)], (0.1, 0.8), color=["tab:orange", "tab:purple"][k])
        ax.text(start + 0.65, 0.5, f"all-reduce\nbucket {k}", ha="center", va="center", fontsize=8)
        start += 1.3
    ax.axvline(start, color="tab:red", ls="--")
    ax.text(start + 0.05, 2.05, "optimizer.step()", color="tab:red", fontsize=8)
    ax.set(yticks=[0.5, 1.5], yticklabels=["gloo's thread", "main thread"], xlim=(0, 7.2), ylim=(0, 2.4),
           title=title)
    ax.set_xlabel("time")


fig, (a, b) = plt.subplots(1, 2, figsize=(12, 2.6))
sketch(a, "all-reduce after backward (naive)", overlapped=False)
sketch(b, "each bucket as soon as it is full (DDP)", overlapped=True)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## Step 1: naive
#
# `naive.py` is stage 04 with `DDP(model)` replaced by a short class, `HandDDP`: it broadcasts rank 0's weights
# (what DDP's constructor does), and `sync_gradients()`, called between `loss.backward()` and
# `optimizer.step()`, all-reduces each parameter's gradient and divides it by the world size.

# %%
lesson_diff("04_ddp_torchrun/train.py", "ddp_by_hand/naive.py")

# %% [markdown]
# ## Step 2: buckets, launched during backward
#
# `bucketed.py` changes `HandDDP` only: the parameters go into buckets in reverse order, a
# `register_post_accumulate_grad_hook` on each parameter counts the gradients its bucket still waits for, and
# the hook that completes a bucket launches its all-reduce with `async_op=True`; `sync_gradients()` now only
# waits, divides and copies back. `no_sync()` keeps the hooks quiet for gradient accumulation.

# %%
lesson_diff("ddp_by_hand/naive.py", "ddp_by_hand/bucketed.py")

# %% [markdown]
# ## Run both, against stage 01 and stage 04's DDP
#
# With the tour's settings (2 ranks of 32, float64, 5 epochs), next to stage 01 at batch 64 and stage 04. The
# scripts keep the stages' `--out` files, so the tour's check applies as it is: every recorded epoch is replayed
# with stage 01's code.

# %%
ddp_step = cfg.step("04_ddp_torchrun", "torchrun")
ref = nb.reference(cfg)
ddp = nb.run(ddp_step, "04_torchrun", quiet=True)
hand = {}
for name in ("naive", "bucketed"):
    cmds = ddp_step.commands(out=nb.RUNS / f"hand_{name}", script=HAND / f"{name}.py")
    hand[name] = nb.run(cmds, f"hand_{name}", env=ddp_step.env, quiet=True)
    print(hand[name].stdout.strip().splitlines()[-1], "\n")

# %%
diffs = nb.compare(ref, {"naive.py, 2 × 32": hand["naive"], "bucketed.py, 2 × 32": hand["bucketed"],
                         "04 (DDP), 2 × 32": ddp})
assert max(diffs.values()) <= nb.ATOL, diffs
for name, run in hand.items():
    s = run.summary
    print(f"{name}: {s['allreduce_calls_per_step']:g} all-reduce(s) per step, "
          f"{s['allreduce_bytes_per_step']:,.0f} bytes; buckets {s['buckets']}")
assert hand["naive"].summary["allreduce_bytes_per_step"] == hand["bucketed"].summary["allreduce_bytes_per_step"]

# %% [markdown]
# Same bytes, 6 calls against 1: the model is 40 KB, so every gradient fits DDP's first bucket. And with two
# ranks, both hand-built versions end at DDP's weights **bit for bit**, every epoch: with two ranks each element
# is one addition (`a + b = b + a`) and halving is exact, so neither the bucket layout nor dividing after the sum
# (DDP multiplies by 1/W before) can change a bit. With 3 or 4 ranks they differ by one rounding, and
# `ddp_by_hand/vs_ddp.py` shows which of DDP's two habits causes each difference (see the README).

# %%
if cfg.gpus < 2:  # the 2-process runs ran on the CPU (gloo), DDP's too: the same arithmetic
    for name, run in hand.items():
        same = all(a is b is None or torch.equal(a, b)  # momentum is None before the first step
                   for x, y in zip(run.trajectory, ddp.trajectory, strict=True)
                   for a, b in zip(x["params"] + x["momentum"], y["params"] + y["momentum"], strict=True))
        print(f"{name}.py: every epoch's weights and momentum equal DDP's bit for bit: {same}")
        assert same

# %% [markdown]
# ## The hooks, firing
#
# In this process, a group of one (as `python bucketed.py` makes): the stages' model with 0.01 MiB buckets,
# which splits it in two. A spy on `dist.all_reduce` and a second hook on every parameter print what happens
# during one `loss.backward()`. The first bucket (the last layers) goes out while backward is still computing
# the first layer's gradients. The negative control from `overlap.py` runs the same code but holds every
# launch back until backward has returned.

# %%
bucketed = load(HAND / "bucketed.py", "hand_bucketed")
control_class = load(HAND / "overlap.py", "hand_overlap").LaunchAfterBackward
def one_backward(cls) -> tuple[list[list[str]], list[str]]:
    """One backward of the stages' model wrapped in `cls` (0.01 MiB buckets): its buckets, and what happened."""
    torch.manual_seed(0)
    net = bucketed.Net().double()
    model = cls(net, 0.01, 0.01)
    events = []
    for name, p in net.named_parameters():  # after the bucket hook: it fires second
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"  gradient ready: {name}"))

    def spy(tensor, *args, **kwargs):
        events.append(f"  LAUNCH all-reduce of {tensor.numel()} numbers")
        return real_all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = spy
    try:
        F.cross_entropy(model(torch.randn(16, 8, dtype=torch.float64)), torch.zeros(16, dtype=torch.long)).backward()
        events.append("  -- loss.backward() has returned --")
        model.sync_gradients()
    finally:
        dist.all_reduce = real_all_reduce
    return model.buckets, events


dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
real_all_reduce = dist.all_reduce
for label, cls in (("bucketed.HandDDP", bucketed.HandDDP), ("the control, launched after backward", control_class)):
    buckets, events = one_backward(cls)
    print(f"{label}, buckets {buckets}:\n" + "\n".join(events) + "\n")
dist.destroy_process_group()

# %% [markdown]
# (Each parameter's bucket hook was registered first, so the launch prints just before the "gradient ready"
# line of the gradient that completed the bucket.)
#
# ## The overlap, measured
#
# `ddp_by_hand/overlap.py` trains an MLP big enough for the all-reduces to take as long as backward (six
# 2048 × 2048 layers, 96 MiB of gradients), under `torch.profiler`, with torch's DDP, `HandDDP`, and the
# control. gloo records each all-reduce on its own worker thread, so one trace holds both: backward's
# operators on the main thread, the buckets' all-reduces beside them. This is the figure from the README, made
# on a 2-core machine (its numbers and caveats are there):
#
# ![timeline](../ddp_by_hand/timeline.png)
#
# A small run here, on a model of four 512 × 512 layers (its first bucket holds the output layer and the last
# 512 × 512 layer, the second the other three), and its timeline:

# %%
quick = nb.run([[sys.executable, str(HAND / "overlap.py"), "--hidden", "512", "--layers", "4", "--bucket-mb", "1000",
                 "--rounds", "1", "--out", str(nb.RUNS / "overlap_quick")]], "overlap_quick")
with open(nb.RUNS / "overlap_quick" / "overlap.csv", newline="") as f:
    measured = {r["name"]: r for r in csv.DictReader(f)}
assert float(measured["hand, after backward 25/1 MiB"]["overlap"]) == 0.0, "the control: launched after backward"
assert measured["ddp 25/1 MiB"]["ddp_bucket_bytes"] == measured["hand 25/1 MiB"]["bucket_bytes"], "DDP's buckets"

# %%
try:
    from IPython import get_ipython
    from IPython.display import Image, display
    if get_ipython() is not None:
        display(Image(filename=str(nb.RUNS / "overlap_quick" / "timeline.png")))
except ImportError:
    pass

# %% [markdown]
# The control hides nothing: by construction, its all-reduces start after backward. `HandDDP` and DDP hide
# part of theirs, and the sweep in the README shows how that depends on the buckets: one bucket per parameter
# starts the first all-reduce earliest but pays the fixed cost of a call per parameter; one bucket for the
# whole model can only start when backward has finished, like the control.
#
# ![sweep](../ddp_by_hand/sweep.png)
#
# On a 2-core machine the hidden communication is not free: gloo's threads need a core too, and with two ranks
# the two cores are already busy computing. In the README's measurement two thirds of the all-reduce time ran
# under backward, but backward stretched from 97 to 140 ms and the step shrank by only ~6%, within the noise.
# On GPUs, nccl's kernels and the network run beside the compute kernels, so the hidden time comes off the step:
# that is what DDP's overlap is for (not measured here: this tutorial has run on one GPU only, never on two).
#
# Back to the [README](../ddp_by_hand/README.md), or on to [05_multinode](05_multinode.ipynb).
