# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 04: the same DDP training, started by `torchrun`
#
# In stage 03 the script started its own processes and numbered them. Here a launcher does it:
# `torchrun` starts `--nproc_per_node` copies of the script and tells each one who it is through
# environment variables. The training code is untouched; what goes away is the process management
# (`mp.spawn`, picking a free port, `--world-size`). The same launcher also runs jobs over several
# machines (stage 05) and restarts failed ones (stage 06).

# %%
import sys

import nbtools as nb

cfg = nb.setup()

# %% [markdown]
# ## What torchrun tells each process
#
# Before the script, a one-line program under torchrun shows what each worker receives. (`--no-python`
# makes torchrun run the command as given rather than a Python script; each worker writes its line
# in one `os.write`, so the two lines do not interleave.)
#
# | variable | meaning | used for |
# |---|---|---|
# | `RANK` | this process's index in the whole job, 0 … W−1 | who logs and saves (`RANK == 0`) |
# | `LOCAL_RANK` | its index on this machine | which GPU: `cuda:LOCAL_RANK` |
# | `WORLD_SIZE` | processes in the job | the sampler's `num_replicas` |
# | `MASTER_ADDR`, `MASTER_PORT` | where rank 0's store listens | read by `init_process_group()` |
#
# `--standalone` means one machine: torchrun runs the rendezvous itself on a free port, so there is
# nothing to configure and nothing to collide with.

# %%
probe = ('import os; keys = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT OMP_NUM_THREADS"; '
         'os.write(1, (" ".join(k + "=" + os.environ.get(k, "-") for k in keys.split()) + "\\n").encode())')
env_run = nb.run([[*nb.TORCHRUN, "--standalone", f"--nproc_per_node={nb.WORLD}", "--no-python", sys.executable,
                   "-c", probe]], "04_env", timeout=60, quiet=True)
print("\n".join(sorted(env_run.stdout.splitlines())))

# %% [markdown]
# `OMP_NUM_THREADS=1` is torchrun's doing too (it warns about it on stderr): with several workers on
# one machine, each one starting a thread per core would oversubscribe the cores. Stage 03 had to do
# the equivalent itself with `torch.set_num_threads`.
#
# ## What changed from stage 03
#
# `main()` now reads `RANK`, `LOCAL_RANK` and `WORLD_SIZE`, and `init_process_group()` is called
# without a rank or world size: it reads them, and `MASTER_ADDR`/`MASTER_PORT`, from the environment
# (the `env://` method). When `RANK` is missing the script was started by plain `python`: it then
# makes a process group of one, with an in-memory store, so the same code also runs without torchrun.

# %%
nb.show_diff("03_ddp_spawn", "04_ddp_torchrun")

# %% [markdown]
# ## Run it: under torchrun, and as plain python
#
# Two workers of batch 32, then the same script as one ordinary process with batch 64, next to
# stage 01 at batch 64. The commands are printed as you would type them, `torchrun …`; the notebook
# runs `python -m torch.distributed.run …`, the same program, so that it is this kernel's Python.

# %%
ref = nb.reference(cfg)
tr = nb.run(cfg.step("04_ddp_torchrun", "torchrun"), "04_torchrun")
one = nb.run(cfg.step("04_ddp_torchrun", "python"), "04_python", quiet=True)

# %% [markdown]
# The torchrun warning lines are on stderr, the training log on stdout, and only rank 0 writes
# there.
#
# ## Same weights, whoever starts the processes

# %%
runs = {"04, torchrun 2 × 32": tr, "04, python 1 × 64": one}
diffs = nb.compare(ref, runs)
assert max(diffs.values()) <= nb.ATOL, diffs
if cfg.device == "cpu":  # one CPU process of batch 64 computes exactly what stage 01 does
    assert diffs["04, python 1 × 64"] == 0.0, diffs
nb.plot_runs(ref, runs, "04 over 01: one curve", ref_label="01, 1 × 64")

# %% [markdown]
# ## Equal up to rounding: float32, and why the check replays epochs
#
# These runs are in float64 (`--dtype float64`, as the tour runs them), so the two-process run
# ends ~1e-15 from stage 01. Training normally runs in float32, the stages' default. There, two
# processes averaging two means of 32 round differently from one process taking the mean of 64, and
# the weights differ from the first step on:

# %%
ref32 = nb.run(nb.with_args(cfg.step("01_single_gpu"), dtype="float32"), "04_ref_01_f32", quiet=True)
tr32 = nb.run(nb.with_args(cfg.step("04_ddp_torchrun", "torchrun"), dtype="float32"), "04_torchrun_f32",
              quiet=True)
diffs32 = nb.compare(ref32, {"04, torchrun 2 × 32, float32": tr32}, ref_label="01 (one process), float32")
assert 0.0 < diffs32["04, torchrun 2 × 32, float32"] <= nb.tolerance("float32"), diffs32

# %% [markdown]
# Not bit for bit, and training can amplify the gap: in float32 the final weights of these two runs
# are 3.9e-6 apart after 20 epochs and 0.25 apart after 60 (and even float64 ends 3.7e-2 apart
# after 60). That is rounding growing through chaotic late training, not DDP computing
# something else. What does not grow is the gap one epoch makes: `epoch replay` restarts stage 01's
# code from the run's weights and momentum before each epoch and compares the result with the
# run's next state. It stays at one epoch's rounding (~1e-6 in float32, ~1e-15 in float64) however
# long the run, while a bug such as a forgotten `set_epoch` is off by 1e-1. The tour checks that,
# with a tolerance of `sqrt(eps)` of the dtype. Measured over 60 epochs
# ([benchmarks/README.md](../benchmarks/README.md)):
#
# ![max |Δw| against the step, and the epoch replay's error](../benchmarks/rounding.png)

# %% [markdown]
# Next, [05_multinode](05_multinode.ipynb): the same job across several machines.
