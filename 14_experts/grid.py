"""Who talks to whom: every process group of the job, made from one grid of ranks, here and nowhere else.

The world's ranks fill a grid pp x dp x cp x tp, tp the innermost: rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i;
dp itself is replicate x shard (--replicate R, HSDP: R x S = dp, shard the inner), so dp_i = replicate_i * S + shard_i.
A process group is a line of that grid, the ranks that differ in some coordinates only: a tp group is tp consecutive
ranks (one node: its all-reduces, one per block and direction, are the most frequent traffic); a pp group, the ranks
at the same place of every stage (its sends, the least traffic, are what crosses nodes); a shard_cp group, S x cp
consecutive rows of a stage's tp column, a replicate group the rows at the same place of every shard_cp group. The
experts borrow their ep groups from the dp x cp line (no processes of their own). Rank 0 prints the layout at start-up
(`describe`).
`ddp_setup` first joins the world, the group they are all made from."""
from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("pp", "replicate", "shard", "cp", "tp")  # outermost first; dp = replicate x shard
# The DeviceMesh's dimensions (FSDP2 and tp's plans take it), each made of the grid's: a cp rank holds the model as a
# dp rank does, so DDP and FSDP2 run over dp x cp. HSDP's 2-D mesh is its (replicate, shard_cp) slice: FSDP2 shards
# over shard x cp, S x cp consecutive rows (torchtitan's dp_shard_cp), and replicates over the first. The cp ranks go
# in the shard group because FSDP2 already shards over them (they hold the same weights), and they are the inner
# ranks: the weights' all-gathers and the gradients' reduce-scatters stay on a node's fast links; only 1/(S cp) of
# the gradients cross the slow ones, all-reduced over a replicate group once a step (stage 11's README: HSDP).
MESH = {"pp": ("pp",), "replicate": ("replicate",), "shard_cp": ("shard", "cp"), "tp": ("tp",)}
ROLES = {"tp": "tensor parallel: split every block's matmuls", "cp": "context parallel: split every sequence",
         "dp_cp": "DDP or FSDP2: average (or shard) over a stage's tp column",
         "shard_cp": "HSDP: FSDP2 shards over these (a node)",
         "replicate": "HSDP: the shards' replicas, gradients all-reduced",
         "pp": "pipeline: activations stage to stage", "ep": "expert parallel: tokens to their experts",
         "ep_replicas": "the same experts: their gradients averaged by hand"}


