"""Stage 09: tensor parallelism splits every layer over processes; FSDP2 shards the rest over a 2-D mesh.

Stage 08 on a mesh of dp x tp processes: within a row of tp processes every Linear is split
(Megatron-style: one column-wise, the next row-wise), so they compute each layer together on the
same samples; the dp rows see different samples and FSDP2 shards each row's pieces over them. The
training is still stage 01's at the global batch dp * --batch-size.

    torchrun --standalone --nproc_per_node=2 09_tensor_parallel/train.py --tp 2 --batch-size 64
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

if torch.__version__ < (2, 6):  # fully_shard (FSDP2) is public from torch 2.6; older ones fail on the imports below
    print(f"09_tensor_parallel/train.py: error: needs torch 2.6 or newer, not {torch.__version__}", file=sys.stderr)
    sys.exit(2)

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

STAGE = "09_tensor_parallel"
N_TRAIN, N_EVAL = 4096, 1001  # 1001 is odd: the held-out set never splits evenly over 2, 4 or 8 ranks
N_FEATURES, N_CLASSES, HIDDEN = 8, 4, 64
DTYPES = {"float32": torch.float32, "float64": torch.float64}  # --dtype


def make_data(seed: int, dtype: torch.dtype = torch.float32) -> tuple[TensorDataset, TensorDataset]:
    """A task with a known answer: the label is the argmax of a fixed random linear map of x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_EVAL, N_FEATURES, generator=g)
    teacher = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    y = (x @ teacher).argmax(dim=1)
    x = x.to(dtype)  # after the labels: the same task in either --dtype
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


class Net(nn.Module):
    """A small MLP in two halves; stage 07 puts `body` and `head` on different devices."""

    def __init__(self, hidden: int = HIDDEN) -> None:  # --hidden: a wider model shows the memory saved
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def load_train_objs(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh):
    train_set, eval_set = make_data(args.seed, DTYPES[args.dtype])
    torch.manual_seed(args.seed)  # the same initial weights in every stage (drawn in float32, then cast)
    model = Net(args.hidden).to(device, DTYPES[args.dtype])
    parallelize(model, mesh, args.reshard_after_forward)  # before the optimizer: it must hold the shards
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return train_set, eval_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int) -> DataLoader:
    # Epoch e shuffles with torch.randperm(N, seed + e) as in stage 01, and rank r takes
    # positions r, r+W, r+2W, ...: so the ranks' step k together covers stage 01's step k at batch W*b.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def padding_note(n: int, world_size: int) -> str | None:
    """What DistributedSampler does when the ranks cannot share the samples evenly, in one line (None if they can)."""
    if n % world_size == 0:
        return None
    extra = world_size - n % world_size
    return (f"note: {n} samples do not split evenly over {world_size} ranks: DistributedSampler repeats the first "
            f"{extra} of each epoch's order, so every rank takes {(n + extra) // world_size} and an epoch trains on "
            f"{n + extra} samples (stage 01's training on that order); drop_last=True would leave out the last "
            f"{n % world_size} instead")


def make_mesh(device: torch.device, shape: tuple[int, int], names: tuple[str, str], timeout: float) -> DeviceMesh:
    """Ranks in a grid of shape[0] rows of shape[1] (rank r in row r // shape[1]: consecutive ranks, one node), a
    process group for each column (names[0]) and each row (names[1]), every one waiting --timeout like the world's:
    init_device_mesh would give them the backend's default, 30 minutes, so a stalled rank would hang the job."""
    grid = torch.arange(dist.get_world_size()).reshape(shape)
    wait = timedelta(seconds=timeout)
    columns, _ = dist.new_subgroups_by_enumeration(grid.T.tolist(), timeout=wait)  # every rank makes every group
    rows, _ = dist.new_subgroups_by_enumeration(grid.tolist(), timeout=wait)
    # On the training device explicitly: the default is cuda wherever a GPU is visible (pytorch#132471).
    return DeviceMesh.from_group([columns, rows], device.type, mesh=grid, mesh_dim_names=names)


