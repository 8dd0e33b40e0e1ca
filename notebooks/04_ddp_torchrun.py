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
ref = nb.run(cfg.step("01_single_gpu"), "04_ref_01", quiet=True)
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
# Next, [05_multinode](05_multinode.ipynb): the same job across several machines.