class Grid:
    """This rank's place in the grid (`coords`, `sizes`), its groups (`group(name)`; None for cp, ep and the replicas
    where they are one rank) and the DeviceMesh (`mesh`) that FSDP2 and tp's plans take."""

    def __init__(self, sizes: dict[str, int], ep: int, device: torch.device, timeout: float) -> None:
        replicate = sizes.get("replicate", 1)  # sizes: pp, dp, cp and tp, and the replicas dp holds (--replicate, 1)
        self.sizes = {"pp": sizes["pp"], "replicate": replicate, "shard": sizes["dp"] // replicate, "cp": sizes["cp"],
                      "tp": sizes["tp"]}
        self.ranks = torch.arange(dist.get_world_size()).reshape(tuple(self.sizes.values()))
        self.coords = dict(zip(DIMS, (self.ranks == dist.get_rank()).nonzero()[0].tolist(), strict=True))
        self.sizes["dp"] = self.sizes["replicate"] * self.sizes["shard"]
        self.coords["dp"] = self.coords["replicate"] * self.sizes["shard"] + self.coords["shard"]
        self.members = {"tp": self.lines("tp"), "cp": self.lines("cp"), "dp_cp": self.lines("replicate", "shard", "cp"),
                        "shard_cp": self.lines("shard", "cp"), "replicate": self.lines("replicate"),
                        "pp": self.lines("pp")}
        # ep consecutive ranks of a dp x cp line share out the experts; the ranks at the same place of every such run
        # hold the same experts (its replicas). FSDP2 leaves the experts alone, so HSDP does not change them.
        self.members["ep"] = [line[i:i + ep] for line in self.members["dp_cp"] for i in range(0, len(line), ep)]
        self.members["ep_replicas"] = [line[i::ep] for line in self.members["dp_cp"] for i in range(ep)]
        # The mesh's dimensions: MESH's, less replicate where R = 1 (else a group of one for every rank, for nothing).
        named = tuple(n for n in MESH if n != "replicate" or replicate > 1)
        # Every rank makes every group, in the same order, each waiting --timeout like the world's (a group made
        # without one waits 30 minutes, so a stalled rank would hang the job); one per name, even where two names hold
        # the same ranks (cp = ep = 2: the ep groups are the cp groups; R = 1: the shard_cp groups are the dp x cp
        # groups), so each method's collectives keep to its own.
        wait = timedelta(seconds=timeout)
        self.groups = {name: dist.new_subgroups_by_enumeration(lines, timeout=wait)[0]
                       for name, lines in self.members.items() if name in (*named, "dp_cp") or len(lines[0]) > 1}
        shape = tuple(math.prod(self.sizes[d] for d in MESH[n]) for n in named)
        # On the training device explicitly: the default is cuda wherever a GPU is visible (pytorch#132471).
        self.mesh = DeviceMesh.from_group([self.groups[n] for n in named], device.type,
                                          mesh=self.ranks.reshape(shape), mesh_dim_names=named)

    def lines(self, *dims: str) -> list[list[int]]:
        """The grid's lines along `dims`: every set of ranks whose other coordinates agree, in grid order."""
        along = [DIMS.index(d) for d in dims]
        moved = self.ranks.movedim(along, list(range(-len(dims), 0)))  # those dimensions last, then flattened
        return moved.reshape(-1, moved.shape[-len(dims):].numel()).tolist()

    def group(self, name: str) -> dist.ProcessGroup | None:
        return self.groups.get(name)

    def describe(self) -> str:
        """The layout: the grid (pp x dp x cp x tp; where R > 1, dp's split), then a line a group of more than one
        rank, its role and its first lines of ranks."""
        hsdp = self.sizes["replicate"] > 1
        dims = DIMS if hsdp else ("pp", "dp", "cp", "tp")
        formula = dims[0]
        for d in dims[1:]:
            formula = f"({formula}) * {self.sizes[d]} + {d}" if "+" in formula else f"{formula} * {self.sizes[d]} + {d}"
        out = [f"grid: {' x '.join(f'{d} {self.sizes[d]}' for d in dims)} = {self.ranks.numel()} ranks, "
               f"rank = {formula}"]
        said: dict[frozenset, str] = {}
        for name, lines in self.members.items():
            if len(lines[0]) == 1 or (name == "shard_cp" and not hsdp):  # R = 1: the dp x cp groups
                continue
            key = frozenset(map(tuple, lines))  # the same ranks, grouped alike
            shown = " ".join(map(str, lines[:4])) + (f" ... ({len(lines)} groups)" if len(lines) > 4 else "")
            out.append(f"  {name:<11} {ROLES[name]}: {shown}" + (f" (the {said[key]} groups' ranks)" if key in said
                                                                   else ""))
            said.setdefault(key, name)
        return "\n".join(out)


def restart_safe_store(timeout: float) -> dist.Store | None:
    """torchrun's store, with a key prefix of its own for each restart of the group: torchrun keeps one store across
    restarts, while torch assumes a fresh one per attempt (pytorch/pytorch#135712), so restarted workers could read the
    previous attempt's addresses and fail ("Gloo connectFullMesh failed ... Connection refused") or hang."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None  # not under torchrun's agent: init_process_group makes its own store
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def ddp_setup(ddp: bool, device: torch.device, timeout: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank also allocates on GPU 0
    # (torchrun already set OMP_NUM_THREADS=1, so the ranks do not oversubscribe the CPU cores.)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if ddp:  # sync point: init reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun's env
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout), store=restart_safe_store(timeout),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:  # plain `python train.py`: a group of one, kept in memory, so the rest runs unchanged
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))
