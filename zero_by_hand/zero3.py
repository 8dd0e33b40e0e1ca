"""Sharding by hand, step 3 (ZeRO-3): the parameters sharded too: FSDP by hand.

zero2.py still keeps the whole model on every rank. Here the model is cut into units (body and head, the ones
stage 08 gives fully_shard), each one flat tensor padded to a multiple of W, of which rank r keeps the r-th 1/W
only. A unit is all-gathered whole just before its forward and freed after it, gathered again for its backward,
whose gradients are reduce-scattered as in zero2.py; while one unit computes, the next one's all-gather is already
on its way. Between steps a rank keeps 1/W of everything: the weights, their gradients and AdamW's moments.

    torchrun --standalone --nproc_per_node=2 zero_by_hand/zero3.py
    python zero_by_hand/zero3.py --epochs 5 --out runs/zero3
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

STAGE = "zero_by_hand/zero3"
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

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, HIDDEN), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def load_train_objs(args: argparse.Namespace, device: torch.device):
    train_set, eval_set = make_data(args.seed, DTYPES[args.dtype])
    torch.manual_seed(args.seed)  # the same initial weights in every stage (drawn in float32, then cast)
    model = Net().to(device, DTYPES[args.dtype])
    return train_set, eval_set, model  # the optimizer comes once the units are sharded: it steps the shards


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


class HandFSDP(nn.Module):
    """zero2.py's, with the weights sharded too: a rank keeps 1/W of each unit, which is gathered whole only while
    it computes, for its forward and again for its backward (stage 08's fully_shard, by hand)."""

    def __init__(self, module: nn.Module, units: list[nn.Module]) -> None:
        super().__init__()
        self.module = module
        # A unit's weights are gathered and freed together. The units in forward order: backward runs them last first.
        self.params: list[list[nn.Parameter]] = [list(unit.parameters()) for unit in units]
        self.shapes = [[p.shape for p in unit] for unit in self.params]  # between uses, each p is an empty tensor
        rank, world_size = dist.get_rank(), dist.get_world_size()
        self.sizes = [sum(p.numel() for p in unit) for unit in self.params]  # elements, without the padding
        self.param_shards: list[torch.Tensor] = []  # this rank's 1/W of each unit's weights: all it keeps of them
        self.grad_shards: list[torch.Tensor] = []  # this rank's 1/W of each unit's averaged gradient, kept
        for unit, n in zip(self.params, self.sizes, strict=True):
            padded = -(-n // world_size) * world_size  # W = 3 and 4,420 weights: 2 zeros at the end, never used
            flat_param = torch.zeros(padded, dtype=unit[0].dtype, device=unit[0].device)
            offset = 0
            for p in unit:
                flat_param[offset:offset + p.numel()].copy_(p.detach().flatten())
                offset += p.numel()
                p.data = p.data.new_empty(0)  # p stays (autograd and the hooks know it), empty until gathered
            # Sync point: rank 0's weights to every rank, then each keeps its 1/W. Broadcast before cutting: every rank
            # built the whole model anyway, so it costs no memory (stage 08 skips it and relies on the same seed).
            dist.broadcast(flat_param, src=0)
            size = padded // world_size
            self.param_shards.append(flat_param[rank * size:(rank + 1) * size].clone())  # a copy: the rest is freed
            self.grad_shards.append(torch.zeros(size, dtype=flat_param.dtype, device=flat_param.device))
        self.flat_params: list[torch.Tensor | None] = [None] * len(units)  # whole, only while the unit computes
        self.flat_grads: list[torch.Tensor | None] = [None] * len(units)  # whole, while reduce-scattered
        self.gathering: list[tuple | None] = [None] * len(units)  # an all-gather in flight: (its buffer, its work)
        names = {p: name for name, p in module.named_parameters()}
        self.units = [[names[p] for p in unit] for unit in self.params]
        self.unit_of = {p: i for i, unit in enumerate(self.params) for p in unit}
        self.calls = self.bytes = 0  # reduce-scatters launched and the bytes handed to them, on this rank
        self.gather_calls = self.gather_bytes = 0  # all-gathers launched while training and the bytes they bring
        self.sync = True  # False inside no_sync()
        self._new_step()
        for i, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda module, args, i=i: self._unshard(i, prefetch=i + 1))
            unit.register_forward_hook(lambda module, args, output, i=i: self._after_forward(i, output))
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._gradient_ready)  # called once p.grad holds its gradient

    def _new_step(self) -> None:
        self.missing = [len(unit) for unit in self.params]  # gradients each unit still waits for
        self.launched: list[tuple[int, dist.Work]] = []  # each unit's reduce-scatter, in the order launched
        self.landed = 0  # of them, those waited for: their shards averaged, their buckets freed

    def _gather(self, i: int) -> None:
        """Post the all-gather of unit i's whole weights, unless it is already on its way (prefetched)."""
        if self.gathering[i] is not None:
            return
        flat = torch.empty(self.param_shards[i].numel() * dist.get_world_size(), dtype=self.param_shards[i].dtype,
                           device=self.param_shards[i].device)
        self.gathering[i] = (flat, dist.all_gather_single(flat, self.param_shards[i], async_op=True))
        if self.training:  # evaluation's forwards gather too: count the training's
            self.gather_calls += 1
            self.gather_bytes += flat.numel() * flat.element_size()

    def _unshard(self, i: int, prefetch: int) -> None:
        """Before unit i computes: its weights whole, each p a view of the gathered buffer; the next unit's posted."""
        self._gather(i)
        if 0 <= prefetch < len(self.params):
            self._gather(prefetch)  # on its way while this unit computes: the next to wait for it finds it arrived
        flat, work = self.gathering[i]
        self.gathering[i] = None
        work.wait()  # sync point: every rank's 1/W of the unit has arrived
        offset = 0
        for p, shape in zip(self.params[i], self.shapes[i], strict=True):
            p.data = flat[offset:offset + shape.numel()].view(shape)
            offset += shape.numel()
        self.flat_params[i] = flat

    def _free(self, i: int) -> None:
        for p in self.params[i]:
            p.data = p.data.new_empty(0)  # the buffer goes with its last view (autograd keeps none: see forward)
        self.flat_params[i] = None

    def _after_forward(self, i: int, output: torch.Tensor) -> None:
        self._free(i)
        if output.requires_grad:  # a backward will follow: its hook fires before the unit's first op's backward
            output.register_hook(lambda grad: self._before_backward(i))

    def _before_backward(self, i: int) -> None:
        self._unshard(i, prefetch=i - 1)  # backward runs the units last to first

    def forward(self, *args, **kwargs):
        # Autograd keeps what backward needs, Linear's weight among it (as a view, weight.t()). A view kept holds the
        # whole buffer: swapping p.data after the forward would then free nothing, and backward would use that old
        # buffer, not the one gathered for it. So a tensor that lies in a unit's buffer is kept as where it lies, and
        # rebuilt from the buffer gathered again for the backward.
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.module(*args, **kwargs)

    def _pack(self, t: torch.Tensor):
        for i, flat in enumerate(self.flat_params):
            if flat is not None and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                return i, t.shape, t.stride(), t.storage_offset()
        return t  # an activation: kept as it is

    def _unpack(self, saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        i, shape, stride, offset = saved
        if self.flat_params[i] is None:
            raise RuntimeError(f"unit {i} {self.units[i]} is not whole: it was not gathered again for its backward, "
                               f"or freed before its backward ended")
        return self.flat_params[i].as_strided(shape, stride, offset)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        i = self.unit_of[p]
        self.missing[i] -= 1
        if self.missing[i]:
            return
        self._free(i)  # the unit's backward is over: its whole weights are not needed before the next forward
        if not self.sync:
            self.missing[i] = len(self.params[i])  # inside no_sync(): the whole gradient stays, the next adds to it
            return
        # Launch the units in backward order, whatever the order the gradients come in: every rank must call its
        # collectives in the same order, or the ranks would add up different units.
        while len(self.launched) < len(self.params) and self.missing[-1 - len(self.launched)] == 0:
            self._launch(len(self.params) - 1 - len(self.launched))

    def _launch(self, i: int) -> None:
        self._land()  # the unit before has most likely arrived while backward went on: free it first
        flat = self.grad_shards[i].new_zeros(self.grad_shards[i].numel() * dist.get_world_size())  # padded: W parts
        torch.cat([p.grad.flatten() for p in self.params[i]], out=flat[:self.sizes[i]])
        for p in self.params[i]:
            p.grad = None  # in the unit now: the parameters' own gradients are freed at once
        self.flat_grads[i] = flat
        with torch.profiler.record_function(f"launch reduce-scatter of unit {i}"):
            # Rank r receives the sum over the ranks of the r-th 1/W of the unit, and nothing else.
            work = dist.reduce_scatter_single(self.grad_shards[i], flat, async_op=True)
        self.launched.append((i, work))
        self.calls += 1
        self.bytes += flat.numel() * flat.element_size()

    def sync_gradients(self) -> None:
        """After backward, before optimizer.step(): wait for every unit; each gradient becomes its mean."""
        if len(self.launched) < len(self.params):  # DDP fails too, unless find_unused_parameters=True
            raise RuntimeError(f"units {[i for i, n in enumerate(self.missing) if n]} still wait for gradients: "
                               f"a parameter took no part in this backward (or it ran inside no_sync())")
        self._land()
        self._new_step()

    def _land(self) -> None:
        """Wait for the reduce-scatters not yet waited for: each shard becomes its mean, each unit is freed."""
        for i, work in self.launched[self.landed:]:
            with torch.profiler.record_function(f"wait for unit {i}"):
                work.wait()  # sync point: this rank's 1/W of the unit's sum has arrived
            self.grad_shards[i] /= dist.get_world_size()
            self.flat_grads[i] = None  # the whole gradient is freed: only the shard is kept
        self.landed = len(self.launched)

    @contextlib.contextmanager
    def no_sync(self):
        """For gradient accumulation: a backward inside adds to p.grad and sends nothing; the next one outside
        reduce-scatters the sum (the hook fires after accumulation, so the unit holds every micro-batch). Until
        then each rank keeps the whole gradient, as FSDP2 does without gradient synchronisation (the weights are
        still freed after each backward, and gathered again for the next)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True


class ShardedOptimizer:
    """zero2.py's, stepping the weights' shards that the model keeps: nothing to gather after the step."""

    def __init__(self, model: HandFSDP, optimizer_class: type[torch.optim.Optimizer], **defaults) -> None:
        self.model = model
        rank = dist.get_rank()
        self.shards: list[nn.Parameter] = []
        for param_shard, grad_shard, n in zip(model.param_shards, model.grad_shards, model.sizes, strict=True):
            size = param_shard.numel()
            start = rank * size
            stop = max(start, min(start + size, n))  # padding stays out of the optimizer (a shard may be all padding)
            shard = nn.Parameter(param_shard[:stop - start])  # a view: stepping it updates the shard the model keeps
            shard.grad = grad_shard[:stop - start]  # this rank's part of the averaged gradient, a view
            self.shards.append(shard)
        self.optimizer = optimizer_class(self.shards, **defaults)

    def state_elements(self) -> int:
        """Elements of each AdamW moment this rank keeps: its shards' (about 1/W of the model's weights)."""
        return sum(shard.numel() for shard in self.shards)

    def zero_grad(self) -> None:
        for p in self.model.module.parameters():
            p.grad = None  # none is kept past its unit's launch; this drops what a no_sync() left, if any

    @torch.no_grad()
    def step(self) -> None:
        self.optimizer.step()  # AdamW on this rank's 1/W; no all-gather: the next forward gathers each unit


class Trainer:
    def __init__(self, model: nn.Module, train_loader: DataLoader, optimizer: ShardedOptimizer,
                 device: torch.device, master_process: bool) -> None:
        self.model = model
        self.train_loader = train_loader
        self.optimizer = optimizer
        self.device = device
        self.master_process = master_process  # rank 0 alone logs and saves
        self.losses: list[float] = []
        self.steps = 0

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()  # no whole gradient is kept: backward makes each p.grad anew
        loss = F.cross_entropy(self.model(x), y)  # sync points: each unit gathered for its forward, then freed
        loss.backward()  # each unit gathered again; the hooks launch its reduce-scatter as soon as its gradients are in
        self.model.sync_gradients()  # sync point: wait for the units still in flight; then every rank agrees
        self.optimizer.step()  # this rank's shards only: no communication
        self.steps += 1
        return loss.detach()

    def _run_epoch(self, epoch: int) -> float:
        self.train_loader.sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
        total = torch.zeros((), device=self.device, dtype=torch.float64)  # float64 in either --dtype: stages compare it
        for x, y in self.train_loader:
            total += self._run_batch(x.to(self.device), y.to(self.device))
        dist.all_reduce(total)  # each rank saw different samples: the mean over ranks is stage 01's loss
        return total.item() / (len(self.train_loader) * dist.get_world_size())

    def train(self, epochs: int, after_epoch: Callable[[int], None] | None = None) -> None:
        for epoch in range(epochs):
            start = clock(self.device)
            self.losses.append(self._run_epoch(epoch))
            if after_epoch is not None:  # --out: the tour's recorder (below the line)
                after_epoch(epoch + 1)
            if self.master_process:
                print(f"epoch {epoch + 1}/{epochs} | train loss {self.losses[-1]:.4f} "
                      f"| {clock(self.device) - start:.2f}s")


@torch.no_grad()
def evaluate_sharded(model: nn.Module, dataset: TensorDataset, device: torch.device, rank: int,
                     world_size: int) -> tuple[float, float, int]:
    """zero2.py's evaluate_distributed() with the sharded model itself, as stage 08's: no rank ever holds it whole.
    Its forward is a collective (each unit all-gathers its weights), so every rank runs as many batches as the
    others, some maybe empty."""
    model.eval()
    mine = torch.arange(rank, len(dataset), world_size)  # samples r, r+W, ...: each counted once
    batches = -(-len(dataset) // (world_size * 256))  # of at most 256 samples, the same number on every rank
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for indices in mine.tensor_split(batches):
        x, y = (t.to(device) for t in dataset[indices])
        logits = model(x)
        totals += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                (logits.argmax(dim=1) == y).sum().item(), len(y)], dtype=torch.float64, device=device)
    model.train()
    dist.all_reduce(totals)  # one sum over the ranks
    loss_sum, correct, count = totals.tolist()
    return loss_sum, correct, int(count)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=f"{STAGE}.py", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive(int), default=20)
    p.add_argument("--batch-size", type=positive(int), default=64, help="samples per step per process")
    p.add_argument("--lr", type=positive(float), default=0.01, help="AdamW's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="float64 rounds 5e8 times finer than float32: for checking results, not for speed")
    p.add_argument("--out", type=Path, help="write summary.json, model.pt and trajectory.pt here")
    p.add_argument("--timeout", type=positive(float), default=60.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    return check_args(p, p.parse_args(argv))


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


def ddp_setup(ddp: bool, device: torch.device, timeout: float) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every rank also allocates on GPU 0
    # (torchrun already set OMP_NUM_THREADS=1, so the ranks do not oversubscribe the CPU cores.)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if ddp:  # sync point: init reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun's env
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout))
    else:  # plain `python train.py`: a group of one, kept in memory, so the rest runs unchanged
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    master_process = rank == 0
    train_set, eval_set, model = load_train_objs(args, device)
    train_loader = prepare_dataloader(train_set, args.batch_size, rank, world_size, args.seed)
    if master_process:
        fallback = " (no GPU visible: using the CPU)" if args.device == "auto" and device.type == "cpu" else ""
        print(f"[{STAGE}] world size {world_size} | backend {dist.get_backend()} | device {device.type}{fallback} | "
              f"batch {args.batch_size} per rank, {args.batch_size * world_size} global | "
              f"{len(train_loader)} steps/epoch")
        if (note := padding_note(len(train_set), world_size)) is not None:  # 3 ranks, say: the sampler pads
            print(note)
    # The units stage 08 gives fully_shard: rank 0's weights broadcast, then this rank keeps 1/W of each unit.
    model = HandFSDP(model, [model.body, model.head])
    optimizer = ShardedOptimizer(model, torch.optim.AdamW, lr=args.lr)  # AdamW's state for this rank's shards only

    trainer = Trainer(model, train_loader, optimizer, device, master_process)
    # --out: the weights and AdamW's moments (gathered whole) now and after every epoch, for the tour's replay
    trajectory = ShardedTrajectory(trainer) if args.out is not None else None  # (below the line)
    start = clock(device)
    trainer.train(args.epochs, after_epoch=trajectory)
    seconds = clock(device) - start

    loss_sum, correct, count = evaluate_sharded(model, eval_set, device, rank, world_size)
    if master_process:  # no replicas to compare: each rank holds other shards (replica_max_abs_diff: none)
        print(f"held-out: loss {loss_sum / count:.4f} | accuracy {correct / count:.2%} ({count} samples)")
        print(f"reduce-scatter: {model.calls / trainer.steps:g} call(s) per step and rank, "
              f"{model.bytes / trainer.steps:,.0f} bytes in all; units {model.units}")
        print(f"all-gather: {model.gather_calls / trainer.steps:g} call(s) per step and rank (each unit for its "
              f"forward and again for its backward), {model.gather_bytes / trainer.steps:,.0f} bytes in all")
        print(f"AdamW's state on rank 0: {optimizer.state_elements():,} elements per moment, for "
              f"{sum(model.sizes):,} weights (1/{world_size}, as the weights and gradients it keeps; DDP keeps them "
              f"all on every rank)")
    if master_process and args.out is not None:  # model.pt: the weights the record gathered last (below the line)
        save_run(args, trainer, trajectory, trajectory.whole_model(), device, (loss_sum, correct, count), seconds,
                 world_size, None,
                 reducescatter_calls_per_step=model.calls / trainer.steps,
                 reducescatter_bytes_per_step=model.bytes / trainer.steps, units=model.units,
                 allgather_calls_per_step=model.gather_calls / trainer.steps,
                 allgather_bytes_per_step=model.gather_bytes / trainer.steps,
                 optimizer="AdamW",
                 adamw={key: optimizer.optimizer.defaults[key] for key in ("betas", "eps", "weight_decay")},
                 state_elements=optimizer.state_elements())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # index of this process on its node: picks the GPU
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if pick_device(args.device).type == "cuda" else torch.device("cpu")
    ddp_setup(ddp, device, args.timeout)
    try:
        train(rank, world_size, device, args)
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

import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import tempfile  # noqa: E402


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


# ─── This script's own record: the sharded weights and optimizer state, gathered whole for the tour's replay ──────────


class ShardedTrajectory(Trajectory):
    """--out: the weights and AdamW's state (both moments and the step count) whole, each all-gathered from the
    ranks' shards: what tour.py replays with stage 01's code. A run without --out never gathers them."""

    def state(self, epoch: int) -> dict:
        sharded, model = self.trainer.optimizer, self.trainer.model
        found: dict[str, dict[nn.Parameter, torch.Tensor]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
        steps = set()
        for shard, param_shard, unit, shapes, n in zip(sharded.shards, model.param_shards, model.params, model.shapes,
                                                       model.sizes, strict=True):
            state = sharded.optimizer.state.get(shard, {})
            steps.add(int(state["step"]) if "step" in state else None)
            for key, parts in found.items():
                mine = param_shard.clone() if key == "params" else torch.zeros_like(param_shard)
                if key in state:
                    mine[:shard.numel()] = state[key]
                whole = torch.empty(param_shard.numel() * dist.get_world_size(), dtype=mine.dtype, device=mine.device)
                dist.all_gather_single(whole, mine)
                for p, shape, part in zip(unit, shapes, whole[:n].split([s.numel() for s in shapes]), strict=True):
                    parts[p] = part.view(shape).cpu().clone()
        (step,) = steps  # every shard has taken the same number of steps
        params = list(model.module.parameters())
        return {"epoch": epoch, "params": [found["params"][p] for p in params], "step": step,
                **{key: [found[key][p] if step is not None else None for p in params]
                   for key in ("exp_avg", "exp_avg_sq")}}

    def whole_model(self) -> nn.Module:
        """For model.pt: a plain Net with the weights recorded last (after the last epoch), no collective more."""
        with torch.device("meta"):  # no memory and no random draws: the weights come from the record
            net = Net()
        names = [name for name, _ in net.named_parameters()]
        net.load_state_dict(dict(zip(names, self[-1]["params"], strict=True)), assign=True)
        return net


if __name__ == "__main__":
    main()
