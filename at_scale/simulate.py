"""One rank of a training job of any size, simulated in one process by stage 13's or 14's own code at a real shape.

    python at_scale/simulate.py --layers 126 --width 16384 --heads 128 --context 8192 --vocab 128256 \\
        --world 16384 --tp 8 --pp 16 --parallel fsdp --micro-batch 1 --accumulate 16 --rank 0 --out runs/405b

Stage 13's train.py (13_pipeline_4d/: its GPT, grid of process groups, parallelize, pipeline, context parallelism and
Trainer), unchanged, builds the chosen rank's part of the model and runs its training step; with --experts, stage
14's (14_experts/: the same GPT with a mixture of experts in every block, the experts shared out over --ep ranks;
stage 14 always has experts, a router even at one, so the dense GPT stays stage 13's). Nothing of that size
exists: the process group is torch's fake one (every collective returns at once and moves nothing) and every tensor
is a fake tensor (a shape, a dtype and a device, no memory), so one rank of a 405-billion-parameter job of 16,384
ranks runs on a laptop. What that rank holds and does is measured from the live code, in the second step (the first
also infers the pipeline's shapes and creates AdamW's moments; DDP's second rebuilds its buckets: its third):

- the bytes of its parameters, their gradients and AdamW's state after the optimizer's step, each storage once;
- its activation peak: the most bytes it holds at once during the step beyond that state (torch's MemTracker, or
  FSDPMemTracker for FSDP2);
- the bytes it sends, per collective and per dimension of the grid, counted at every c10d op whoever calls it;
- the FLOPs of its step (torch's FlopCounterMode), of its own pieces of every tensor.

The pipeline runs under the stages' own schedules: GPipe, 1F1B, and with --stages-per-rank v, interleaved 1F1B (v
stages a rank, round-robin: Llama 3's). Their zero-bubble schedules are refused: they split each backward in two,
and torch's memory tracker cannot follow that (on real tensors neither).

Where the fake process group or fake tensors cannot carry a piece of the code, a shim stands in; the output lists
each one the run used ("assumed"). tests/test_at_scale.py runs the same measurement on real tensors in a real gloo
job of the same layout, at a size this machine trains, and checks that the numbers agree.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import io
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, off_rank_bytes, positive, print_table  # noqa: E402
from tour import load_stage  # noqa: E402

STAGE = "13_pipeline_4d"  # the dense GPT
EXPERTS_STAGE = "14_experts"  # stage 13's GPT with a mixture of experts in every block (--experts)
VOCAB = 65  # tiny Shakespeare's characters: the stages' own vocabulary
# Characters a made-up text can use: every Unicode code point from the space up, but the surrogates (not UTF-8).
CHARACTERS = 0x110000 - 32 - 2048


def parse_args(argv: list[str] | None = None, scratch: Path | None = None) -> argparse.Namespace:
    """The simulation's flags, then the stage's own checks of the layout (its parse_args, at --world ranks), each
    refusal one line in this script's name. `scratch`: where the made-up text goes (default: a temporary folder,
    removed at exit). args.stage holds the stage's own arguments, args.stage_name the stage that runs."""
    p = ArgumentParser(prog="at_scale/simulate.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=positive(int), default=2, help="transformer blocks")
    p.add_argument("--width", type=positive(int), default=64, help="size of the residual stream")
    p.add_argument("--heads", type=positive(int), default=4, help="attention heads per block")
    p.add_argument("--context", type=positive(int), default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=positive(int), default=VOCAB, help="tokens in the vocabulary")
    p.add_argument("--world", type=positive(int), default=2, help="ranks in the job")
    p.add_argument("--tp", type=positive(int), default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=positive(int), default=1, help="pipeline stages")
    p.add_argument("--cp", type=positive(int), default=1, help="context-parallel degree")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism, as the stages' --sp (with --tp): the norms, the residual stream and "
                        "the loss split by sequence over tp")
    runs = [kind for kind in pipeline().SCHEDULES if kind not in pipeline().SPLIT_BACKWARD]
    p.add_argument("--pp-schedule", choices=list(pipeline().SCHEDULES), metavar="{" + ",".join(runs) + "}",
                   default="1f1b", help="the pipeline's schedule, as the stages' --pp-schedule: GPipe or 1F1B, or "
                                        "with --stages-per-rank 2 or more, interleaved 1F1B (the zero-bubble ones are "
                                        "refused: torch's memory tracker cannot follow their split backward)")
    p.add_argument("--stages-per-rank", type=positive(int), default=1,
                   help="pipeline stages each pp rank holds (virtual stages), as the stages' --stages-per-rank")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none",
                   help="activation checkpointing, as the stages' --ac: none, every block (full), or all but its "
                        "matmuls and attention (selective)")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                   help="over the dp x cp ranks: a replica each (DDP) or a shard each (FSDP2)")
    p.add_argument("--replicate", type=positive(int),
                   help="HSDP, as stages 13 and 14's --replicate (with --parallel fsdp): R replicas of FSDP2's "
                        "shards over dp / R x cp ranks (default 1: none)")
    p.add_argument("--micro-batch", type=positive(int), default=1, help="sequences per micro-batch per dp rank")
    p.add_argument("--accumulate", type=positive(int), default=1,
                   help="micro-batches per step (under --pp, the pipeline's)")
    p.add_argument("--rank", type=int, default=0, help="the rank simulated, 0 to --world - 1")
    p.add_argument("--experts", type=positive(int),
                   help="experts per block: stage 14's mixture of experts (default: none, stage 13's dense GPT)")
    p.add_argument("--top-k", type=positive(int), help="the experts each token goes to (with --experts; default 2)")
    p.add_argument("--ep", type=positive(int),
                   help="expert-parallel degree: dp x cp ranks that share out the experts (with --experts; default 1)")
    p.add_argument("--out", type=Path, help="write simulate.json here")
    args = p.parse_args(argv)
    for flag in ("top_k", "ep"):
        if getattr(args, flag) is not None and args.experts is None:
            p.error(f"argument --{flag.replace('_', '-')}: needs --experts (without it the simulation runs stage "
                    f"13's dense GPT, which has no experts)")
    args.stage_name = STAGE if args.experts is None else EXPERTS_STAGE
    if args.pp_schedule in pipeline().SPLIT_BACKWARD:
        p.error(f"argument --pp-schedule: {args.pp_schedule} splits each backward in two (the input gradients by "
                f"autograd.grad, then the weights'), which torch's memory tracker cannot follow (its module hooks "
                f"fail inside autograd.grad, fake tensors or not); use {', '.join(runs)}")
    if args.vocab > CHARACTERS:
        p.error(f"argument --vocab: at most {CHARACTERS:,} (the characters of the made-up text), got {args.vocab:,}")
    if not 0 <= args.rank < args.world:
        p.error(f"argument --rank: {args.rank} is not a rank of --world {args.world}; use 0 to {args.world - 1}")
    if args.out is not None:
        p.check_out_writable(args.out)
    if scratch is None:
        scratch = Path(tempfile.mkdtemp(prefix="simulate_"))
        atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    args.stage = stage_args(args, made_up_text(args.vocab, args.context, scratch), p)
    return args


