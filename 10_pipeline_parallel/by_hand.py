"""Stage 10 by hand: train.py with the library's schedules replaced by GPipe and 1F1B written on send/recv.

What torch.distributed.pipelining does for train.py, in the open: each stage receives a micro-batch's
activations, computes, sends its own on; later it receives the gradient of its output, runs its
backward, and sends the gradient of its input back. GPipe runs every forward, then every backward;
1F1B runs (pp - stage - 1) forwards to fill the pipeline, then one forward and one backward in
turn, so a stage holds at most pp - stage micro-batches' activations instead of all of them. Between
two computations a stage sends what it made and receives what it needs next in one batch_isend_irecv,
which cannot wait on itself where a send completes only once it is received (NCCL). The same weights
as train.py, bit for bit (tests/test_pipeline.py), and a timeline of every forward and backward with
--out (benchmarks/pipeline_bubble.py draws it). The task, the model cut into stages and the loss are train.py's,
in task.py beside it.

    torchrun --standalone --nproc_per_node=2 10_pipeline_parallel/by_hand.py --schedule gpipe --out runs/10_gpipe
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

if torch.__version__ < (2, 6):  # torch.distributed.pipelining's PipelineStage, as used here, from torch 2.6
    print(f"10_pipeline_parallel/by_hand.py: error: needs torch 2.6 or newer, not {torch.__version__}", file=sys.stderr)
    sys.exit(2)

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent))  # task.py, beside it (for a program that imports this one)
from task import (  # train.py's data, model and loss, word for word
    DTYPES,
    N_LAYERS,
    STAGE_LAYERS,
    BatchMeanLoss,
    Net,
    load_train_objs,
    padded,
    padding_note,
    prepare_dataloader,
)

STAGE = "10_pipeline_parallel/by_hand"


class Pipe:
    """One stage's side of the pipeline: its layers, its neighbours, what it keeps between a micro-batch's forward
    and its backward, and the messages it exchanges with its neighbours between two computations."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, loss_fn: BatchMeanLoss) -> None:
        self.model, self.loss_fn, self.group = model, loss_fn, mesh.get_group("pp")
        weight = next(model.parameters())
        self.dtype, self.device = weight.dtype, weight.device
        stage, stages = mesh.get_local_rank("pp"), mesh["pp"].size()
        self.first, self.last = stage == 0, stage == stages - 1
        # Messages name global ranks: those of the previous and the next stage of this pipeline.
        self.prev = None if self.first else dist.get_global_rank(self.group, stage - 1)
        self.next = None if self.last else dist.get_global_rank(self.group, stage + 1)
        self.received: dict[tuple[str, int], torch.Tensor] = {}  # ("F", m): activations in; ("B", m): a gradient in
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output) for backward
        self.peak_held = 0  # the most micro-batches whose activations this stage held at once
        self.timeline: list[tuple[str, int, float, float]] = []  # (F or B, micro-batch, start, end): compute only
        self.losses: list[torch.Tensor] = []  # the last stage's, per micro-batch of the step (and its logits below)
        self.logits: list[torch.Tensor] = []
        # Sync point, once: on NCCL a group's first collective call creates its communicator and needs every rank of
        # the group; a batch of messages between two neighbours must not be that call (batch_isend_irecv's note).
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)

    def run(self, order: list[tuple[str, int]], xs: tuple, ys: tuple) -> None:
        """One step: the forwards ("F", m) and backwards ("B", m) in a schedule's `order`. Before each, one exchange
        with the neighbours: what the computation before made goes out, what this one needs comes in."""
        self.losses, self.logits = [], []
        outgoing = None  # (tensor, peer): what the computation just done made for a neighbour
        for kind, m in order:
            self.exchange(outgoing, (kind, m), len(ys[m]))
            outgoing = self.forward(m, xs[m], ys[m]) if kind == "F" else self.backward(m)
        self.exchange(outgoing, None, 0)

    def exchange(self, outgoing: tuple | None, coming: tuple[str, int] | None, rows: int) -> None:
        """Send `outgoing` and receive the input of the `coming` computation, posted together.

        A send may complete only once its receiver takes it (on NCCL above its eager size; NCCL also runs the
        messages of a communicator in order, one after another). Two stages that each sent first and only then received
        would wait for each other for ever: in 1F1B, stage 0 sends the activations of micro-batch 1 and waits for the
        gradient of 0, while stage 1 sends that gradient and waits for those activations. One batch_isend_irecv posts a
        send and a receive at once, and 1F1B's steady state pairs them with one neighbour: after F(m) the activations
        of m go down and the gradient of the next backward comes up; after B(k) the gradient of k goes up and the
        activations of the next forward come down."""
        ops = []
        if outgoing is not None:
            tensor, peer = outgoing
            ops.append(dist.P2POp(dist.isend, tensor, peer, self.group))
        kind, m = coming if coming is not None else (None, None)
        if kind == "F" and not self.first:  # the activations of micro-batch m, from the previous stage
            self.received[coming] = torch.empty(rows, self.model[0].in_features, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, self.received[coming], self.prev, self.group))
        if kind == "B" and not self.last:  # the gradient of micro-batch m's output, from the next stage
            self.received[coming] = torch.empty_like(self.held[m][1])
            ops.append(dist.P2POp(dist.irecv, self.received[coming], self.next, self.group))
        if ops:  # sync point: the receive has arrived, and the send's buffer may be used again
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def forward(self, m: int, x: torch.Tensor, y: torch.Tensor) -> tuple | None:
        inputs = x if self.first else self.received.pop(("F", m)).requires_grad_()  # its gradient is sent back
        start = clock(self.device)
        outputs = self.model(inputs)
        if self.last:
            self.logits.append(outputs.detach())
            outputs = self.loss_fn(outputs, y)  # the loss: its backward starts here
            self.losses.append(outputs.detach())
        self.timeline.append(("F", m, start, clock(self.device)))  # compute only: stamped before the send
        if outputs.requires_grad:  # training (evaluation runs under no_grad): kept until this micro-batch's backward
            self.held[m] = (inputs, outputs)
            self.peak_held = max(self.peak_held, len(self.held))
        return None if self.last else (outputs.detach(), self.next)

    def backward(self, m: int) -> tuple | None:
        inputs, outputs = self.held.pop(m)
        grad = None if self.last else self.received.pop(("B", m))  # the gradient of our output, from the next stage
        start = clock(self.device)
        outputs.backward(grad)  # accumulates into .grad: the micro-batches' gradients add up
        self.timeline.append(("B", m, start, clock(self.device)))
        return None if self.first else (inputs.grad, self.prev)


