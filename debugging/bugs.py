"""Stage 04's DDP training with one bug a learner really writes planted (--bug), and the checks that find it.

Two CPU processes (gloo), forked by mp, meet through a file (no port), or torchrun starts them (its store).
Every rank runs three checks:
  - a watchdog: when a step makes no progress for half of --timeout, it prints every rank's Python stack, so
    you see the line each rank waits on; gloo then ends the collective at --timeout and the job exits 1;
  - the flight recorder (--trace DIR): the last collectives of each rank, dumped by the watchdog, for
    `python -m torch.distributed.flight_recorder.fr_trace DIR`;
  - a replica check: after every step, a checksum per parameter all-gathered, naming the first parameter
    and step where the replicas part; and, with --finite-check, every rank's loss checked before backward.

    python debugging/bugs.py --bug only_rank0 --timeout 6     (also: mismatch --trace DIR, drift, seed, dropout)
    torchrun --standalone --nproc_per_node=2 debugging/bugs.py --bug crash     (torchrun starts the ranks)
    TORCH_DISTRIBUTED_DEBUG=INFO python debugging/bugs.py --bug unused --no-replica-check   (also: replaced, twice)
    python debugging/bugs.py --bug nan --finite-check
    python debugging/bugs.py --bug sendrecv --sync-sends --timeout 6      (NCCL's rules for messages, on gloo)
"""
from __future__ import annotations

import argparse
import faulthandler
import itertools
import json
import math
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo  # noqa: F401  (DDP(...) imports it, 2-3 CPU-s: imported here once, not in every forked rank)
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch._C._distributed_c10d import _dump_fr_trace  # the flight recorder's dump (no public name)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, ensure_writable, positive  # noqa: E402
from tour import load_stage  # noqa: E402

stage = load_stage("04_ddp_torchrun")  # stage 04's train.py: its model, its data and its sampler
BUGS = ["none", "only_rank0", "mismatch", "drift", "unused", "twice", "replaced", "nan", "crash", "sendrecv",
        "set_epoch", "dropout", "seed"]
BUG_STEP = 3  # the step where a bug strikes: the steps before it run clean