def made_up_text(vocab: int, context: int, folder: Path) -> Path:
    """A text of `vocab` distinct characters, long enough that the stage's held-out tenth holds a window of `context`:
    the stage's corpus then has the vocabulary asked for. What it says does not matter: what is measured depends on
    the shapes alone (a token is looked up, never branched on). Written whole or not at all (written aside, then
    renamed): the ranks of a real job, started at once, share the folder, and one must never read another's half."""
    path = folder / f"text_{vocab}_{context}.txt"
    if not path.exists():
        chars = [chr(c) for c in itertools.islice(
            (c for c in range(32, 0x110000) if not 0xD800 <= c <= 0xDFFF), vocab)]  # the first vocab alone
        aside = path.with_name(f"{path.name}.{os.getpid()}")
        aside.write_text("".join(chars[i % vocab] for i in range(vocab + 10 * (context + 2))), encoding="utf-8")
        os.replace(aside, path)
    return path


def stage_args(args: argparse.Namespace, data: Path, p: ArgumentParser) -> argparse.Namespace:
    """The stage's parse_args on the stage's flags at --world ranks: its checks refuse a layout it cannot run (a
    degree that does not divide the world or the heads, fewer blocks than stages, ...); their line is said here."""
    flags = ["--layers", args.layers, "--width", args.width, "--heads", args.heads, "--context", args.context,
             "--tp", args.tp, "--pp", args.pp, "--pp-schedule", args.pp_schedule,
             "--stages-per-rank", args.stages_per_rank, "--cp", args.cp,
             "--parallel", args.parallel, "--ac", args.ac,
             "--batch-size", args.micro_batch, "--accumulate", args.accumulate, "--device", "cpu", "--sample", "0",
             "--data", data] + (["--sp"] if args.sp else []) + \
        (["--replicate", args.replicate] if args.replicate is not None else [])
    if args.experts is not None:  # stage 14's flags; its checks: k at most E, ep dividing E and the dp x cp ranks
        flags += ["--experts", args.experts, "--top-k", args.top_k or 2, "--ep", args.ep or 1]
    err = io.StringIO()
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(args.world)}), contextlib.redirect_stderr(err):
        try:
            return stage(args.stage_name).parse_args([str(f) for f in flags])
        except SystemExit:
            pass
    p.error(err.getvalue().strip().split(": error: ", 1)[-1].replace("--batch-size", "--micro-batch"))


@functools.cache
def stage(name: str = STAGE) -> ModuleType:
    """A stage's train.py as a module, with the files beside it (tour.load_stage): stage 13's, or 14's."""
    return load_stage(name)