def parallelize(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """Split every Linear over the tp ranks, then shard each block (a unit) over the dp ranks with FSDP2."""
    # No broadcast here, unlike DDP's constructor: each rank keeps its slice of the weights it built, so
    # every rank must build the same ones (the same seed), or the slices assemble into a patchwork.
    parallelize_module(model, mesh["tp"], {
        "body.0": ColwiseParallel(),  # its rows: each tp rank computes a slice of the hidden units, no talk
        "head.0": RowwiseParallel(),  # its columns, matching that slice: partial sums, all-reduced over tp
        "head.2": ColwiseParallel(output_layouts=Replicate()),  # a slice of the classes each, all-gathered
    })
    for block in (model.body, model.head):  # in a transformer: each transformer block
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh["dp"], reshard_after_forward=reshard_after_forward)
    # Both warn on every rank about what is correct here: a unit's output is a view of the last split layer's
    # (we never modify it in place), and a parameter split twice is gathered in two steps (only slower).
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def full_model(model: nn.Module, hidden: int) -> nn.Module | None:
    """The whole model as a plain Net on rank 0's CPU, None on the other ranks (every rank calls this): the shards are
    sent unit by unit and only rank 0 keeps them (full_state_dict with cpu_offload), as when saving to one file."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):  # no memory and no random draws: the weights come from `state`
        full = Net(hidden)
    full.load_state_dict(state, assign=True)
    return full


PROGRESS = "progress.json"  # beside the shards: epochs done, losses, and the settings the checkpoint was made with
PROGRESS_KEYS = {"epochs_run", "losses", "steps", "seed", "global_batch", "dtype", "hidden", "world_size"}
CHECKPOINT = re.compile(r"epoch_(\d{4,})")  # a complete checkpoint; "epoch_NNNN.tmp" is one being written


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    found = [p for p in directory.iterdir() if CHECKPOINT.fullmatch(p.name)] if directory.is_dir() else []
    return sorted(found, key=lambda p: int(CHECKPOINT.fullmatch(p.name).group(1)))


class Trainer:
    def __init__(self, model: nn.Module, train_loader: DataLoader, optimizer: torch.optim.Optimizer,
                 device: torch.device, master_process: bool, mesh: DeviceMesh, snapshot_path: Path | None = None,
                 save_every: int = 1, snapshot: dict | None = None, seed: int = 0, hidden: int = HIDDEN) -> None:
        self.model = model
        self.train_loader = train_loader
        self.optimizer = optimizer
        self.device = device
        self.master_process = master_process  # rank 0 alone logs
        self.mesh = mesh
        self.losses: list[float] = []
        self.steps = 0
        self.snapshot_path = snapshot_path  # a directory: one file of shards per rank in each checkpoint
        self.save_every = save_every
        self.seed = seed
        self.hidden = hidden
        self.epochs_run = 0
        if snapshot is not None:
            self._load_snapshot(snapshot)

    def _load_snapshot(self, snapshot: dict) -> None:
        # The state dicts of *this* run's shards (on W' ranks): dcp.load fills each rank's pieces from
        # whichever files hold them, so a checkpoint written by W ranks resumes on any number.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)  # also makes SGD's (zero) buffers
        state = {"model": model_state, "optimizer": optimizer_state, "rng_state": torch.get_rng_state()}
        dcp.load(state, checkpoint_id=snapshot["path"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        torch.set_rng_state(state["rng_state"])
        self.epochs_run, self.losses, self.steps = snapshot["epochs_run"], list(snapshot["losses"]), snapshot["steps"]

    def _save_snapshot(self) -> None:
        # This rank's shards (DTensors) of the model and of SGD's momentum, keyed by parameter name: no rank
        # gathers the whole model. dcp.save writes one file per rank, then rank 0 the metadata (who holds what).
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        final = self.snapshot_path / f"epoch_{self.epochs_run:04d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state, "rng_state": torch.get_rng_state()},
                     checkpoint_id=tmp)
        except (Exception, dcp.CheckpointException) as e:  # raised on every rank if any rank failed to write
            if self.master_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise failed_save(e, tmp, self.snapshot_path) from None  # one line: why, and what is kept (below)
        if self.master_process:
            progress = {"epochs_run": self.epochs_run, "losses": self.losses, "steps": self.steps, "seed": self.seed,
                        "global_batch": self.train_loader.batch_size * self.mesh["dp"].size(),
                        "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                        "hidden": self.hidden, "world_size": dist.get_world_size()}
            (tmp / PROGRESS).write_text(json.dumps(progress) + "\n")
            # The rename is atomic: a directory named epoch_N is complete, and a crash before this line
            # leaves epoch_N.tmp, which is never loaded. Only then is the previous checkpoint removed.
            os.replace(tmp, final)
            for old in checkpoints(self.snapshot_path)[:-1]:
                shutil.rmtree(old)

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        # Sync points: before each unit's forward FSDP all-gathers its weights over dp, and frees them after;
        # inside it, the tp ranks all-reduce head.0's partial sums and all-gather head.2's slices of the logits.
        loss = F.cross_entropy(self.model(x), y)
        # Sync points: the tp ranks all-reduce the gradient of head.2's input (each has one part of it); each
        # unit is gathered again over dp for its backward, then its gradients are reduce-scattered over dp.
        loss.backward()
        self.optimizer.step()  # on this rank's shards only: no communication
        self.steps += 1
        return loss.detach()

    def _run_epoch(self, epoch: int) -> float:
        self.train_loader.sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
        total = torch.zeros((), device=self.device, dtype=torch.float64)  # float64 in either --dtype: stages compare it
        for x, y in self.train_loader:
            total += self._run_batch(x.to(self.device), y.to(self.device))
        # The tp ranks of a row saw the same samples, the rows different ones: the mean over rows is stage 01's loss.
        dist.all_reduce(total, group=self.mesh.get_group("dp"))
        return total.item() / (len(self.train_loader) * self.mesh["dp"].size())

    def train(self, epochs: int, after_epoch: Callable[[int], None] | None = None) -> None:
        if self.epochs_run >= epochs and self.master_process:  # a finished checkpoint: say so, do not look stuck
            print(f"nothing to train: the checkpoint is at epoch {self.epochs_run} and --epochs is {epochs}; "
                  f"pass --epochs {self.epochs_run + 10} to train 10 more, or another --snapshot to start afresh")
        for epoch in range(self.epochs_run, epochs):  # a resumed run starts after the snapshot's last epoch
            start = clock(self.device)
            self.losses.append(self._run_epoch(epoch))
            if after_epoch is not None:  # --out: the tour's recorder (below the line)
                after_epoch(epoch + 1)
            self.epochs_run = epoch + 1
            if self.master_process:
                print(f"epoch {epoch + 1}/{epochs} | train loss {self.losses[-1]:.4f} "
                      f"| {clock(self.device) - start:.2f}s")
            if self.snapshot_path is not None and self.epochs_run % self.save_every == 0:
                self._save_snapshot()  # every rank: each writes its own shards
                # Sync point: once any rank is past it, the checkpoint of this epoch is complete and
                # renamed, so a failure from here on resumes from it on every rank alike.
                dist.barrier()


@torch.no_grad()
def evaluate_sharded(model: nn.Module, dataset: TensorDataset, device: torch.device, dp_rank: int, dp_size: int,
                     group: dist.ProcessGroup | None = None) -> tuple[float, float, int]:
    """evaluate_distributed() with the sharded model itself: no rank ever holds it whole. Its forward is a collective
    (each unit all-gathers its weights), so every rank runs as many batches as the others, some maybe empty."""
    model.eval()
    mine = torch.arange(dp_rank, len(dataset), dp_size)  # samples r, r+dp, ...: each counted once
    batches = -(-len(dataset) // (dp_size * 256))  # of at most 256 samples, the same number on every rank
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for indices in mine.tensor_split(batches):
        x, y = (t.to(device) for t in dataset[indices])
        logits = model(x)
        totals += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                (logits.argmax(dim=1) == y).sum().item(), len(y)], dtype=torch.float64, device=device)
    for unit in model.modules():  # a forward leaves a unit gathered when no backward follows to free it (the root
        if isinstance(unit, FSDPModule):  # always; every unit with --no-reshard-after-forward): shard them again
            unit.reshard()
    model.train()
    dist.all_reduce(totals, group=group)  # one sum over the dp ranks
    loss_sum, correct, count = totals.tolist()
    return loss_sum, correct, int(count)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # ArgumentParser and positive() are defined below the line: a bad value is one line of error and exit 2.
    p = ArgumentParser(prog=f"{STAGE}/train.py", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive(int), default=20)
    p.add_argument("--batch-size", type=positive(int), default=64, help="samples per step per process")
    p.add_argument("--lr", type=positive(float), default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="float64 rounds 5e8 times finer than float32: for checking results, not for speed")
    p.add_argument("--out", type=Path, help="write summary.json, model.pt and trajectory.pt here")
    p.add_argument("--timeout", type=positive(float), default=60.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    p.add_argument("--snapshot", type=Path,
                   help="checkpoint directory: resumed from if it holds one, written during training")
    p.add_argument("--save-every", type=positive(int), default=1, help="epochs between checkpoints")
    p.add_argument("--hidden", type=positive(int), default=HIDDEN,
                   help=f"width of the hidden layers ({HIDDEN}: stage 01's model; wider: more to shard)")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="keep each unit gathered from its forward to its backward: fewer all-gathers, more memory")
    p.add_argument("--tp", type=positive(int),
                   help="tensor-parallel degree: processes that split every layer (default: the most of this "
                        "node's processes that divides --hidden and the 4 classes, so tp talks inside a node)")
    args = check_checkpoint_arg(p, check_args(p, p.parse_args(argv)))
    world_size, node_size = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if args.tp is None:  # tp inside a node: the most of its processes that divides the layers (4 of 8: 4 classes)
        args.tp = max(d for d in range(1, node_size + 1) if node_size % d == 0 and tp_splits_layers(d, args.hidden))
    if world_size % args.tp:
        p.error(f"argument --tp: {args.tp} does not divide the world size {world_size} (the mesh is dp x tp "
                f"processes); use a divisor of {world_size}")
    if not tp_splits_layers(args.tp, args.hidden):
        p.error(f"argument --tp: {args.tp} does not divide --hidden {args.hidden} and the {N_CLASSES} classes "
                f"(each tp rank holds an equal slice of every layer); use one of "
                f"{[d for d in range(1, N_CLASSES + 1) if tp_splits_layers(d, args.hidden)]}")
    return args


def tp_splits_layers(tp: int, hidden: int) -> bool:
    return hidden % tp == 0 and N_CLASSES % tp == 0


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def clock(device: torch.device) -> float:
    """Seconds on a steady clock, read once the GPU has finished its queued work: CUDA runs asynchronously, so a
    clock read without waiting would time the kernels' launches, not the kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def restart_safe_store(timeout: float) -> dist.Store | None:
    """torchrun's store, with a key prefix of its own for each restart of the group.

    torchrun keeps one store across restarts, while torch assumes a fresh one per attempt
    (pytorch/pytorch#135712): restarted workers can then read the previous attempt's addresses
    and fail ("Gloo connectFullMesh failed ... Connection refused") or hang.
    """
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