def batches(loader: DataLoader, bug: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Stage 04's batches, epoch after epoch, as its Trainer takes them."""
    for epoch in itertools.count():
        if bug != "set_epoch":  # BUG (set_epoch): without it every epoch repeats epoch 0's order
            loader.sampler.set_epoch(epoch)
        yield from loader


class WithSpare(stage.Net):
    """Stage 04's Net and one more layer, which its forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.Linear(stage.HIDDEN, stage.HIDDEN)  # BUG: a layer the forward skips: it gets no gradient


class Shared(stage.Net):
    """Stage 04's Net with head[0] applied twice (one layer, its weights shared), each use recomputed in backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        for _ in range(2):  # BUG: one layer in two reentrant checkpoints: its gradient is ready twice
            h = checkpoint(self.head[0], h, use_reentrant=True).relu()
        return self.head[2](h)


class Dropped(stage.Net):
    """Stage 04's Net with dropout on its hidden units: each rank draws its masks from its own random numbers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.dropout(self.body(x), p=0.5, training=self.training))


def make_model(bug: str) -> nn.Module:
    return {"unused": WithSpare, "twice": Shared, "dropout": Dropped}.get(bug, stage.Net)()


def train(rank: int, args: argparse.Namespace, watchdog: Watchdog) -> None:
    world = dist.get_world_size()
    train_set, _ = stage.make_data(args.seed)
    loader = stage.prepare_dataloader(train_set, args.batch_size, rank, world, args.seed)  # each rank its share
    torch.manual_seed(args.seed + rank if args.bug in ("dropout", "seed") else args.seed)  # BUG: a seed per rank
    model = DDP(make_model(args.bug), find_unused_parameters=args.find_unused)  # sync point: rank 0's weights broadcast
    if args.bug == "seed":
        model.module.head[2].reset_parameters()  # BUG: a fresh head drawn after DDP(...), from each rank's seed
    if args.bug == "replaced":
        model.module.head[2] = nn.Linear(stage.HIDDEN, stage.N_CLASSES)  # BUG: a layer replaced after DDP(...)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    total = torch.zeros((), dtype=torch.float64)  # the loss summed over steps and ranks
    reference = json.loads(args.against.read_text()) if args.against is not None else []
    losses = []  # the mean loss over ranks at every step (--losses)
    for step, (x, y) in enumerate(itertools.islice(batches(loader, args.bug), args.steps)):
        watchdog.arm(step)
        optimizer.zero_grad(set_to_none=True)
        if args.bug == "nan" and step == BUG_STEP and rank == 1:
            x = x.clone()
            x[0] = float("nan")  # BUG: one corrupt sample in rank 1's batch
        loss = F.cross_entropy(model(x), y)
        if args.bug == "crash" and step == BUG_STEP and rank == 1:
            raise torch.OutOfMemoryError("planted: rank 1 fails alone (a stand-in for running out of memory)")
        if args.finite_check:
            finite_check(loss, step)
        loss.backward()  # sync point: DDP all-reduces the gradients
        optimizer.step()
        summed = loss.detach().double()
        if args.bug == "sendrecv":  # messages by hand, as stage 10's pipeline sends activations: to the other rank
            exchange(summed, rank)
        if args.bug == "drift" and step == BUG_STEP and rank == 0:
            # BUG: state changed inside a rank-0-only block (meant for logging); DDP never sees it.
            model.module.head[2].bias.data.zero_()
        if args.bug == "mismatch" and step == BUG_STEP and rank == 1:
            replica_check(model.module, step)  # BUG: rank 1 checks the replicas before the loss all-reduce
            dist.all_reduce(summed)
        else:
            dist.all_reduce(summed)  # sync point: the loss summed over ranks
            if args.replica_check:
                replica_check(model.module, step)
        total += summed
        losses.append(summed.item() / world)
        if step < len(reference) and losses[step] != reference[step]:  # every rank has the same sum: all stop
            raise CheckFailed(f"loss comparison: step {step}: mean loss {losses[step]:.6g}, the reference run's "
                              f"{reference[step]:.6g}")
    watchdog.arm(args.steps)
    if args.bug == "only_rank0" and rank == 0:
        dist.all_reduce(total)  # BUG: a collective only rank 0 calls (it is summed already)
    if rank == 0:
        print(f"trained {args.steps} steps | mean loss {total.item() / (args.steps * world):.4f}", flush=True)
    dist.barrier()  # sync point: every rank done before the group is destroyed
    watchdog.stop()
    if args.losses is not None and rank == 0:
        args.losses.write_text(json.dumps(losses) + "\n")
    if broken := [name for name, p in model.module.named_parameters() if not p.isfinite().all()]:
        print(f"[rank {rank}] {len(broken)} of {len(list(model.parameters()))} parameters hold NaN or inf: "
              f"{', '.join(broken)}\n", end="", flush=True)  # one write: the ranks share a pipe; print's end is another


def exchange(mine: torch.Tensor, rank: int) -> torch.Tensor:
    """Send this rank's tensor to the other rank and receive the other's, as stage 10's first version did."""
    theirs = torch.empty_like(mine)
    sent = dist.isend(mine, 1 - rank)  # BUG: both ranks send first, then receive: on NCCL the send waits for the
    dist.recv(theirs, 1 - rank)  # receive, and the receive, queued behind it, never runs
    sent.wait()
    return theirs


def finite_check(loss: torch.Tensor, step: int) -> None:
    """All-gather every rank's loss before backward; name the first rank whose loss is not finite."""
    losses = [torch.empty_like(loss) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, loss.detach())  # sync point
    if bad := [rank for rank, value in enumerate(losses) if not value.isfinite()]:
        raise CheckFailed(f"finite check: step {step}: the loss is {losses[bad[0]].item()} on rank {bad[0]} "
                          f"(losses {', '.join(f'{value.item():.4f}' for value in losses)})")


def time_find_unused(rank: int, args: argparse.Namespace) -> None:
    """Stage 04's step with find_unused_parameters off and on, in turns: rounds of --steps steps each, timed on rank 0
    (a step waits for the slower rank in its all-reduce). The same model, data and weights: only the flag differs."""
    train_set, _ = stage.make_data(args.seed)
    loader = stage.prepare_dataloader(train_set, args.batch_size, rank, dist.get_world_size(), args.seed)
    data = list(itertools.islice(batches(loader, "none"), args.steps))
    ms: dict[bool, list[float]] = {False: [], True: []}
    models = {}
    for find in ms:
        torch.manual_seed(args.seed)
        models[find] = DDP(stage.Net(), find_unused_parameters=find)  # sync point
    for round_ in range(args.time_find_unused + 1):  # round 0 warms up (DDP rebuilds its buckets after step 0)
        for find, model in models.items():
            dist.barrier()  # sync point: both ranks start the round together
            start = time.perf_counter()
            for x, y in data:
                model.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()  # sync point: DDP's all-reduce
            if round_ > 0:
                ms[find].append((time.perf_counter() - start) * 1e3 / len(data))
    if rank == 0:
        for find, times in ms.items():
            print(f"find_unused_parameters={find}: {statistics.median(times):.3f} ms/step (median of "
                  f"{len(times)} rounds of {len(data)} steps; rounds {min(times):.3f} ms to {max(times):.3f} ms)")
        spread = max(max(t) - min(t) for t in ms.values())
        print(f"difference of the medians: {statistics.median(ms[True]) - statistics.median(ms[False]):+.3f} ms/step; "
              f"widest spread of a setting's rounds: {spread:.3f} ms/step", flush=True)


def replica_check(model: nn.Module, step: int) -> None:
    """All-gather one checksum per parameter; name the first parameter whose checksums differ between ranks."""
    names = [name for name, _ in model.named_parameters()]
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)  # sync point
    for i, name in enumerate(names):
        values = [g[i].item() for g in gathered]
        if any(v != values[0] and not (math.isnan(v) and math.isnan(values[0])) for v in values):  # NaN is NaN
            raise CheckFailed(f"replica check: step {step}: parameter {name} differs between ranks "
                              f"(checksums {', '.join(f'{v:.9g}' for v in values)})")