def experts_of(s: ModuleType):
    """Stage 14's expert_params (experts.py, as its train.py imported it): its expert weights by name, what FSDP2
    leaves out under --ep."""
    return sys.modules[s.ExpertParallel.__module__].expert_params


def pipeline(name: str = STAGE) -> ModuleType:
    """A stage's pipeline.py, as its train.py imported it: the schedules' names, held_at_most."""
    return sys.modules[stage(name).Pipeline.__module__]


# ─── The shims: what the fake process group and fake tensors cannot carry ─────────────────────────────────────────
# Each is in force only while the simulation runs; the output lists those a run used.

ASSUMED = {
    "to": "Module.to() with nothing to change returns the module (the stage's GPT(cfg).to(cpu, float32)): under fake "
          "tensors torch 2.13 would swap every parameter for itself, and fail",
    "mesh": "the DeviceMesh's bookkeeping (which rank sits where in it: small integer tensors) runs on real tensors",
    "ddp_verify": "DDP's constructor skips its check that every rank's parameters have the same shapes (a rank alone "
                  "has none to compare)",
    "ddp_hook": "DDP all-reduces each bucket from a comm hook that does what its built-in one does (divide by the "
                "group's size, all-reduce the bucket): the fake group's work carries no result, which the built-in "
                "one needs",
    "ddp_buckets": "DDP keeps the bucket it starts with, every gradient in one (as it starts when it need not find "
                   "unused parameters); a real one rebuilds its buckets at its second step, 25 MiB each (the first "
                   "1 MiB) in the order the gradients arrived, broadcast from rank 0: the same bytes, in more calls",
    "even_load": "the experts' load is even (the router's choices are data, which fake tensors do not hold): each "
                 "MoE layer's counts of rows per expert (torch.bincount) are this rank's tokens x k shared out evenly "
                 "over the E experts (the first ones one more where E does not divide them), and under ep every rank "
                 "of the group routes as this one, so each sends every other rank an even share",
    "pp_shapes": "the pipeline's first step learns from its neighbours what they send (a vote, then the shapes): the "
                 "vote runs on real tensors, and what a neighbour sends is what pipeline.py says passes between "
                 "stages, the residual stream: [micro-batch, context / cp, width], float32",
    "p2p_held": "a pipeline's send or receive holds its tensor for as long as its work object lives, as gloo's does "
                "(torch's interleaved schedule waits on its sends at the end of the step: what they sent stays held "
                "until then); the fake group's work holds none",
}


class HeldWork:
    """A fake group's work for a batch of sends and receives, holding their tensors while it lives, as a real backend's
    does (ASSUMED["p2p_held"])."""

    def __init__(self, work, tensors: list) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *a, **k):
        return self.work.wait(*a, **k)


def held_p2p(batch_p2p):
    """torch's _batch_p2p (the pipeline schedules' sends and receives), its works holding what they move."""
    @functools.wraps(batch_p2p)
    def run(p2p_ops, desc=None):
        return [HeldWork(w, [op.tensor for op in p2p_ops]) for w in batch_p2p(p2p_ops, desc)]
    return run


def neighbour_sends(micro_batch: int, tokens: int, width: int, dtype):
    """PipelineStage._recv_meta, which the fake group cannot carry: what the neighbouring stage sends, made as it
    makes it (torch's own classes). Forward: the previous stage's output, the residual stream; backward: its
    gradient (pipeline.py's Pipeline: [micro-batch, tokens, width] in the stage's dtype, between every two stages)."""
    import torch
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta, extract_tensor_metas

    def receive(self, src_stage: int):
        x = torch.empty(micro_batch, tokens, width, dtype=dtype)
        if src_stage < self.stage_index:
            return _StageForwardMeta(forward_metas=extract_tensor_metas((x.requires_grad_(),)))
        return _StageBackwardMeta(backward_metas=extract_tensor_metas((x,)))
    return receive


