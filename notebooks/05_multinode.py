# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Stage 05: the same job over several machines
#
# You run `torchrun` once on every machine (node). Each starts the processes of its own node, and
# all of them together form **one** process group, with one global rank 0. The training code does
# not change. Two things do: how the nodes find each other, and that each process now has three
# numbers instead of one.

# %%
import matplotlib.pyplot as plt
import nbtools as nb

cfg = nb.setup()

# %% [markdown]
# ## Node, local rank, global rank
#
# - `GROUP_RANK`, the **node**: 0 … nnodes − 1, from `--node_rank` or given by the rendezvous;
# - `LOCAL_RANK`: the process's index on its node. It picks the GPU, `cuda:LOCAL_RANK`, because
#   every node numbers its own GPUs from 0;
# - `RANK`, the **global** rank: `node · nproc_per_node + local_rank`. It decides who logs and saves:
#   `RANK == 0` is one process in the whole job. (`LOCAL_RANK == 0` would be one per node: several
#   writers of the same file on a shared filesystem.)
#
# Two nodes with two GPUs each:

# %%
nodes, per_node = 2, 2
fig, ax = plt.subplots(figsize=(8, 3.2))
for node in range(nodes):
    for local in range(per_node):
        rank = node * per_node + local
        y = nodes - 1 - node
        ax.add_patch(plt.Rectangle((local + 0.05, y + 0.08), 0.9, 0.84, color="C3" if rank == 0 else "C0",
                                   alpha=0.85))
        note = "\nlogs and saves" if rank == 0 else ""
        ax.text(local + 0.5, y + 0.5, f"RANK {rank}\nLOCAL_RANK {local}\ncuda:{local}{note}", ha="center",
                va="center", color="white", fontsize=10)
    ax.text(-0.1, nodes - 1 - node + 0.5, f"node {node}\n(GROUP_RANK {node})\n10.0.0.{node + 1}", ha="right",
            va="center", fontsize=10)
ax.set(xlim=(-1.3, per_node + 0.1), ylim=(0, nodes), xticks=[], yticks=[],
       title="RANK = node × nproc_per_node + LOCAL_RANK        (WORLD_SIZE = 4)")
ax.spines[:].set_visible(False)
fig.tight_layout()
nb.show(fig)

# %% [markdown]
# ## How the nodes meet
#
# **Static form**: you choose node 0 and tell every node where it is. Node 0's torchrun opens a
# store at `--master_addr:--master_port`, the others connect to it, and the workers then use it to
# find each other. Every node gets the same command except `--node_rank`:
#
# ```
# torchrun --nnodes=2 --nproc_per_node=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=29500 \
#     05_multinode/train.py                                      # on 10.0.0.1
# torchrun --nnodes=2 --nproc_per_node=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=29500 \
#     05_multinode/train.py                                      # on 10.0.0.2
# ```
#
# **Rendezvous form** (`--rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --rdzv_id=JOB`): the nodes
# meet at an endpoint under a job name and are numbered for them, so every node runs the *same*
# command. Convenient for schedulers, but you do not choose which machine becomes node 0.
# `05_multinode/README.md` covers the flags that real networks need (`--local_addr`,
# `--rdzv_conf=is_host=1`, `GLOO_SOCKET_IFNAME`) and what goes wrong without them.
#
# ## What changed from stage 04
#
# Very little. `main()` also reads `GROUP_RANK`, and `gather_layout()` collects every rank's
# `{rank, node, local_rank, host}` with `all_gather_object`, a collective, so every rank calls it.
# Rank 0 prints the grid and puts it in `summary.json`.

# %%
nb.show_diff("04_ddp_torchrun", "05_multinode")

# %% [markdown]
# ## Two nodes on this machine
#
# Two torchruns play two nodes on 127.0.0.1, one process each (the notebook starts both, each with
# its own `--node_rank`; in a terminal you would use two windows). The port is a free one picked just
# before the launch (`tour.free_port`), never a fixed number that another job may hold.
# `OMP_NUM_THREADS=1` is set by hand, because torchrun sets it only when *it* starts several
# processes, and here two "nodes" share the same cores. With two or more GPUs, two nodes on one
# machine would both claim `cuda:0`, so there the plan runs one node of two processes instead.

# %%
ref = nb.reference(cfg)
multi = nb.run(cfg.step("05_multinode"), "05_multinode")

# %% [markdown]
# Only one of the two torchruns printed the log: the one holding global rank 0. The layout rank 0
# gathered, from `summary.json`:

# %%
layout = multi.summary["layout"]
nproc = len(layout) // multi.summary["nodes"]  # processes per node
for p in layout:
    print(f"node {p['node']} ({p['host']}) | local rank {p['local_rank']} | global rank {p['rank']}")
assert all(p["rank"] == p["node"] * nproc + p["local_rank"] for p in layout), "not node-major"

# %% [markdown]
# ## Same weights as stage 01, across nodes

# %%
label = f"05, {multi.summary['nodes']} node(s), {multi.summary['world_size']} × {nb.BATCH}"
diffs = nb.compare(ref, {label: multi})
assert max(diffs.values()) <= nb.ATOL, diffs
nb.plot_runs(ref, {label: multi}, "05 over 01: one curve", ref_label="01, 1 × 64")

# %% [markdown]
# ## On a Slurm cluster
#
# On a cluster, Slurm decides which machines you get, and `slurm/train.sbatch` turns that into the
# commands above. It asks for 2 nodes with one *task* each (`#SBATCH --nodes=2 --ntasks-per-node=1`);
# that task is a torchrun, which starts its node's processes itself. The first node of the
# allocation hosts a c10d rendezvous, and the job's ID names it, so one `srun` line serves any
# number of nodes and two jobs never join each other's rendezvous:

# %%
sbatch = (nb.ROOT / "slurm" / "train.sbatch").read_text().splitlines()
start = next(i for i, line in enumerate(sbatch) if line.startswith("srun "))
print("\n".join(line for line in sbatch if line.startswith("MASTER_")))
print("\n".join(sbatch[start:]))

# %% [markdown]
# Submit it from the repository's root with `sbatch slurm/train.sbatch` (`--nodes=4`,
# `--gres=gpu:4` and friends override the `#SBATCH` lines), follow it with `squeue` and
# `tail -f slurm-<job>.out`, stop it with `scancel <job>`. No cluster at hand?
# `slurm/local_cluster.sh start` runs a real two-node Slurm on one machine (it needs root and the
# Slurm packages); `slurm/README.md` walks through it. This notebook does not start it: the tour
# and the test suite do.
#
# Next, [06_checkpoint](06_checkpoint.ipynb): surviving a failure.
