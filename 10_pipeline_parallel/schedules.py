"""Stage 10 by hand, continued: interleaved 1F1B and zero-bubble (ZB-H1) beside GPipe and 1F1B, with the timeline.

by_hand.py's GPipe and 1F1B leave a bubble of (p - 1) / (m + p - 1) of the step. Two ways to make it smaller:

- interleaved 1F1B: the layers cut into p * v stages and placed round-robin, rank r holding stages r, r + p, ...
  (v virtual stages each). A micro-batch passes every rank v times, each pass 1/v of the rank's work, so filling and
  draining the pipeline costs 1/v as much: a bubble of (p - 1) / (v * m + p - 1);
- ZB-H1: each backward cut in two. B, the gradient of the stage's input, is what the previous stage waits for: it
  runs and is sent at once. W, the gradient of the weights, waits for no one: it runs later, where the stage would
  otherwise sit idle. With F, B and W equally long, a bubble of (p - 1) / (3m + p - 1), a third of 1F1B's time.

Every schedule runs here on a deeper MLP than the stage's (--layers Linear layers; stage s holds the s-th of p * v
runs of them), a few steps of fixed batches, each from the same weights, and records what each rank computed and when.
orders.py holds the tables; timeline.py measures and draws the events. tests/test_pipeline_schedules.py checks every
step's loss and the whole state against one process, and each rank's order against the schedule's table.

    torchrun --standalone --nproc_per_node=2 10_pipeline_parallel/schedules.py --out runs/10_schedules
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # by_hand.py, task.py, orders.py and timeline.py, beside it
from by_hand import ArgumentParser, clock, exit_without_teardown, positive  # noqa: E402
from orders import SCHEDULES, Action, slot_clock, stages_of  # noqa: E402
from task import N_CLASSES, N_FEATURES, BatchMeanLoss, make_data  # noqa: E402
from timeline import bubble, draw, formula, idle  # noqa: E402


class Net(nn.Sequential):
    """An MLP of `layers` Linear layers, a ReLU after each but the last: features -> width -> ... -> classes."""

    def __init__(self, layers: int, width: int) -> None:
        sizes = [N_FEATURES] + [width] * (layers - 1) + [N_CLASSES]
        modules: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:], strict=False)):
            modules += [nn.Linear(n_in, n_out)] + ([nn.ReLU()] if i < layers - 1 else [])
        super().__init__(*modules)


def cut(model: Net, n: int) -> list[nn.Sequential]:
    """The model's layers (a Linear and its ReLU) in n runs, as even as the count allows."""
    modules = list(model)
    layers = [modules[i:i + 2] for i in range(0, len(modules), 2)]
    return [nn.Sequential(*[m for layer in layers[s * len(layers) // n:(s + 1) * len(layers) // n] for m in layer])
            for s in range(n)]


def plan(orders: list[list[Action]], n_stages: int, owner: dict[int, int], rank: int) -> list[tuple]:
    """This rank's step: its computations, and between them the exchanges, each one batch of the messages made at one
    moment of the slot clock: its sends and receives there are its neighbours' receives and sends there, so every
    batch meets its partners' and none waits on another (the rule NCCL imposes, tests/sync_sends.py emulates)."""
    when = slot_clock(orders, n_stages)
    moments: dict[float, tuple[list, list]] = {}  # slot -> (sends: (key, peer), receives: (key, peer))
    for (kind, s, m), (_, end) in when.items():
        to = {"F": s + 1 if s < n_stages - 1 else None, "B": s - 1 if s > 0 else None, "W": None}[kind]
        if to is None or owner[to] == owner[s]:
            continue  # nothing made for another rank
        key = ("F" if kind == "F" else "B", to, m)  # what the receiver keeps it under
        if owner[s] == rank:
            moments.setdefault(end, ([], []))[0].append((key, owner[to]))
        if owner[to] == rank:
            moments.setdefault(end, ([], []))[1].append((key, owner[s]))
    exchanges = [("exchange", *moments[t]) for t in sorted(moments)]
    times = sorted(moments)
    steps: list[tuple] = []
    for action in orders[rank]:
        while times and times[0] <= when[action][0]:  # the messages due before this computation starts
            times.pop(0)
            steps.append(exchanges.pop(0))
        steps.append(("compute", action))
    return steps + exchanges


class Pipe:
    """One rank's side: its stages, what it keeps between a micro-batch's forward and its backward (and W), and the
    events it recorded: (rank, stage, micro-batch, kind, start, end, sent), `sent` when what it made had left."""

    def __init__(self, stages: dict[int, nn.Sequential], n_stages: int, loss_fn: BatchMeanLoss, v: int) -> None:
        self.stages, self.n, self.loss_fn = stages, n_stages, loss_fn
        self.rank, p = dist.get_rank(), dist.get_world_size()
        self.owner = {s: r for r in range(p) for s in stages_of(r, p, v)}  # who holds each stage
        self.received: dict[tuple[str, int, int], torch.Tensor] = {}  # ("F", s, m): s's input; ("B", s, m): output grad
        self.made: dict[tuple[str, int, int], tuple[torch.Tensor, list]] = {}  # the same keys: made here, not yet sent
        self.held: dict[tuple[int, int], tuple] = {}  # (s, m) -> input, output, each Linear's (layer, input, output)
        self.for_w: dict[tuple[int, int], list] = {}  # (s, m) -> each Linear's (layer, input, output gradient)
        self.peak_held = 0  # the most (stage, micro-batch) activations held at once
        self.events: list[list] = []
        self.losses: list[torch.Tensor] = []

    def run(self, steps: list[tuple], xs: tuple, ys: tuple) -> None:
        """One step, as plan() laid it out: the computations in the schedule's order, the exchanges between them."""
        self.losses, split = [], any(step[1][0] == "W" for step in steps if step[0] == "compute")
        for step in steps:
            if step[0] == "exchange":
                self.exchange(step[1], step[2], ys)
                continue
            kind, s, m = step[1]
            made = {"F": self.forward, "B": self.backward, "W": self.weight}[kind](s, m, xs[m], ys[m], split)
            if made is not None:  # for the next stage: kept here if it is on this rank too, else sent when planned
                tensor, key = made
                if self.owner[key[1]] == self.rank:
                    self.received[key] = tensor
                else:
                    self.made[key] = (tensor, self.events[-1])

    def exchange(self, sends: list, receives: list, ys: tuple) -> None:
        """One batch_isend_irecv: what this rank made at this moment goes out, what its neighbours made comes in."""
        ops, sent = [], []
        for key, peer in sends:
            tensor, event = self.made.pop(key)
            ops.append(dist.P2POp(dist.isend, tensor, peer))
            sent.append(event)
        for (kind, s, m), peer in receives:
            layer = [module for module in self.stages[s] if isinstance(module, nn.Linear)][0 if kind == "F" else -1]
            width = layer.in_features if kind == "F" else layer.out_features
            self.received[kind, s, m] = torch.empty(len(ys[m]), width, dtype=layer.weight.dtype)
            ops.append(dist.P2POp(dist.irecv, self.received[kind, s, m], peer))
        for work in dist.batch_isend_irecv(ops):  # sync point: sent, and received
            work.wait()
        for event in sent:
            event[6] = clock(torch.device("cpu"))  # what that computation made has left

    def record(self, s: int, m: int, kind: str, start: float) -> None:
        self.events.append([self.rank, s, m, kind, start, clock(torch.device("cpu")), None])

    def forward(self, s: int, m: int, x: torch.Tensor, y: torch.Tensor, split: bool) -> tuple | None:
        inputs = x if s == 0 else self.received.pop(("F", s, m)).requires_grad_()
        start, out, linears = clock(torch.device("cpu")), inputs, []
        for module in self.stages[s]:
            z = module(out)
            if isinstance(module, nn.Linear):
                linears.append((module, out, z))  # W needs each Linear's input and its output's gradient
            out = z
        if s == self.n - 1:
            out = self.loss_fn(out, y)
            self.losses.append(out.detach())
        self.record(s, m, "F", start)
        self.held[s, m] = (inputs, out, linears)
        self.peak_held = max(self.peak_held, len(self.held))
        return None if s == self.n - 1 else (out.detach(), ("F", s + 1, m))

    def backward(self, s: int, m: int, x: torch.Tensor, y: torch.Tensor, split: bool) -> tuple | None:
        """The whole backward (GPipe, 1F1B, interleaved), or under ZB-H1 B alone: the gradients of the stage's input
        and of each Linear's output, in one pass that leaves the weights' gradients out; W makes them from these."""
        inputs, out, linears = self.held[s, m] if split else self.held.pop((s, m))
        grad = None if s == self.n - 1 else self.received.pop(("B", s, m))
        start = clock(torch.device("cpu"))
        if split:
            wanted = [z for _, _, z in linears] + ([inputs] if s > 0 else [])
            grads = torch.autograd.grad(out, wanted, grad)  # the weights are not asked for: not computed
            self.for_w[s, m] = [(layer, a.detach(), g)
                                for (layer, a, _), g in zip(linears, grads[:len(linears)], strict=True)]
            sent = grads[-1] if s > 0 else None
        else:
            out.backward(grad)  # the weights' gradients add up in .grad
            sent = inputs.grad if s > 0 else None
        self.record(s, m, "B", start)
        return None if s == 0 else (sent, ("B", s - 1, m))

    def weight(self, s: int, m: int, x: torch.Tensor, y: torch.Tensor, split: bool) -> None:
        """W: each Linear's weight gradient, its output's gradient times its input, added to .grad."""
        start = clock(torch.device("cpu"))
        for layer, a, g in self.for_w.pop((s, m)):
            for param, grad in ((layer.weight, g.T @ a), (layer.bias, g.sum(0))):
                param.grad = grad if param.grad is None else param.grad + grad
        self.record(s, m, "W", start)
        del self.held[s, m]  # its activations are free only now


def train(args: argparse.Namespace, schedule: str, m: int) -> dict:
    """--steps steps of `schedule` with m micro-batches from the seed's weights: every step's loss, the last step's
    events, each rank's peak of held activations, and (rank 0) the whole model's weights and momentum."""
    rank, p = dist.get_rank(), dist.get_world_size()
    v = args.stages_per_rank if schedule == "interleaved" else 1
    dtype = getattr(torch, args.dtype)
    train_set, _ = make_data(args.seed, dtype)
    torch.manual_seed(args.seed)  # the same weights for every schedule and rank
    stages = cut(Net(args.layers, args.width).to(dtype), p * v)
    mine = {s: stages[s] for s in stages_of(rank, p, v)}
    optimizer = torch.optim.SGD([w for stage in mine.values() for w in stage.parameters()], lr=args.lr, momentum=0.9)
    loss_fn = BatchMeanLoss()
    pipe = Pipe(mine, p * v, loss_fn, v)
    steps = plan([SCHEDULES[schedule](m, r, p, v) for r in range(p)], p * v, pipe.owner, rank)
    losses = []
    for step in range(args.steps):
        x, y = train_set[step * args.batch_size:(step + 1) * args.batch_size]
        optimizer.zero_grad(set_to_none=True)
        loss_fn.samples = len(y)
        pipe.events.clear()
        dist.barrier()  # every rank starts the step together: the timeline's span is the step's
        pipe.run(steps, x.tensor_split(m), y.tensor_split(m))
        optimizer.step()
        loss = torch.stack(pipe.losses).sum() if pipe.losses else torch.zeros((), dtype=dtype)
        dist.all_reduce(loss)  # the last stage's rank alone has it
        losses.append(loss.item())
    mine_state = {s: [(w.detach(), optimizer.state[w]["momentum_buffer"]) for w in stage.parameters()]
                  for s, stage in mine.items()}
    every: list = [None] * p
    dist.all_gather_object(every, {"events": pipe.events, "peak_held": pipe.peak_held, "state": mine_state})
    since = min(e[4] for r in every for e in r["events"])  # perf_counter: one clock for a machine's processes
    events = [[*e[:4], e[4] - since, e[5] - since, None if e[6] is None else e[6] - since]
              for r in every for e in r["events"]]
    state = [pair for s in range(p * v) for r in every if s in r["state"] for pair in r["state"][s]]
    return {"schedule": schedule, "p": p, "v": v, "m": m, "losses": losses, "events": events,
            "peak_held": [r["peak_held"] for r in every], "state": state}


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="10_pipeline_parallel/schedules.py", description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved,zbh1", help="comma-separated: "
                        + ", ".join(SCHEDULES))
    parser.add_argument("--microbatches", default="4,8", help="comma-separated m")
    parser.add_argument("--stages-per-rank", type=positive(int), default=2, help="v, for interleaved")
    parser.add_argument("--layers", type=positive(int), default=8)
    parser.add_argument("--width", type=positive(int), default=64)
    parser.add_argument("--batch-size", type=positive(int), default=32)
    parser.add_argument("--steps", type=positive(int), default=3)
    parser.add_argument("--lr", type=positive(float), default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--timeout", type=positive(float), default=60.0)
    parser.add_argument("--out", type=Path, help="write schedules.json (losses, events) and states.pt here")
    parser.add_argument("--figure", type=Path, help="draw the timelines of the first m here (a .png)")
    args = parser.parse_args(argv)
    p = int(os.environ.get("WORLD_SIZE", 1))
    names, ms = args.schedules.split(","), [int(m) for m in args.microbatches.split(",")]
    if unknown := [n for n in names if n not in SCHEDULES]:
        parser.error(f"argument --schedules: {unknown[0]} is not one of {', '.join(SCHEDULES)}")
    v_most = max(args.stages_per_rank if n == "interleaved" else 1 for n in names)
    if p * v_most > args.layers:
        parser.error(f"argument --layers: {args.layers} layers cannot make {p} x {v_most} stages of one or more")
    for m in ms:
        if args.batch_size % m or m < p or ("interleaved" in names and m % p):
            parser.error(f"argument --microbatches: {m} must divide --batch-size {args.batch_size}, be at least the "
                         f"{p} ranks and, for interleaved, a multiple of them")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    else:  # one process: every stage here
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    runs = [train(args, name, m) for m in ms for name in names]
    if dist.get_rank() == 0:
        for run in runs:
            each = idle(run["events"], p)
            print(f"{run['schedule']:>11} p={p} v={run['v']} m={run['m']}: loss {run['losses'][-1]:.6f} | bubble "
                  f"{bubble(run['events'], p):.1%} (formula {formula(run['schedule'], p, run['m'], run['v']):.1%}) "
                  f"| idle per rank {' '.join(f'{t * 1e3:.1f}' for t in each)} ms | held at peak "
                  f"{' '.join(map(str, run['peak_held']))}")
        if args.out is not None:
            torch.save({f"{r['schedule']} m={r['m']}": r.pop("state") for r in runs}, args.out / "states.pt")
            (args.out / "schedules.json").write_text(json.dumps(runs) + "\n")
        if args.figure is not None:
            draw([r for r in runs if r["m"] == ms[0]], args.figure)
    dist.destroy_process_group()
    exit_without_teardown()


if __name__ == "__main__":
    main()