@contextlib.contextmanager
def simulated(args: argparse.Namespace) -> Iterator[None]:
    """Fake tensors, and the shims of ASSUMED, for the duration of the block."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    def on_real_tensors(method):
        @functools.wraps(method)
        def run(*a, **k):
            with unset_fake_temporarily():
                return method(*a, **k)
        return run

    to = nn.Module.to

    def to_unless_unchanged(self, *a, **k):
        like = torch.empty(()).to(*a, **k)  # the device and dtype the call asks for
        if all(t.device == like.device and (t.dtype == like.dtype or not t.is_floating_point())
               for t in [*self.parameters(), *self.buffers()]):
            return self
        return to(self, *a, **k)

    shims = [mock.patch.object(nn.Module, "to", to_unless_unchanged),
             mock.patch.object(DeviceMesh, "__init__", on_real_tensors(DeviceMesh.__init__)),
             mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes", lambda *a, **k: None),
             mock.patch.object(_PipelineSchedule, "_warmup_p2p", on_real_tensors(_PipelineSchedule._warmup_p2p)),
             mock.patch.object(PipelineStage, "_recv_meta",
                               neighbour_sends(args.micro_batch, args.context // args.cp // (args.tp if args.sp else 1),
                                               args.width, torch.float32)),
             mock.patch.object(PipelineStage, "_send_meta", lambda *a, **k: None),
             mock.patch.object(schedules, "_batch_p2p", held_p2p(schedules._batch_p2p))]
    with contextlib.ExitStack() as stack:
        for shim in shims:
            stack.enter_context(shim)
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        yield


@contextlib.contextmanager
def even_routing(fake: bool) -> Iterator[None]:
    """ASSUMED["even_load"], for the duration of the block: torch.bincount (what experts.py counts each expert's rows
    with) returns the even counts, as a real tensor. In a simulation (fake) these are then the one real values in the
    step, and routing_counts() keeps them real through the ops on them (the all-to-all's split sizes, each expert's rows
    are read from them)."""
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def even_counts(x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
        if weights is not None or minlength < 1:
            raise NotImplementedError("the even load is of the counts of rows per expert: bincount(x, minlength=E)")
        share, extra = divmod(x.numel(), minlength)
        with unset_fake_temporarily():  # (a no-op outside fake tensors)
            counts = torch.tensor([share + (e < extra) for e in range(minlength)], device=x.device)
        if fake:
            routing.known[counts] = True
        return counts

    routing = routing_counts() if fake else None
    with mock.patch.object(torch, "bincount", even_counts), routing or contextlib.nullcontext():
        yield


def routing_counts():
    """A dispatch mode, just above fake tensors: an op whose tensors are all real, one of them the even counts (or made
    from them), runs on them, for real, and its result is known too; every other op goes on to fake tensors. So the
    counts' sums (the all-to-alls' split sizes), the rows each expert receives, the order of the rows (an index into
    fake rows) are real values, as in a real run. The all-to-all of the counts over ep, which the fake process group
    leaves unfilled, is filled as the even load has it: every rank of the group sends this rank what it sends itself
    (its counts for this rank's experts)."""

    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
    from torch.distributed._tools.fake_collectives import CollectiveOp
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.weak import WeakIdKeyDictionary

    def tensors_in(x) -> list:  # (an op's arguments and results: tensors, in lists and tuples too)
        if isinstance(x, (list, tuple)):
            return [t for item in x for t in tensors_in(item)]
        return [x] if isinstance(x, torch.Tensor) else []

    class RoutingCounts(TorchDispatchMode):
        known = WeakIdKeyDictionary()  # the real tensors among the fake ones: the counts, and what is made of them

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            tensors = tensors_in([*args, *(kwargs or {}).values()])
            if not any(t in self.known for t in tensors) or any(isinstance(t, FakeTensor) for t in tensors):
                return func(*args, **(kwargs or {}))
            with unset_fake_temporarily():
                out = func(*args, **(kwargs or {}))
                if func.name() == "c10d::alltoall_base_":  # (output, input, group, ...): an even exchange
                    group = CollectiveOp.get_process_group(func, args)
                    received, sent = args[0], args[1]
                    received.view(group.size(), -1).copy_(sent.view(group.size(), -1)[group.rank()])
            for t in tensors_in(out):
                self.known[t] = True
            return out

    return RoutingCounts()


def shims_used(a: argparse.Namespace, moe: bool) -> list[str]:
    """What ASSUMED says for the shims a run of the stage's arguments `a` goes through (moe: stage 14's)."""
    used = {"to", "mesh"} | ({"ddp_verify", "ddp_hook", "ddp_buckets"} if a.parallel == "ddp" else set()) | \
        ({"pp_shapes", "p2p_held"} if a.pp > 1 else set()) | ({"even_load"} if moe else set())
    return [text for key, text in ASSUMED.items() if key in used]


class KeptBuckets:
    """A DDP model's reducer, but for rebuilding its buckets: the rebuild broadcasts rank 0's order of them, which
    fake tensors cannot carry (ASSUMED["ddp_buckets"])."""

    def __init__(self, reducer) -> None:
        self.reducer = reducer

    def __getattr__(self, name: str):
        return getattr(self.reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def all_reduce_hook(group, bucket):
    """What DDP's built-in comm hook does with a bucket (divide by the group's size, then all-reduce it: the average),
    the bucket handed back as a finished future: the fake group's own future carries no tensor."""
    import torch
    import torch.distributed as dist
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    dist.all_reduce(buffer, group=group)
    done = torch.futures.Future()
    done.set_result(buffer)
    return done


# ─── What is measured ──────────────────────────────────────────────────────────────────────────────────────────────

# Each collective op of torch (c10d's, and the functional ones DTensor calls): its kind, and which of its arguments
# is the tensor this rank hands over (an all-gather's share, a reduce-scatter's whole input; a list counts whole).
OPS = {"c10d::allreduce_": ("all_reduce", 0), "_c10d_functional::all_reduce": ("all_reduce", 0),
       "_c10d_functional::all_reduce_": ("all_reduce", 0), "_c10d_functional::all_reduce_coalesced": ("all_reduce", 0),
       "c10d::allgather_": ("all_gather", 1), "c10d::_allgather_base_": ("all_gather", 1),
       "_c10d_functional::all_gather_into_tensor": ("all_gather", 0),
       "_c10d_functional::all_gather_into_tensor_out": ("all_gather", 0),
       "c10d::reduce_scatter_": ("reduce_scatter", 1), "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
       "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", 0),
       "c10d::send": ("send", 0), "c10d::recv_": ("recv", 0), "c10d::recv_any_source_": ("recv", 0),
       "c10d::broadcast_": ("broadcast", 0), "_c10d_functional::broadcast": ("broadcast", 0),
       "_c10d_functional::broadcast_": ("broadcast", 0),
       "c10d::alltoall_base_": ("all_to_all", 1), "_c10d_functional::all_to_all_single": ("all_to_all", 0)}
NOTHING_SENT = {"c10d::barrier", "c10d::monitored_barrier_", "_c10d_functional::wait_tensor"}
# What a ring algorithm sends from a rank, in bytes of the tensor it hands over, at W ranks: as the benchmarks count
# (tools/cli.py SentBytes, zero_by_hand/memory.py). An all-reduce is a reduce-scatter and an all-gather of its tensor;
# an all-gather passes on the W - 1 other shares; a broadcast, pipelined along a chain, is forwarded by every rank but
# the last: (W - 1) / W of it on average. (An all-to-all: the rows for the other ranks, counted apart.)
RING = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_gather": lambda w: w - 1, "reduce_scatter": lambda w: (w - 1) / w,
        "send": lambda w: 1, "recv": lambda w: 0, "broadcast": lambda w: (w - 1) / w}