class CheckFailed(RuntimeError):
    """A check found a fault; every rank gathered the same numbers, so every rank raises it at once."""


class Watchdog:
    """When a step makes no progress for `after` seconds: print this rank's Python stacks and dump its flight
    recorder. Rearmed at every step; a thread, so it runs while the main thread waits in a collective."""

    def __init__(self, rank: int, after: float, trace: Path | None) -> None:
        self.rank, self.after, self.trace = rank, after, trace
        self.timer: threading.Timer | None = None

    def arm(self, step: int) -> None:
        self.stop()
        self.timer = threading.Timer(self.after, self.fire, args=(step,))
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def fire(self, step: int) -> None:
        stack = main_thread_stack()
        print(f"[rank {self.rank}] watchdog: no progress for {self.after:g}s in step {step}; where this rank "
              f"waits (most recent call first):\n" + "".join(f"[rank {self.rank}] {line}\n"
                                                             for line in stack.splitlines()), end="", flush=True)
        dump_flight_recorder(self.rank, self.trace)


def main_thread_stack() -> str:
    """The main thread's stack as faulthandler prints it (from a file: it writes to a file descriptor)."""
    with tempfile.TemporaryFile("w+") as f:
        faulthandler.dump_traceback(f, all_threads=True)
        f.seek(0)
        blocks = f.read().split("\n\n")
    main = f"{threading.main_thread().ident:#018x}"  # faulthandler names a thread by its id, in hex
    return next((b for b in blocks if main in b.splitlines()[0]), "\n\n".join(blocks)).strip()