def gpipe(microbatches: int, stage: int, stages: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards: every stage holds every micro-batch's activations at its peak."""
    return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]


def one_f_one_b(microbatches: int, stage: int, stages: int) -> list[tuple[str, int]]:
    """Warm-up forwards to fill the pipeline, then one forward and one backward in turn, then the last backwards."""
    warmup = min(stages - stage - 1, microbatches)  # the last stage starts its backwards at once
    order = [("F", m) for m in range(warmup)]
    for m in range(warmup, microbatches):  # steady state: at most warmup + 1 micro-batches held
        order += [("F", m), ("B", m - warmup)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]  # cool-down


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}  # --schedule: the order of a stage's forwards and backwards


class Trainer:
    def __init__(self, schedule: str, loss_fn: BatchMeanLoss, model: nn.Module, train_loader: DataLoader,
                 optimizer: torch.optim.Optimizer, device: torch.device, master_process: bool, mesh: DeviceMesh,
                 rows: int, microbatches: int) -> None:
        self.pipe = Pipe(model, mesh, loss_fn)  # runs one batch's micro-batches through the pipeline
        self.loss_fn = loss_fn  # the pipe's: told each batch's number of samples
        self.rows = rows  # every batch is padded to this many rows: M equal micro-batches, as in train.py
        self.microbatches = microbatches
        self.model = model  # this process's stage: a run of the model's layers
        self.train_loader = train_loader
        self.optimizer = optimizer
        self.device = device
        self.master_process = master_process  # rank 0 alone logs
        self.mesh = mesh
        self.first = mesh.get_local_rank("pp") == 0  # takes the samples
        self.last = mesh.get_local_rank("pp") == mesh["pp"].size() - 1  # takes the labels, computes the loss
        # This stage's order of forwards and backwards in every step: "F0", "F1", "B0", ... (gpipe or 1f1b)
        self.order = SCHEDULES[schedule](microbatches, mesh.get_local_rank("pp"), mesh["pp"].size())
        self.losses: list[float] = []
        self.steps = 0

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        # As train.py: the loss of a micro-batch is its share of the batch's mean, the batch padded to `rows`.
        self.loss_fn.samples = len(y)
        x, y = padded(x, y, self.rows)
        xs, ys = torch.tensor_split(x, self.microbatches), torch.tensor_split(y, self.microbatches)  # as torch cuts
        self.pipe.timeline.clear()  # the last step's is kept: --out writes it
        # Sync points: each micro-batch's activations go to the next stage and its gradients come back (messages
        # between neighbours). The gradients add up over the micro-batches: the batch's mean, as the loss is.
        self.pipe.run(self.order, xs, ys)
        # Sync point: the same stage of every pipeline averages its gradients, once per batch, after the last
        # micro-batch (averaging after each one would add M averages: M times too large a step).
        for p in self.model.parameters():
            dist.all_reduce(p.grad, group=self.mesh.get_group("dp"))
            p.grad /= self.mesh["dp"].size()
        self.optimizer.step()  # this stage's weights only
        self.steps += 1
        return torch.stack(self.pipe.losses).sum().detach() if self.last else torch.zeros((), device=self.device)

    def _run_epoch(self, epoch: int) -> float:
        self.train_loader.sampler.set_epoch(epoch)  # without it, every epoch repeats epoch 0's order
        total = torch.zeros((), device=self.device, dtype=torch.float64)  # float64 in either --dtype: stages compare it
        for x, y in self.train_loader:
            total += self._run_batch(x.to(self.device), y.to(self.device))
        dist.all_reduce(total)  # only the last stage of each pipeline has a loss: the mean over the dp pipelines
        return total.item() / (len(self.train_loader) * self.mesh["dp"].size())

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
def evaluate_pipeline(trainer: Trainer, dataset: Dataset) -> tuple[float, float, int]:
    """evaluate() through the pipeline itself (no stage ever holds the whole model): each dp pipeline scores samples
    r, r+dp, ... in batches of the training shape, the last stage adds up its losses and correct answers, and one
    all_reduce adds every pipeline's (the other stages add zeros)."""
    dp_rank, dp = trainer.mesh.get_local_rank("dp"), trainer.mesh["dp"].size()
    totals = torch.zeros(3, dtype=torch.float64, device=trainer.device)
    trainer.loss_fn.samples = 1  # the sum of the losses, not their mean
    forwards = [("F", m) for m in range(trainer.microbatches)]  # forward only, micro-batch after micro-batch
    for x, y in DataLoader(Subset(dataset, range(dp_rank, len(dataset), dp)), batch_size=trainer.rows):
        xp, yp = padded(x.to(trainer.device), y.to(trainer.device), trainer.rows)
        # Sync points: the stages' messages, as in training.
        trainer.pipe.run(forwards, torch.tensor_split(xp, trainer.microbatches),
                         torch.tensor_split(yp, trainer.microbatches))
        if trainer.last:
            logits = torch.cat(trainer.pipe.logits)
            correct = (logits[:len(y)].argmax(dim=1).cpu() == y).sum().item()
            totals += torch.tensor([torch.stack(trainer.pipe.losses).sum().item(), correct, len(y)],
                                   dtype=torch.float64, device=trainer.device)
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum, correct, int(count)