def nbytes(tensors) -> int:
    """Bytes of a tensor or a list of them: their elements, not the storage they may be a view of."""
    if isinstance(tensors, (list, tuple)):
        return sum(nbytes(t) for t in tensors)
    return tensors.numel() * tensors.element_size()


def sent_by(name: str, args: tuple, world: int, me: int) -> tuple[str, int, float]:
    """(kind, bytes of the tensor handed over, bytes sent) of one call of collective op `name` on rank `me` of
    `world`."""
    if name not in OPS:
        raise NotImplementedError(f"{name}: a collective with no rule for the bytes it sends (simulate.py OPS)")
    kind, at = OPS[name]
    tensor = nbytes(args[at])
    if kind == "all_to_all":  # its split sizes: c10d's after (output, input, group, output splits), functional's 2nd
        splits = args[4] if name.startswith("c10d::") else args[2]
        return kind, tensor, off_rank_bytes(args[at], splits or None, me, world)
    return kind, tensor, RING[kind](world) * tensor


class Collectives:
    """Every collective this rank calls in the block, whoever calls it, seen at the dispatcher as torch's c10d ops
    (DDP's reducer and FSDP2 call them from their own code, DTensor through functional collectives, the pipeline and
    the ring through batched sends and receives), by kind and by the grid's dimension its process group is."""

    def __init__(self, grid) -> None:
        import torch.distributed as dist
        from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops
        from torch.utils._python_dispatch import TorchDispatchMode

        # (One replica, --replicate 1: HSDP's shard group is the dp x cp ranks, and FSDP2's traffic is named dp_cp.)
        one = grid.sizes.get("replicate", 1) == 1
        dimension = {group.group_name: "dp_cp" if one and name == "shard_cp" else name
                     for name, group in grid.groups.items()}
        dimension[dist.group.WORLD.group_name] = "world"
        self.rows: dict[tuple[str, str], list] = {}
        rows = self.rows

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                name = func.name().split(".")[0]
                if func in collective_ops and name not in NOTHING_SENT:
                    group = CollectiveOp.get_process_group(func, args)  # (torch's table of where each op has it)
                    kind, tensor, sent = sent_by(name, args, group.size(), group.rank())
                    row = rows.setdefault((kind, dimension.get(group.group_name, group.group_name)), [0, 0, 0.0])
                    row[0] += 1
                    row[1] += tensor
                    row[2] += sent
                return out

        self.mode = Mode()

    def __enter__(self) -> Collectives:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)

    def table(self) -> list[dict]:
        return [{"kind": kind, "dimension": dim, "calls": calls, "tensor_bytes": tensor, "sent_bytes": sent}
                for (kind, dim), (calls, tensor, sent) in sorted(self.rows.items())]