def gather_layout(node_rank: int, local_rank: int, mesh: DeviceMesh) -> list[dict]:
    """Every rank's place in the job and in the mesh, gathered so rank 0 can show the whole grid."""
    me = {"rank": dist.get_rank(), "node": node_rank, "local_rank": local_rank, "host": socket.gethostname(),
          "dp": mesh.get_local_rank("dp"), "tp": mesh.get_local_rank("tp")}
    layout: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(layout, me)
    return layout


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, mesh: DeviceMesh,
          layout: list[dict], snapshot: dict | None) -> None:
    master_process = rank == 0  # the *global* rank 0: one process in the whole job, not one per node
    train_set, eval_set, model, optimizer = load_train_objs(args, device, mesh)
    dp_rank, dp_size = mesh.get_local_rank("dp"), mesh["dp"].size()
    # The data is split over the dp rows only: the tp ranks of a row compute on the same samples.
    train_loader = prepare_dataloader(train_set, args.batch_size, dp_rank, dp_size, args.seed)
    if master_process:
        fallback = " (no GPU visible: using the CPU)" if args.device == "auto" and device.type == "cpu" else ""
        print(f"[{STAGE}] world size {world_size} = dp {dp_size} x tp {args.tp} | backend {dist.get_backend()} | "
              f"device {device.type}{fallback} | batch {args.batch_size} per dp rank, {args.batch_size * dp_size} "
              f"global | {len(train_loader)} steps/epoch")
        if (note := padding_note(len(train_set), dp_size)) is not None:  # 3 ranks, say: the sampler pads
            print(note)
        for p in layout:
            print(f"  node {p['node']} ({p['host']}) | local rank {p['local_rank']} | global rank {p['rank']} | "
                  f"dp {p['dp']} tp {p['tp']}")
    # No wrapper: load_train_objs split and sharded the model in place, so `model` is the one we train.

    trainer = Trainer(model, train_loader, optimizer, device, master_process, mesh, args.snapshot, args.save_every,
                      snapshot, args.seed, args.hidden)
    resumed_from = trainer.epochs_run
    if master_process and resumed_from:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))  # set by torchrun only; 0 on its first start
        print(f"resumed from {snapshot['path']} (written by {snapshot['world_size']} ranks) after epoch "
              f"{resumed_from}" + (f" (torchrun restart {restarts})" if restarts else ""))
    collectives = count_first_step(trainer)  # what one step communicates, filled in as it runs (below the line)
    # --out: the weights and momentum now and after every epoch, for the tour's replay (below the line)
    trajectory = Trajectory(trainer) if args.out is not None else None
    start = clock(device)
    trainer.train(args.epochs, after_epoch=trajectory)
    seconds = clock(device) - start

    # The tp ranks of a row score the same samples together: the sums are added over the dp rows only.
    loss_sum, correct, count = evaluate_sharded(model, eval_set, device, dp_rank, dp_size, mesh.get_group("dp"))
    shards = what_each_rank_holds(model, optimizer)  # bytes and shapes of every rank's shards (below the line)
    collectives = {dim: collectives.get(dim, {}) for dim in ("dp", "tp")}
    if master_process:
        print(f"held-out: loss {loss_sum / count:.4f} | accuracy {correct / count:.2%} ({count} samples)")
        print_shards_and_collectives(shards, collectives, args.reshard_after_forward)
    if args.out is not None:  # model.pt: the whole model, gathered once at the end, onto rank 0's CPU only
        full = full_model(model, args.hidden)
        if master_process:  # no replicas to compare: each rank holds other pieces (replica_max_abs_diff: none)
            save_run(args, trainer, trajectory, full, device, (loss_sum, correct, count), seconds, world_size, None,
                     global_batch=args.batch_size * dp_size, hidden=args.hidden,
                     reshard_after_forward=args.reshard_after_forward, dp=dp_size, tp=args.tp, **shards,
                     collectives_per_step=collectives, nodes=len({p["node"] for p in layout}), layout=layout,
                     resumed_from_epoch=resumed_from,
                     restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
    rank = int(os.environ.get("RANK", 0))  # global: decides logging and saving
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # index of this process on its node: picks the GPU
    node_rank = int(os.environ.get("GROUP_RANK", 0))  # index of this node (--node_rank, or rendezvous order)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if pick_device(args.device).type == "cuda" else torch.device("cpu")
    try:  # check the checkpoint before joining the group: a bad one is one line and exit 2 on every rank
        snapshot = None if args.snapshot is None else \
            load_snapshot(args.snapshot, args.seed, args.batch_size * world_size // args.tp, args.dtype, args.hidden)
    except SnapshotError as e:
        print(f"{STAGE}/train.py: error: argument --snapshot: {e}", file=sys.stderr)
        sys.exit(2)
    if rank == 0 and args.snapshot is not None:  # a save cut short by a crash: never loaded, so never needed
        for stale in args.snapshot.glob("epoch_*.tmp"):  # (no other rank writes before the group is joined)
            shutil.rmtree(stale)
    ddp_setup(ddp, device, args.timeout)
    try:
        mesh = make_mesh(device, (world_size // args.tp, args.tp), ("dp", "tp"), args.timeout)
        train(rank, world_size, device, args, mesh, gather_layout(node_rank, local_rank, mesh), snapshot)
    except RuntimeError as e:  # gloo raises a peer's death or stall here, as a timeout or a closed connection
        if (hint := explain_peer_failure(e, args.timeout)) is not None:
            print(f"[{STAGE}] rank {rank}: {hint}", file=sys.stderr)
        raise
    finally:
        # On success train() has returned and its model is gone: destroying the group while a DDP
        # model still holds it can hang a gloo process at exit (pytorch/pytorch#75097).
        dist.destroy_process_group()
    exit_without_teardown()  # skips Python's teardown, which a gloo thread can crash (below the line)


# ═══ The lesson ends here ═══════════════════════════════════════════════════════════════════════════════════════
# Below: what only the tour and the tests need, the same in every stage (tests/test_repo.py checks it); leave it out
# of your own project. Flag values refused in one line (check_args), the run's files for --out (state_of, save_run; a
# GPT stage has its own, in reports.py), one line on how another rank failed (explain_peer_failure), and a clean exit
# past a gloo bug.

import math
import pickle
import tempfile

from torch.distributed.tensor.debug import CommDebugMode


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2 (no usage dump)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def ensure_writable(directory: Path) -> None:
    """Create `directory` if needed and write a file there: mkdir alone succeeds on a read-only disk."""
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()


# The torch each folder needs: the release that made its APIs public (fully_shard, which 08, 09, 11, 12 and 13 use, and
# pipelining as 10 uses it: 2.6; fully_shard's ignored_params, 14's: 2.7; register_post_accumulate_grad_hook: 2.1;
# all_gather_single and reduce_scatter_single: 2.13). 08-14 also check it at their top.
NEEDS_TORCH = {"08_fsdp": (2, 6), "09_tensor_parallel": (2, 6), "10_pipeline_parallel": (2, 6), "11_gpt": (2, 6),
               "12_context_parallel": (2, 6), "13_pipeline_4d": (2, 6), "14_experts": (2, 7), "ddp_by_hand": (2, 1),
               "zero_by_hand": (2, 13)}


def check_args(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse now, in one line, what would otherwise fail later, on one rank only, or in a traceback."""
    needs = NEEDS_TORCH.get(STAGE.split("/")[0], (2, 0))
    if torch.__version__ < needs:
        p.error(f"torch {torch.__version__} is too old for {STAGE}: it needs {needs[0]}.{needs[1]} or newer "
                f"(the tutorial is tested with 2.13); see 'Using another torch' in README.md")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda asked but no GPU is visible; use --device cpu (or auto)")
    gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 0  # auto or cuda
    spawned = getattr(args, "world_size", None)  # stage 03 starts its processes itself
    if gpus and spawned and spawned > gpus:
        p.error(f"argument --world-size: {spawned} processes but {gpus} GPU(s) visible; "
                f"use --world-size {gpus} or fewer (or --device cpu)")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes torchrun started on this node
    if gpus and local_world_size > gpus:
        p.error(f"torchrun --nproc_per_node: {local_world_size} processes but {gpus} GPU(s) visible; "
                f"use --nproc_per_node={gpus} or fewer (or --device cpu)")
    if "world_size" in args and "MASTER_PORT" in os.environ:  # stage 03, with a port of yours: check it now
        port = os.environ["MASTER_PORT"]
        if not (port.isdigit() and 0 < int(port) < 65536):
            p.error(f"MASTER_PORT={port} is not a port number; unset it (a free port is picked) or use 1-65535")
        if not port_is_free(int(port)):
            p.error(f"MASTER_PORT={port} is in use by another process; unset it (a free port is picked) "
                    f"or choose another")
    if args.out is not None:
        try:  # fail now, not after training
            ensure_writable(args.out)
        except OSError as e:
            p.error(f"argument --out: cannot write to {args.out} ({e.strerror}); choose a writable directory")
    return args


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as rank 0's store does
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> dict:
    """Weights and momentum after `epoch` epochs, whole and on the CPU: tour.py replays each epoch from them."""
    def whole(t: torch.Tensor) -> torch.Tensor:  # a DTensor (08, 09) is all-gathered: every rank calls this
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    params = list(model.parameters())
    return {"epoch": epoch, "params": [whole(p) for p in params],
            "momentum": [whole(optimizer.state[p]["momentum_buffer"]) if p in optimizer.state else None
                         for p in params]}


class Trajectory(list):
    """--out: state_of() at the start and after every epoch, which tour.py replays. Made only with --out: each entry
    copies the whole model (in 08 and 09 an all-gather of it), which a run that does not keep it must not pay for."""

    def __init__(self, trainer) -> None:
        super().__init__()
        self.trainer = trainer
        self(getattr(trainer, "epochs_run", 0))  # a resumed run (06-09) records from the epoch it resumed at

    def __call__(self, epoch: int) -> None:  # Trainer.train calls it after every epoch
        self.append(self.state(epoch))

    def state(self, epoch: int) -> dict:
        return state_of(self.trainer.model, self.trainer.optimizer, epoch)


def save_run(args: argparse.Namespace, trainer, trajectory: list[dict], model: nn.Module, device: torch.device,
             evaluation: tuple, seconds: float, world_size: int = 1, max_diff: float | None = 0.0, **facts) -> None:
    """--out: summary.json (the run in numbers), model.pt (the plain model) and trajectory.pt (for the replay)."""
    loss_sum, correct, count = evaluation
    global_batch = facts.pop("global_batch", args.batch_size * world_size)
    epochs_here = len(trajectory) - 1  # trained by this run: a resumed one records from where it resumed
    summary = {
        "stage": STAGE, "world_size": world_size, "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": device.type, "global_batch": global_batch, "batch_size": args.batch_size, "epochs": args.epochs,
        "lr": args.lr, "dtype": args.dtype, "seed": args.seed, "steps": trainer.steps, "losses": trainer.losses,
        "eval_loss": loss_sum / count, "eval_accuracy": correct / count, "eval_count": count,
        "replica_max_abs_diff": max_diff, "seconds": seconds,
        "samples_per_s": epochs_here * len(trainer.train_loader) * global_batch / seconds,
        # Samples an epoch trains on: more than the data where DistributedSampler pads (tour.replay_error follows it).
        "epoch_samples": getattr(trainer.train_loader.sampler, "total_size", len(trainer.train_loader.dataset)),
        **facts,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save(model.state_dict(), args.out / "model.pt")
    torch.save(list(trajectory), args.out / "trajectory.pt")


def explain_peer_failure(error: RuntimeError, timeout: float) -> str | None:
    """One line for the two ways another rank's failure reaches this one; None for any other error."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return (f"waited more than --timeout {timeout:g}s for another rank: it stalled, died or skipped a "
                f"collective this rank called; raise --timeout only if a rank legitimately works alone that long")
    if "connection closed by peer" in text or "connection reset by peer" in text:
        return "another rank closed its connection (it died): its own error, or its launcher's, says why"
    return None


def exit_without_teardown() -> None:
    """Leave without Python's interpreter teardown: a gloo worker thread may still be releasing the last
    collective, which needs the GIL, and teardown aborts it ("terminate called without an active exception":
    5 of 22 runs here; 0 of 60 with this exit). Nothing is left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ─── This stage's own checks and reports ──────────────────────────────────────────────────────────────────────────
# A --snapshot directory that cannot be resumed from is refused in one line; a failed save says why; what each rank
# holds and what one step communicates are measured (tests/test_fsdp.py reads them).


def check_checkpoint_arg(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.snapshot is not None:
        if args.snapshot.exists() and not args.snapshot.is_dir():
            p.error(f"argument --snapshot: {args.snapshot} is a file; give a directory (each rank writes its own "
                    f"shards)")
        try:  # fail now, not at the first save
            ensure_writable(args.snapshot)
        except OSError as e:
            p.error(f"argument --snapshot: cannot write to {args.snapshot} ({e.strerror}); "
                    f"choose a writable directory")
    return args


class SnapshotError(Exception):
    """A --snapshot directory that cannot be resumed from: reported in one line, exit status 2."""


class MetadataUnpickler(pickle.Unpickler):
    """Reads a checkpoint's .metadata, which dcp.load unpickles as it is: only what metadata is made of passes."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        # The metadata's own classes (dataclasses, an enum); not its module's functions, which a pickle could call.
        metadata_class = module == "torch.distributed.checkpoint.metadata" and \
            isinstance(getattr(dcp.metadata, name, None), type)
        if (module, name) in self.ALLOWED or dtype or metadata_class:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata (a pickle that runs "
                                     f"code?)")


def load_snapshot(directory: Path, seed: int, global_batch: int, dtype: str, hidden: int) -> dict | None:
    """Check the newest checkpoint in `directory` without reading its shards; None if there is none yet."""
    strangers = [p.name for p in directory.iterdir() if not CHECKPOINT.fullmatch(p.name.removesuffix(".tmp"))] \
        if directory.is_dir() else []
    if strangers:
        raise SnapshotError(f"{directory} is not a checkpoint directory of this stage (it holds {strangers[0]}); "
                            f"give a new or empty directory")
    if not (found := checkpoints(directory)):
        return None
    path = found[-1]
    try:
        progress = json.loads((path / PROGRESS).read_text())
        with open(path / ".metadata", "rb") as f:  # what was saved, and where each piece lies
            metadata = MetadataUnpickler(f).load()
    except Exception as e:  # a file missing or unreadable
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SnapshotError(f"cannot load {path}: {first_line}") from e
    if not isinstance(progress, dict) or not PROGRESS_KEYS <= progress.keys():
        raise SnapshotError(f"{path / PROGRESS} is not this stage's (expected the keys {sorted(PROGRESS_KEYS)})")
    expected = {f"model.{k}": list(v.shape) for k, v in Net(hidden).state_dict().items()}
    found_shapes = {k: list(getattr(metadata.state_dict_metadata.get(k), "size", [])) for k in expected}
    if found_shapes != expected:
        raise SnapshotError(f"{path} holds another model's weights (keys or shapes differ from this Net with "
                            f"--hidden {hidden})")
    for piece in metadata.storage_data.values():  # a shard file missing or cut short: found now, not mid-load
        file = path / piece.relative_path
        if not file.exists() or file.stat().st_size < piece.offset + piece.length:
            raise SnapshotError(f"{file} is {'truncated' if file.exists() else 'missing'}; that checkpoint is "
                                f"incomplete")
    made_with = (progress["seed"], progress["global_batch"], progress["dtype"])
    if made_with != (seed, global_batch, dtype):
        raise SnapshotError(f"{path} was made with --seed {made_with[0]}, global batch {made_with[1]} and "
                            f"--dtype {made_with[2]}; resume with the same, or use another --snapshot")
    return {"path": path, **progress}


def failed_save(error: Exception, tmp: Path, directory: Path) -> OSError:
    """One line for a save that failed on some rank (dcp names each failure), and what is still there."""
    causes = "; ".join(f"rank {r}: {exc}" for r, (exc, _) in error.failures.items()) \
        if isinstance(error, dcp.CheckpointException) else str(error)
    free = shutil.disk_usage(directory).free
    kept = f"{checkpoints(directory)[-1]} is still the last checkpoint" if checkpoints(directory) \
        else "there is no earlier checkpoint"
    return OSError(f"writing the checkpoint {tmp} failed ({causes}; {free} bytes free on that disk); {kept}")


def local_bytes(tensors) -> int:
    """Bytes of this rank's pieces of some DTensors (what it really holds)."""
    return sum(t.to_local().numel() * t.element_size() for t in tensors)


def what_each_rank_holds(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every rank's bytes of parameters, gradients and momentum after a step, and its shard shapes (all-gathered)."""
    params = list(model.parameters())
    mine = {"bytes": {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
                      "optimizer": local_bytes(optimizer.state[p]["momentum_buffer"]
                                               for p in params if p in optimizer.state)},
            "shapes": {n: list(p.to_local().shape) for n, p in model.named_parameters()}}
    held: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(held, mine)
    full = sum(p.numel() * p.element_size() for p in params)  # DTensor.numel(): the whole parameter
    return {"bytes_per_rank": [h["bytes"] for h in held], "shard_shapes": [h["shapes"] for h in held],
            "full_bytes": {"params": full, "grads": full, "optimizer": full}}


def count_first_step(trainer) -> dict:
    """The collectives of the trainer's first step, by kind and mesh dimension, counted by torch's CommDebugMode.

    FSDP2 calls c10d's collectives on the dp group it was given; DTensor's tensor-parallel layers call the functional
    ones on the tp group (stage 09): so the namespace says the dimension. The dict fills in when the step runs.
    """
    counts: dict = {}
    run_batch = trainer._run_batch

    def counted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        trainer._run_batch = run_batch  # the first step only
        with warnings.catch_warnings(), CommDebugMode() as comm:  # its module hooks warn about inputs without grad
            warnings.simplefilter("ignore")
            loss = run_batch(x, y)
        for op, n in comm.get_comm_counts().items():  # op: e.g. c10d._allgather_base_, _c10d_functional.all_reduce
            namespace, _, name = str(op).partition(".")
            name = name.strip("_").removesuffix("_base").removesuffix("_into_tensor").removesuffix("_tensor")
            name = {"all_reduce": "allreduce", "all_gather": "allgather"}.get(name, name)
            dim = "dp" if namespace == "c10d" else "tp"
            counts.setdefault(dim, {})[name] = counts.get(dim, {}).get(name, 0) + n
        return loss
    trainer._run_batch = counted
    return counts


def print_shards_and_collectives(shards: dict, collectives: dict, reshard_after_forward: bool) -> None:
    print("model state per rank (bytes of parameters + gradients + momentum): "
          + " | ".join(f"rank {r} {sum(b.values()):,}" for r, b in enumerate(shards["bytes_per_rank"]))
          + f"; a DDP replica holds {sum(shards['full_bytes'].values()):,}")
    counts = " | ".join(f"{dim}: " + (", ".join(f"{n} {op}" for op, n in sorted(ops.items())) or "none")
                        for dim, ops in collectives.items())
    print(f"collectives in one step: {counts} (reshard_after_forward={reshard_after_forward})")


if __name__ == "__main__":
    main()