def dump_flight_recorder(rank: int, trace: Path | None) -> None:
    """Write this rank's flight recorder where fr_trace reads it (one file per rank, a common prefix).

    gloo in torch 2.13 records but never dumps by itself (only NCCL's watchdog does), so the watchdog calls the
    dump. Its pg_config names the default group "" while its entries name it "0": fr_trace looks each entry's
    group up in pg_config and fails (KeyError), so the config is keyed as the entries name their group.
    """
    if trace is None:
        return
    dump = pickle.loads(_dump_fr_trace())
    config = next(iter(dump["pg_config"].values()), {})
    dump["pg_config"] = {name: {**config, "name": name, "desc": desc}
                         for name, desc in {tuple(e["process_group"]) for e in dump["entries"]}}
    (trace / f"rank_{rank}").write_bytes(pickle.dumps(dump))
    print(f"[rank {rank}] flight recorder: {len(dump['entries'])} collectives written to {trace}/rank_{rank}\n",
          end="", flush=True)  # (one write, as the watchdog's)


def worker(rank: int, args: argparse.Namespace, store_file: str | None) -> None:
    if args.trace is not None:  # the flight recorder records only when its buffer is set before the group starts
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "100")
    if args.sync_sends:  # NCCL's rules laid over gloo: a send is done only once its receiver has taken it
        sys.path.insert(0, str(ROOT / "tests"))
        import sync_sends
        sync_sends.install()
    store = dist.FileStore(store_file, args.world_size) if store_file else None  # None: torchrun's (env://)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.world_size,
                            timeout=timedelta(seconds=args.timeout))
    watchdog = Watchdog(rank, args.timeout / 2, args.trace)
    try:
        if args.time_find_unused:
            time_find_unused(rank, args)
            dist.barrier()
            os._exit(0)
        train(rank, args, watchdog)
        if rank == 0 and args.replica_check:
            print(f"replica check: {args.steps} steps, every parameter equal on {args.world_size} ranks", flush=True)
    except CheckFailed as e:  # every rank gathered the same numbers: every rank stops here
        watchdog.stop()
        if rank == 0:
            print(e, flush=True)
        os._exit(1)
    except RuntimeError as e:  # a collective that timed out, a peer that died, DDP's own errors
        watchdog.stop()
        print("".join(f"[rank {rank}] {line}\n" for line in message(e)), end="", flush=True)
        os._exit(1)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip Python's teardown, which a gloo thread can crash (stage 04's exit_without_teardown)