@contextlib.contextmanager
def local_ops_only() -> Iterator[None]:
    """A dispatch mode entered last, so that it sees every op first: an op on DTensors it hands back to DTensor, which
    runs it as this rank's local ops, and those the modes below it (FLOPs, memory, bytes) see. They then count this
    rank's pieces of a tensor split over tp or sharded by FSDP2, not the whole tensor a DTensor stands for."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            return func(*args, **(kwargs or {}))
    with Mode():
        yield


# The trackers' names for the training state (MemTracker's; FSDPMemTracker's for FSDP2's shards): the parameters,
# buffers, gradients and optimizer state. Everything else a tracker sees is held for the step only.
STATE_KINDS = {"Parameter", "Buffer", "Gradient", "Optstate", "Sharded Param", "Sharded Grad", "OptState"}


def memory_tracker(model, optimizer, left_out: list | tuple = ()):
    """torch's memory tracker for `model` (FSDPMemTracker for an FSDP2 model, all its stages' under --stages-per-rank:
    it tells FSDP2's shards, its gathered weights and its communication buffers apart; else MemTracker), keeping also
    the most bytes held at once beyond the training state (transient_peak), with what was held then (at_peak).
    left_out: the parameters of an FSDP2 model that FSDP2 leaves alone (its ignored_params), whose gradients are state
    too."""
    from torch import nn
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.nn.modules.module import register_module_forward_pre_hook

    parts = getattr(model, "parts", [model])  # --stages-per-rank: a model per stage (pipeline.py's Stages)
    fsdp = isinstance(parts[0], FSDPModule)

    class Peaks(FSDPMemTracker if fsdp else MemTracker):
        def __enter__(self):
            # The trackers refuse a model called again in one step ("multiple iterative calls"), as every micro-batch
            # of --accumulate and of the pipeline calls it: before each call they forget the model's own statistics
            # (per module, not used here; the bytes held are kept). --stages-per-rank: each stage's model is called.
            called = {id(model)} | {id(part) for part in parts}

            def forget(module, inputs) -> None:  # (a pre-hook that returns something replaces the inputs)
                if id(module) in called:
                    self.memory_tracking.pop(module, None)
            self.forget = register_module_forward_pre_hook(forget)
            self.own = [p.register_post_accumulate_grad_hook(self.gradient) for p in left_out]
            return super().__enter__()

        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.forget.remove()
            for hook in self.own:
                hook.remove()

        def gradient(self, param) -> None:
            # FSDPMemTracker knows FSDP2's gradients only: a parameter FSDP2 leaves alone (stage 14's own experts
            # under --ep) has its .grad made in backward and counted as "Temp" while the step holds it, though it is
            # training state (state_of counts it): labelled as FSDP2's gradients are, it is not counted twice.
            self._update_and_maybe_create_winfos(param.grad, _FSDPRefType.SHARDED_GRAD)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(issubclass(t, DTensor) for t in types) and not self.seen(written_or_viewed(func, args, kwargs)):
                # An op that writes into, or views, memory the tracker never saw allocated: memory from before the
                # step (DDP's buckets) or a communication backend's own (gloo's reduce-scatter works on a copy of
                # its input, made inside the collective and cut up after it; the fake group has none). Not memory the
                # step allocates: left out.
                return func(*args, **(kwargs or {}))
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.sample()
            return out

        def seen(self, tensors: list) -> bool:
            return not tensors or any(self._WINFO.get(t.untyped_storage()) for t in tensors)

        def sample(self) -> int:
            """The bytes held now beyond the training state; the peak updated."""
            transient = 0
            for snapshot in self.get_tracker_snapshot("current").values():
                named = {str(getattr(k, "value", k)): v for k, v in snapshot.items()}
                transient = named["Total"] - sum(v for k, v in named.items() if k in STATE_KINDS)
                if transient > self.transient_peak:
                    self.transient_peak, self.at_peak = transient, named
            return transient

    tracker = Peaks(parts[0], optimizer) if fsdp else Peaks()
    if fsdp and len(parts) > 1:  # every stage's FSDP2 units (FSDPMemTracker instruments its root's modules)
        tracker._root_mod = nn.ModuleList(parts)
    if not fsdp:
        tracker.track_external(model, optimizer)
    tracker.transient_peak, tracker.at_peak = 0, {}
    return tracker


def written_or_viewed(func, args: tuple, kwargs: dict | None) -> list:
    """The tensors whose memory an op's output is: its first argument's for a view or an in-place op (name_), its out=
    argument's; none for an op that allocates its output."""
    import torch
    if func.is_view or func.name().split("::")[-1].split(".")[0].endswith("_"):
        first = args[0] if args else None
    else:
        first = (kwargs or {}).get("out")
    found = first if isinstance(first, (list, tuple)) else [first]
    return [t for t in found if isinstance(t, torch.Tensor)]


