# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # When a job drifts or fails: four bugs, each seen and then found
#
# [debugging/](../debugging/) plants the bugs learners write into stage 04's training and finds each with the tool
# a practitioner would use. This notebook runs four of them, the quick ones that end by themselves: replicas that
# part silently, a seed per rank (and the dropout that does no harm), a NaN on one rank, and a layer the forward
# skips. For each: first the symptom, then the check that names its cause. (The hangs, which wait for their
# `--timeout`, are on the README's page.)
#
# `run_bugs` runs `debugging/bugs.py` as `python debugging/bugs.py FLAGS` would, its 2 ranks forked from this
# kernel (which has imported torch already, so a run takes a second or two), and returns what the job printed.

# %%
import json
import os
import sys
import tempfile

import matplotlib.pyplot as plt
import nbtools as nb

sys.path.insert(0, str(nb.ROOT / "debugging"))
import bugs  # noqa: E402  (stage 04's training, the bugs and the checks)


def run_bugs(*flags: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """bugs.main(flags), its ranks forked from this kernel: the exit status and what the job printed (the ranks write
    to this process's stdout and stderr, sent to a file meanwhile, from Python and from C++ alike)."""
    print("$ " + " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), "python debugging/bugs.py", *flags]))
    before = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    bugs.dist.set_debug_level_from_env()  # TORCH_DISTRIBUTED_DEBUG: read when torch started, and again here
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "out"), "a+") as out:  # a+: all append
        sys.stdout.flush()
        sys.stderr.flush()
        saved = sys.stdout, sys.stderr, os.dup(1), os.dup(2)
        sys.stdout = sys.stderr = out
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        try:
            bugs.main(list(flags))
            status = 0
        except SystemExit as e:  # bugs.main exits 1 when a rank failed
            status = e.code
        finally:
            out.flush()
            sys.stdout, sys.stderr = saved[:2]
            for fd, copy in ((1, saved[2]), (2, saved[3])):
                os.dup2(copy, fd)
                os.close(copy)
            for k, v in before.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            bugs.dist.set_debug_level_from_env()
        out.seek(0)
        printed = out.read()
    print(printed.rstrip() + f"\n(exit status {status})\n")
    return status, printed


# %% [markdown]
# ## Replicas that part silently
#
# Rank 0 zeroes a bias inside `if rank == 0:` (code meant for logging), at step 3. DDP averages gradients, not
# weights: it never sees the change, nothing fails, and the two ranks train two different models from then on.
# The replica check (a float64 sum of every parameter, all-gathered after every step) names the parameter and the
# step. `--no-replica-check` first: the symptom is that there is none.

# %%
status, quiet = run_bugs("--bug", "drift", "--no-replica-check")
assert status == 0 and "trained 8 steps" in quiet  # the run looks fine
status, printed = run_bugs("--bug", "drift")
assert status == 1 and f"replica check: step {bugs.BUG_STEP}: parameter head.2.bias differs" in printed

# %% [markdown]
# ## A seed per rank, and a dropout that depends on it
#
# `torch.manual_seed(seed + rank)` before `DDP(...)` is harmless: DDP's constructor broadcasts rank 0's weights.
# A dropout drawing its masks from it is harmless too: the masks differ, the gradients are averaged, every replica
# takes the same step. A layer drawn afresh *after* `DDP(...)` is not broadcast: the replicas part at step 0.
# The dropout run also writes its loss per step (`--losses`), to set beside the run without dropout.

# %%
losses = {}
with tempfile.TemporaryDirectory() as tmp:
    for bug in ("none", "dropout"):
        status, printed = run_bugs("--bug", bug, "--losses", f"{tmp}/{bug}.json")
        assert status == 0 and "every parameter equal on 2 ranks" in printed
        losses[bug] = json.loads(open(f"{tmp}/{bug}.json").read())
status, printed = run_bugs("--bug", "seed")
assert status == 1 and "replica check: step 0: parameter head.2.weight differs" in printed

fig, ax = plt.subplots(figsize=(6, 3))
for bug, label in (("none", "no dropout"), ("dropout", "dropout p=0.5, masks drawn per rank")):
    ax.plot(losses[bug], marker="o", label=label)
ax.set_xlabel("step")
ax.set_ylabel("mean loss over the 2 ranks")
ax.set_title("other numbers, the same replicas")
ax.legend()
nb.show(fig)
assert losses["none"] != losses["dropout"]  # the masks change the numbers, not the replicas' agreement

# %% [markdown]
# ## A NaN on one rank
#
# One corrupt sample in rank 1's batch at step 3. Its loss is NaN, so are its gradients, and the all-reduce spreads
# them: every parameter of both ranks ends NaN, and the replica check is silent (NaN on both). `--finite-check`
# all-gathers every rank's loss before `backward` and names the rank and the step.

# %%
status, printed = run_bugs("--bug", "nan")
assert status == 0 and "[rank 0] 6 of 6 parameters hold NaN or inf" in printed
status, printed = run_bugs("--bug", "nan", "--finite-check")
assert status == 1 and f"finite check: step {bugs.BUG_STEP}: the loss is nan on rank 1" in printed

# %% [markdown]
# ## A layer the forward skips
#
# A layer built in `__init__` and never called gets no gradient, so DDP's bucket that holds it never completes.
# DDP's own error comes at the second step; under `TORCH_DISTRIBUTED_DEBUG=INFO` it names the parameters.

# %%
status, printed = run_bugs("--bug", "unused", "--no-replica-check", env={"TORCH_DISTRIBUTED_DEBUG": "INFO"})
assert status == 1 and "Expected to have finished reduction in the prior iteration" in printed
named = [line for line in printed.splitlines() if "Parameters which did not receive grad" in line]
assert named and all(line.endswith("spare.bias, spare.weight") for line in named), named

# %% [markdown]
# `find_unused_parameters=True` (`--find-unused`) lets it train, at the cost of a walk of the autograd graph
# every step; the README measures it. The hangs (a collective only one rank calls, collectives in another order,
# a send and a receive that wait on each other) and a rank that fails alone are on the
# [README's page](../debugging/README.md), with the stack dumps, the flight recorder and torchrun's summary.