def message(error: Exception) -> list[str]:
    """The error's lines, its type first, without the C++ stack some carry ("Exception raised from ...")."""
    lines = [line.strip() for line in f"{type(error).__name__}: {error}".splitlines() if line.strip()]
    cut = next((i for i, line in enumerate(lines) if line.startswith("Exception raised from")), len(lines))
    return lines[:cut]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="debugging/bugs.py", description=__doc__.splitlines()[0])
    p.add_argument("--bug", choices=BUGS, default="none")
    p.add_argument("--steps", type=positive(int), default=8)
    p.add_argument("--batch-size", type=positive(int), default=32, help="samples per step per rank")
    p.add_argument("--lr", type=positive(float), default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=positive(int),
                   help="ranks to start (default 2); under torchrun leave it out: --nproc_per_node sets it")
    p.add_argument("--timeout", type=positive(float), default=10.0,
                   help="seconds a collective waits for the other ranks; the watchdog fires at half of it")
    p.add_argument("--trace", type=Path, help="dump each rank's flight recorder here when the watchdog fires")
    p.add_argument("--no-replica-check", dest="replica_check", action="store_false",
                   help="leave the replica check out: see what a script without it sees")
    p.add_argument("--find-unused", action="store_true", help="DDP(..., find_unused_parameters=True)")
    p.add_argument("--time-find-unused", type=positive(int), metavar="ROUNDS",
                   help="instead of training: time --steps steps with find_unused_parameters off and on, in turns")
    p.add_argument("--sync-sends", action="store_true",
                   help="run messages as NCCL does (tests/sync_sends.py): a send waits for its receiver")
    p.add_argument("--losses", type=Path, help="write the mean loss of every step here (JSON), for --against")
    p.add_argument("--against", type=Path, help="compare every step's mean loss with a run's --losses file; stop at "
                   "the first that differs")
    p.add_argument("--finite-check", action="store_true",
                   help="all-gather every rank's loss before backward; stop at the first one not finite")
    args = p.parse_args(argv)
    ranks = "--world-size"  # the knob that sets the number of ranks
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: its --nproc_per_node set the world size
        ranks, world = "--nproc_per_node (torchrun's)", int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, world):
            p.error(f"argument --world-size: torchrun started {world} ranks: leave it out (--nproc_per_node sets it)")
        args.world_size = world  # the checks below see the ranks there are
    elif args.world_size is None:
        args.world_size = 2
    if args.world_size < 2:
        p.error(f"argument {ranks}: the bugs need 2 ranks or more")
    if args.bug == "sendrecv" and args.world_size != 2:
        p.error(f"argument {ranks}: --bug sendrecv exchanges between 2 ranks: give 2")
    if args.time_find_unused:  # it times stage 04's clean step, both ways: it trains nothing, checks and writes nothing
        for flag, given in (("--bug", args.bug != "none"), ("--find-unused", args.find_unused),
                            ("--finite-check", args.finite_check), ("--losses", args.losses is not None),
                            ("--against", args.against is not None), ("--trace", args.trace is not None)):
            if given:
                p.error(f"argument {flag}: --time-find-unused only times stage 04's step without a bug, "
                        f"find_unused_parameters off and on: leave {flag} out, or --time-find-unused")
    if args.bug == "set_epoch":  # it shows from the second epoch: the first shuffles with seed + 0 either way
        epoch = len(stage.prepare_dataloader(stage.make_data(args.seed)[0], args.batch_size, 0, args.world_size,
                                             args.seed))  # steps an epoch: the loader train() makes
        if args.steps <= epoch:
            p.error(f"argument --steps: --bug set_epoch shows from the second epoch, and an epoch is {epoch} steps "
                    f"({args.world_size} ranks, --batch-size {args.batch_size}): give {epoch + 1} steps or more")
    elif args.bug != "none" and args.steps <= BUG_STEP:
        p.error(f"argument --steps: the bugs strike at step {BUG_STEP}: give more than {BUG_STEP} steps")
    if args.losses is not None:
        try:
            ensure_writable(args.losses.parent)
        except OSError as e:
            p.error(f"argument --losses: cannot write to {args.losses.parent} ({e.strerror})")
    if args.against is not None:
        try:
            reference = json.loads(args.against.read_text())
        except (OSError, ValueError) as e:
            p.error(f"argument --against: cannot read a --losses file from {args.against} ({e})")
        # What --losses writes: a JSON list of one mean loss per step.
        if not (isinstance(reference, list) and reference
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in reference)):
            p.error(f"argument --against: {args.against} is not a --losses file (a JSON list of one mean loss per "
                    f"step); give a file that --losses wrote")
        if len(reference) < args.steps:  # the steps past its end would go uncompared
            p.error(f"argument --against: {args.against} holds {len(reference)} steps' losses, fewer than --steps "
                    f"{args.steps}: give --steps {len(reference)}, or a file of a longer run")
    if args.trace is not None:
        try:
            ensure_writable(args.trace)
        except OSError as e:
            p.error(f"argument --trace: cannot write to {args.trace} ({e.strerror})")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # started by torchrun: this process is one of its ranks
        worker(int(os.environ["RANK"]), args, None)
        return
    with tempfile.TemporaryDirectory() as tmp:
        try:
            # Forked, the ranks start from this process's import of torch and stage 04 instead of importing them again.
            mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.world_size,
                               start_method="fork")
        except mp.ProcessExitedException as e:
            print(f"job failed: {e}", file=sys.stderr)
            sys.exit(1)


if __name__ == "__main__":
    main()