def storage_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each storage once (a DTensor: its local piece's)."""
    from torch.distributed.tensor import DTensor
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[id(storage)] = storage  # (kept alive until counted: an id is unique among live objects only)
    return sum(s.nbytes() for s in storages.values())


def state_of(model, optimizer) -> dict[str, int]:
    """What this rank holds of the training state: its parameters, their gradients, and AdamW's moments and step
    counters (optimizer.state)."""
    import torch
    params = list(model.parameters())
    return {"parameters": storage_bytes(params),
            "gradients": storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": storage_bytes(v for p in params for v in optimizer.state.get(p, {}).values()
                                       if isinstance(v, torch.Tensor))}


def cpu_attention_flops() -> dict:
    """FlopCounterMode's formulas for the CPU's attention kernel, which torch counts on a GPU only: the GPU kernels'
    own (the whole score matrix, the causal mask's hidden half too, as torch counts them there)."""
    import torch
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v),
            aten._scaled_dot_product_flash_attention_for_cpu_backward:
            lambda grad, q, k, v, *args, out_shape=None, **kwargs: sdpa_backward_flop_count(grad, q, k, v)}


# Steps run before the one measured: the first infers the pipeline's shapes and creates AdamW's moments; DDP's second
# rebuilds its buckets (new ones, as large as the gradients, in the order they arrived).
WARM_UP = {"ddp": 2, "fsdp": 1}


def measure(args: argparse.Namespace, fake: bool = True, even_load: bool = True) -> dict:
    """The chosen rank's step, measured. fake: in a fake process group this function starts and ends (the
    simulation); else in the process group the caller started (a real gloo job: the tests' reference), where
    args.rank is this process's rank. even_load (stage 14): the experts' load made even (ASSUMED["even_load"]); a
    real job can also run with its router's own load (False), a simulation cannot."""
    import torch.distributed as dist
    import torch.distributed.tensor.debug as dtensor_debug
    if fake and not even_load:
        raise ValueError("a simulation's experts need the even load: fake tensors carry no routing")
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # (importing it makes the "fake" backend)
        dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    try:
        return measured_step(args, fake, even_load)
    finally:
        if fake:
            dist.destroy_process_group()
        # DTensor caches its sharding decisions by mesh, and this run's meshes equal the next run's in this process:
        # the next would use this one's process groups (gone, or not the ones its grid names).
        dtensor_debug._clear_sharding_prop_cache()


def measured_step(args: argparse.Namespace, fake: bool, even: bool) -> dict:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.flop_counter import FlopCounterMode

    s, a, moe = stage(args.stage_name), args.stage, args.experts is not None
    start = time.perf_counter()
    device = torch.device("cpu")
    # As the stage's main() makes them: the grid of process groups, this rank's place in its cp group and pipeline
    # (and in stage 14, among the ranks that share out the experts: its ExpertParallel, passed on after cp).
    sizes = {"pp": a.pp, "dp": args.world // (a.pp * a.cp * a.tp), "cp": a.cp, "tp": a.tp,
             "replicate": a.replicate}  # (HSDP: the stage's --replicate)
    grid = s.Grid(sizes, a.ep, device, a.timeout) if moe else s.Grid(sizes, device, a.timeout)
    split = a.tp if a.sp else 1  # --sp: each cp share split again over tp, and what the stages pass on too
    cp = s.ContextParallel(grid.group("cp"), a.cp_impl, zigzag=not a.no_zigzag, split=split)
    ep = [s.ExpertParallel(grid.group("ep"), grid.group("ep_replicas"), device)] if moe else []
    pipe = s.Pipeline(grid.group("pp"), a.width, s.DTYPES[a.dtype], split, a.stages_per_rank,
                      a.pp_schedule in s.V_SHAPED)
    corpus = s.load_corpus(a.data)
    routing = even_routing(fake) if moe and even else contextlib.nullcontext()
    with simulated(args) if fake else contextlib.nullcontext(), routing:
        cfg, model, optimizer = s.load_train_objs(a, corpus, device, grid, cp, *ep, pipe)
        if fake and isinstance(model, DDP):
            model.register_comm_hook(grid.group("dp_cp"), all_reduce_hook)
            model.reducer = KeptBuckets(model.reducer)
        trainer = s.Trainer(model, optimizer, corpus, cfg, a, grid, cp, *ep, pipe, device, None)
        built = time.perf_counter()
        for _ in range(WARM_UP[a.parallel]):
            trainer._run_step()
            trainer.steps += 1
        # (stage 14 under --ep with FSDP2: a rank's own experts, which FSDP2 leaves alone, as the stage picks them)
        left_out = [p for part in getattr(model, "parts", [model]) for p in experts_of(s)(part).values()] \
            if moe and a.ep > 1 and a.parallel == "fsdp" else []
        state: dict[str, int] = {}
        counted = optimizer.register_step_post_hook(lambda opt, *_: state.update(state_of(model, opt)))
        collectives, tracker = Collectives(grid), memory_tracker(model, optimizer, left_out)
        flops = FlopCounterMode(display=False, custom_mapping=cpu_attention_flops())
        # Its ModuleTracker hooks every module's outputs and keeps the hooks until it exits: under --ac, what a block
        # recomputes in backward would stay held to the end of the step (that graph is never run back), and the
        # memory tracker would count it. Only the total is read: the FLOPs counted under "Global" alone.
        flops.mod_tracker = contextlib.nullcontext()
        flops.mod_tracker.parents = {"Global"}
        with flops, tracker, collectives, local_ops_only():
            trainer._run_step()  # the stage's own step: its micro-batches, clipping, AdamW's step, zero_grad
            held = tracker.sample()  # what the step leaves held beyond the state (the pipeline's last outputs)
        counted.remove()
    end = time.perf_counter()
    sent = collectives.table()
    by_dimension: dict[str, float] = {}
    for row in sent:
        by_dimension[row["dimension"]] = by_dimension.get(row["dimension"], 0.0) + row["sent_bytes"]
    total, active = s.parameters(cfg) if moe else (s.parameters(cfg),) * 2
    # The most micro-batches' activations of a stage a rank holds at once, as torch's own table of the schedule says
    most_held = None if pipe.size == 1 else pipeline(args.stage_name).held_at_most(trainer.schedule, a.accumulate,
                                                                                   pipe.size)
    return {
        "stage": args.stage_name, "rank": args.rank, "world": args.world, "coords": grid.coords, "sizes": grid.sizes,
        "ep": a.ep if moe else None, "model": cfg._asdict(), "parameters": total, "active_parameters": active,
        "parallel": a.parallel, "sp": a.sp, "replicate": a.replicate,
        "pp_schedule": a.pp_schedule if pipe.size > 1 else None, "stages_per_rank": a.stages_per_rank,
        "stages": pipe.stages, "held_micro_batches": most_held,
        "micro_batch": a.batch_size, "accumulate": a.accumulate, "tokens_per_step": trainer.global_batch * cfg.context,
        "state_bytes": {**state, "total": sum(state.values())},
        "activation_peak_bytes": tracker.transient_peak, "held_after_step_bytes": held,
        "at_activation_peak": tracker.at_peak, "memory_tracker": type(tracker).__mro__[1].__name__,
        "sent": sent, "sent_bytes_by_dimension": by_dimension, "flops": flops.get_total_flops(),
        "assumed": shims_used(a, moe) if fake else [ASSUMED["even_load"]] if moe and even else [],
        "seconds": {"build": built - start, "steps": end - built},
    }