def replica_max_abs_diff(model: nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """Gather the parameters of every rank of `group` (here: one stage's copies in the dp pipelines); return the
    largest difference from the first's."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return max((g - gathered[0]).abs().max().item() for g in gathered)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # ArgumentParser and positive() are defined below the line: a bad value is one line of error and exit 2.
    p = ArgumentParser(prog=f"{STAGE}.py", description=__doc__.splitlines()[0])
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
    p.add_argument("--pp", type=positive(int),
                   help="pipeline stages: processes that split the layers (default: the most, up to the model's "
                        f"{N_LAYERS} layers, that divides the world size)")
    p.add_argument("--microbatches", type=positive(int), default=4, help="micro-batches per --batch-size")
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b",
                   help="gpipe: all forwards, then all backwards; 1f1b: one forward, one backward in turn")
    args = check_args(p, p.parse_args(argv))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.pp is None:
        args.pp = max(d for d in range(1, N_LAYERS + 1) if world_size % d == 0)
    if world_size % args.pp or args.pp > N_LAYERS:
        p.error(f"argument --pp: {args.pp} must divide the world size {world_size} (the mesh is dp x pp processes) "
                f"and be at most the model's {N_LAYERS} layers; use one of "
                f"{[d for d in range(1, N_LAYERS + 1) if world_size % d == 0]}")
    if args.microbatches > args.batch_size:
        p.error(f"argument --microbatches: {args.microbatches} micro-batches of a --batch-size {args.batch_size} "
                f"would leave some without a sample; use --microbatches {args.batch_size} or fewer")
    if args.schedule == "1f1b" and args.microbatches < args.pp:
        p.error(f"argument --microbatches: 1f1b needs at least one micro-batch per stage ({args.pp}), or its warm-up "
                f"never ends; use --microbatches {args.pp} or more, or --schedule gpipe")
    return args


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


def gather_layout(node_rank: int, local_rank: int, mesh: DeviceMesh) -> list[dict]:
    """Every rank's place in the job and in the mesh, gathered so rank 0 can show the whole grid."""
    me = {"rank": dist.get_rank(), "node": node_rank, "local_rank": local_rank, "host": socket.gethostname(),
          "dp": mesh.get_local_rank("dp"), "pp": mesh.get_local_rank("pp")}
    layout: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(layout, me)
    return layout


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, mesh: DeviceMesh,
          layout: list[dict]) -> None:
    master_process = rank == 0  # the *global* rank 0: one process in the whole job, not one per node
    pp_rank, dp_rank, dp_size = mesh.get_local_rank("pp"), mesh.get_local_rank("dp"), mesh["dp"].size()
    train_set, eval_set, model, optimizer = load_train_objs(args, device, pp_rank)
    # The data is split over the dp pipelines only: the stages of a pipeline work on the same samples.
    train_loader = prepare_dataloader(train_set, args.batch_size, dp_rank, dp_size, args.seed)
    rows = -(-args.batch_size // args.microbatches) * args.microbatches  # a batch padded to M equal micro-batches
    last = len(train_loader.sampler) % args.batch_size  # the real rows of an epoch's last batch (0: a full one)
    if master_process:
        fallback = " (no GPU visible: using the CPU)" if args.device == "auto" and device.type == "cpu" else ""
        print(f"[{STAGE}] world size {world_size} = dp {dp_size} x pp {args.pp} | backend {dist.get_backend()} | "
              f"device {device.type}{fallback} | batch {args.batch_size} per pipeline = {args.microbatches} "
              f"micro-batches of {rows // args.microbatches}, {args.batch_size * dp_size} global | "
              f"schedule {args.schedule} | {len(train_loader)} steps/epoch")
        if (note := padding_note(len(train_set), dp_size)) is not None:  # 3 ranks, say: the sampler pads
            print(note)
        if rows != args.batch_size or last:  # rows the loss ignores: the same training, a little more compute
            print(f"note: batches are padded to {rows} rows for the schedule's fixed shapes ({args.batch_size} samples"
                  + (f"; {last} in each epoch's last batch" if last else "") + "); the padding rows count for nothing")
        for p in layout:
            print(f"  node {p['node']} ({p['host']}) | local rank {p['local_rank']} | global rank {p['rank']} | "
                  f"dp {p['dp']} pp {p['pp']}: layers {' '.join(STAGE_LAYERS[args.pp][p['pp']])}")
    # Every rank built the same weights from the seed; the dp pipelines stay equal: they average their gradients.
    loss_fn = BatchMeanLoss()  # summed over the micro-batches, the batch's mean: so the gradients need no scaling
    trainer = Trainer(args.schedule, loss_fn, model, train_loader, optimizer, device, master_process, mesh, rows,
                      args.microbatches)
    # --out: the weights and momentum now and after every epoch, for the tour's replay (below the line)
    trajectory = WholeTrajectory(trainer) if args.out is not None else None
    start = clock(device)
    trainer.train(args.epochs, after_epoch=trajectory)
    seconds = clock(device) - start
    timelines = gather_timelines(trainer.pipe)  # the last step's; a collective: every rank calls it, not rank 0 alone

    loss_sum, correct, count = evaluate_pipeline(trainer, eval_set)
    # The copies of a stage in the dp pipelines averaged the same gradients, so they must be equal: the largest
    # difference of any stage, agreed by every rank (max over all), so that all stop below together if it is not 0.
    max_diff = torch.tensor(replica_max_abs_diff(model, mesh.get_group("dp")), device=device)  # nccl: on the GPU
    dist.all_reduce(max_diff, op=dist.ReduceOp.MAX)
    max_diff = max_diff.item()
    if master_process:
        print(f"held-out: loss {loss_sum / count:.4f} | accuracy {correct / count:.2%} ({count} samples)")
        print(f"pipelines: max |difference| of a stage from its copy in pipeline 0 = {max_diff:.3g} over {dp_size}")
    if args.out is not None:  # every rank of a pipeline: its stages gathered into one model, for model.pt
        full = gathered_model(model, mesh, args.pp, args.dtype)
        if master_process:
            save_run(args, trainer, trajectory, full, device, (loss_sum, correct, count), seconds, world_size,
                     max_diff, global_batch=args.batch_size * dp_size, dp=dp_size, pp=args.pp,
                     microbatches=args.microbatches, schedule=args.schedule, nodes=len({p["node"] for p in layout}),
                     layout=layout, **timelines)
    if max_diff != 0:
        raise RuntimeError(f"the pipelines' copies of a stage differ (max |difference| {max_diff:.3g})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
    rank = int(os.environ.get("RANK", 0))  # global: decides logging and saving
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # index of this process on its node: picks the GPU
    node_rank = int(os.environ.get("GROUP_RANK", 0))  # index of this node (--node_rank, or rendezvous order)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", local_rank) if pick_device(args.device).type == "cuda" else torch.device("cpu")
    ddp_setup(ddp, device, args.timeout)
    try:
        # Ranks in a grid of dp rows of pp: rank r is stage r % pp of pipeline r // pp (a pipeline on one node).
        mesh = make_mesh(device, (world_size // args.pp, args.pp), ("dp", "pp"), args.timeout)
        train(rank, world_size, device, args, mesh, gather_layout(node_rank, local_rank, mesh))
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

import json
import math
import tempfile


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


# ─── This stage's own checks ─────────────────────────────────────────────────────────────────────────────────────
# The tour replays the whole model's epochs, but each process holds one stage: gather them, in the model's order.


class WholeTrajectory(Trajectory):
    """Trajectory of the whole model: every stage's weights and momentum, gathered over the pipeline, in order."""

    def state(self, epoch: int) -> dict:
        pieces: list[dict] = [{} for _ in range(self.trainer.mesh["pp"].size())]
        dist.all_gather_object(pieces, state_of(self.trainer.model, self.trainer.optimizer, epoch),
                               group=self.trainer.mesh.get_group("pp"))
        return {"epoch": epoch, "params": [t for piece in pieces for t in piece["params"]],
                "momentum": [t for piece in pieces for t in piece["momentum"]]}


def gathered_model(model: nn.Module, mesh: DeviceMesh, pp: int, dtype: str) -> nn.Module:
    """--out: stage 01's Net from every stage's layers, gathered by name over the pipeline (each rank of it calls)."""
    names = STAGE_LAYERS[pp][mesh.get_local_rank("pp")]  # this stage's Linear layers, in Net's names
    linears = [m for m in model if isinstance(m, nn.Linear)]
    mine = {f"{name}.{k}": v.detach().cpu() for name, layer in zip(names, linears, strict=True)
            for k, v in layer.state_dict().items()}
    pieces: list[dict] = [{} for _ in range(pp)]
    dist.all_gather_object(pieces, mine, group=mesh.get_group("pp"))
    full = Net().to(torch.device("cpu"), DTYPES[dtype])
    full.load_state_dict({k: v for piece in pieces for k, v in piece.items()})  # strict: every layer, once
    return full


def gather_timelines(pipe: Pipe) -> dict:
    """Every rank's timeline of the last step and the most micro-batches whose activations it held at once:
    benchmarks/pipeline_bubble.py draws and measures them. perf_counter is one clock for every process of a machine,
    so the stamps are gathered raw, then given in seconds since the step's first compute on any rank."""
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, {"timeline": pipe.timeline, "peak_held": pipe.peak_held})
    since = min(start for e in every for _, _, start, _ in e["timeline"])
    return {"timelines": [[(kind, m, start - since, end - since) for kind, m, start, end in e["timeline"]]
                          for e in every],
            "peak_held": [e["peak_held"] for e in every]}


if __name__ == "__main__":
    main()