def show(result: dict) -> None:
    """The result as tables, on stdout."""
    MiB = 2**20
    m, state = result["model"], result["state_bytes"]
    print(f"[{result['stage']}] rank {result['rank']} of {result['world']:,} (" + ", ".join(
        f"{d} {c} of {result['sizes'][d]}" for d, c in result["coords"].items()) + f") | {result['parallel']}"
          + (" | --sp" if result["sp"] else ""))
    if result["pp_schedule"] is not None:  # the most micro-batches' activations a rank holds: torch's table says
        print(f"pipeline: {result['pp_schedule']}, {result['sizes']['pp'] * result['stages_per_rank']} stages, this "
              f"rank's {result['stages']} | at most {result['held_micro_batches']} micro-batches' activations of a "
              f"stage held at once (pipeline.py held_at_most)")
    print(f"model: {m['layers']} blocks, width {m['width']}, {m['heads']} heads, context {m['context']}, vocabulary "
          f"{m['vocab']:,}: {result['parameters']:,} parameters | micro-batch {result['micro_batch']} x "
          f"{result['accumulate']} per dp rank, {result['tokens_per_step']:,} tokens a step")
    if result["ep"] is not None:
        print(f"experts: {m['experts']} a block, each token to {m['top_k']} ({result['active_parameters']:,} "
              f"parameters used by a token) | ep {result['ep']}: {m['experts'] // result['ep']} a rank")
    print_table([["held by this rank", "MiB"], *[[k, f"{v / MiB:,.2f}"] for k, v in state.items()],
                 [f"activation peak ({result['memory_tracker']})", f"{result['activation_peak_bytes'] / MiB:,.2f}"]]
                + ([["still held after the step", f"{result['held_after_step_bytes'] / MiB:,.2f}"]]
                   if result["held_after_step_bytes"] else []))
    print()
    print_table([["collective", "dimension", "calls", "tensor MiB", "sent MiB"], *[
        [r["kind"], r["dimension"], f"{r['calls']:,}", *(f"{r[k] / MiB:,.3f}" for k in ("tensor_bytes", "sent_bytes"))]
        for r in result["sent"]]])
    print("sent per dimension: " + " | ".join(f"{d} {b / MiB:,.1f} MiB"
                                               for d, b in result["sent_bytes_by_dimension"].items()))
    print(f"FLOPs of the step: {result['flops']:.4g} | simulated in {sum(result['seconds'].values()):.1f}s")
    for line in result["assumed"]:
        print(f"assumed: {line}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    show(result)
    if args.out is not None:
        (args.out / "simulate.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
