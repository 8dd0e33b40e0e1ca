"""Stage 14: a mixture of experts, its experts over ep processes, on top of stage 13's dp x pp x cp x tp: all five.

Each block's MLP becomes E experts and a router that sends each token to k of them (experts.py); under --ep N the
experts are shared out over N of the dp x cp processes, and the tokens travel to their experts and back by
all-to-all. A balancing loss (against idle experts) joins the loss; the experts' gradients are averaged by hand.

    torchrun --standalone --nproc_per_node=4 14_experts/train.py --ep 4 --max-steps 20    # 4 experts, one a rank
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

if torch.__version__ < (2, 7):  # fully_shard (FSDP2) is public from torch 2.6, its ignored_params from 2.7
    print(f"14_experts/train.py: error: needs torch 2.7 or newer, not {torch.__version__}", file=sys.stderr)
    sys.exit(2)

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.nn.parallel import DistributedDataParallel as DDP

# The files beside this one (`python train.py` puts its folder first on sys.path). checks.py refuses bad flags and
# checkpoints in one line and names a checkpoint's files; reports.py measures (memory, MFU) and writes --out. Each
# `checks.` and `reports.` below is theirs, not the lesson's.
import checks
import reports
from context_parallel import ContextParallel
from dataset import DATA, Corpus, baselines, batch_of_windows, load_corpus, to_device
from evaluate import clock, held_out_loss, sample
from experts import ExpertLog, ExpertParallel, add_expert_flags, describe_experts
from grid import Grid, ddp_setup
from model import DTYPES, GPT, Config, parameters
from parallelize import clip_gradients, full_model, parallelize, replica_max_abs_diff, sum_over_tp
from pipeline import SCHEDULES, V_SHAPED, Pipeline, Stages, next_char_loss, pipeline_stage

STAGE = "14_experts"


# ─── Training ──────────────────────────────────────────────────────────────────────────────────────────────────────

def load_train_objs(args: argparse.Namespace, corpus: Corpus, device: torch.device, grid: Grid,
                    cp: ContextParallel, ep: ExpertParallel, pipe: Pipeline):
    cfg = Config(len(corpus.chars), args.context, args.layers, args.heads, args.width, args.experts, args.top_k)
    # --pp: every rank draws the whole model's weights, as one process does, and keeps a part for each of its stages.
    parts = []
    for index in pipe.stages:
        torch.manual_seed(args.seed)  # (in float32, then cast)
        part = pipeline_stage(GPT(cfg), pipe.count, index).to(device, DTYPES[args.dtype])
        parts.append(parallelize(part, grid, cp, ep, args))
    model = parts[0] if len(parts) == 1 else Stages(parts)
    # AdamW, as transformers are trained; created after parallelize, so that it holds this rank's pieces. Weight
    # decay pulls the matrices towards zero; not the biases and norms (a scale and a shift, nothing to regularise),
    # nor the embeddings (a character's row only learns when it appears: decay would erase the rare ones). The
    # experts' matrices are stacked [E, ...]: matrices too.
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    rest = [p for p in model.parameters() if p.dim() < 2 or id(p) in embeddings]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.99))
    return cfg, model, optimizer


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """The rate of step `step` (from 0): up linearly for --warmup-steps (AdamW's first steps divide by moments
    estimated from a handful of gradients: full-size steps then can throw the weights off), then down along half a
    cosine to a tenth of --lr at --decay-steps (large steps while far from a minimum, small ones to settle into it),
    and a tenth after. A function of the step alone: a resumed run needs no scheduler state to carry on exactly."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    done = min(1.0, (step - args.warmup_steps) / max(1, args.decay_steps - args.warmup_steps))
    return args.lr / 10 + (args.lr - args.lr / 10) * 0.5 * (1 + math.cos(math.pi * done))


# AdamW's state and settings saved under each parameter's name, not per param group: a checkpoint then names every
# value alike whichever parameters a rank's groups hold (stage 13's pipeline stages hold some blocks only).
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Trainer:
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, corpus: Corpus, cfg: Config,
                 args: argparse.Namespace, grid: Grid, cp: ContextParallel, ep: ExpertParallel,
                 pipe: Pipeline, device: torch.device, snapshot: dict | None) -> None:
        self.model, self.optimizer, self.corpus, self.cfg, self.args = model, optimizer, corpus, cfg, args
        self.grid, self.cp, self.ep, self.pipe, self.device = grid, cp, ep, pipe, device
        self.expert_log = ExpertLog(model, cfg, device, snapshot)  # what the experts did, per step
        self.schedule = pipe.schedule(model, device, args.pp_schedule, args.accumulate)  # --pp: torch's, else None
        # The dp x cp ranks of a tp column: dp rows of cp ranks, each row the same windows, each rank its share.
        self.dp_rank, self.dp = grid.coords["dp"], grid.sizes["dp"]
        self.master_process = dist.get_rank() == 0  # rank 0 alone logs and writes the progress file
        self.global_batch = self.dp * args.accumulate * args.batch_size  # windows per optimizer step
        self.steps, self.losses, self.curve = 0, [], []  # per step; per log line [step, train, held-out, tokens/s]
        self.grad_norms: list[float] = []  # per step, before clipping (the global batch's gradient: every rank's)
        self.pending: list[torch.Tensor] = []  # [loss, gradient norm] of each step not yet in the lists above
        self.train_seconds = 0.0  # in this run's training steps (not the evaluations, not the checkpoints)
        self.trajectory: list[dict] = []  # --out: the state at the start, at each checkpoint and at the end
        # A fixed handful of held-out windows, scored every --eval-every steps for the curve (the same on every rank).
        starts = torch.linspace(0, len(corpus.held_out) - cfg.context - 1, 16).long()[:, None]
        positions = starts + torch.arange(cfg.context)
        self.curve_windows = (corpus.held_out[positions], corpus.held_out[positions + 1])
        if snapshot is not None:
            self._load_snapshot(snapshot)
        self.resumed_at = self.steps

    def _load_snapshot(self, snapshot: dict) -> None:
        # Stage 08's: dcp.load fills this run's pieces (on any number of ranks, any layout) from whichever files hold
        # them. No random state to restore: the data of step s depends on --seed and s alone.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FLAT)  # (AdamW's zeros)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=snapshot["path"])
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=FLAT)
        self.steps, self.losses, self.curve = snapshot["steps"], list(snapshot["losses"]), list(snapshot["curve"])
        self.grad_norms = list(snapshot["grad_norms"])

    def _save_snapshot(self) -> None:
        # Every rank writes its own pieces (dcp.save), rank 0 the metadata; then an atomic rename, as in stage 08.
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=FLAT)
        final = self.args.snapshot / f"step_{self.steps:06d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
        except (Exception, dcp.CheckpointException) as e:  # raised on every rank if any rank failed to write
            if self.master_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise checks.failed_save(e, tmp, self.args.snapshot) from None
        if self.master_process:
            progress = {"steps": self.steps, "losses": self.losses, "curve": self.curve, "seed": self.args.seed,
                        "grad_norms": self.grad_norms, "schedule": checks.schedule(self.args),
                        "global_batch": self.global_batch, "dtype": self.args.dtype, "model": self.cfg._asdict(),
                        "world_size": dist.get_world_size(), "experts": self.expert_log.history()}
            (tmp / checks.PROGRESS).write_text(json.dumps(progress) + "\n")
            os.replace(tmp, final)  # a directory named step_N is complete; only then is the previous one removed
            for old in checks.checkpoints(self.args.snapshot)[:-1]:
                shutil.rmtree(old)

    def syncing(self, last: bool):
        """--accumulate: average the gradients over the dp ranks once per step, in the last micro-batch's backward."""
        if isinstance(self.model, DDP):
            return nullcontext() if last else self.model.no_sync()  # inside no_sync, backward only adds to .grad
        self.model.set_requires_gradient_sync(last)  # FSDP2: no reduce-scatter until the last micro-batch
        return nullcontext()

    def _run_step(self) -> torch.Tensor:
        x, y = batch_of_windows(self.corpus.train, self.cfg.context, self.global_batch, self.args.seed, self.steps)
        # This dp rank's rows: r, r + dp, ... (the tp ranks of a row take the same ones: they compute one forward
        # together), cut into --accumulate micro-batches. W ranks of batch b see the windows one process of W*b sees.
        # Of each window, this cp rank's share of the positions (its cp group's ranks take the rest). The stages of a
        # pipeline (--pp) take the same rows: each computes its blocks' part of them.
        rows = slice(self.dp_rank, None, self.dp)
        x, y = (to_device(self.cp.share(t[rows]), self.device) for t in (x, y))  # the step's one copy from the host
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        # --amp bf16: the forward's matmuls in bfloat16, the weights and the loss in float32 (recipes/).
        amp = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.args.amp == "bf16")
        # --sp: the logits are split by vocabulary over tp (a DTensor); loss_parallel's cross_entropy takes each
        # token's max and sum of exponentials over the vocabulary by all-reducing [tokens] numbers, not [tokens, vocab];
        # its backward must run inside the context too. Under --pp both run inside schedule.step: torch's schedule
        # calls the loss (_maybe_compute_loss) on the last stage's output, then its backward (backward_one_chunk).
        parallel_loss = loss_parallel if self.args.sp else nullcontext
        if self.schedule is not None:
            with amp, parallel_loss():  # sync points: the stages' sends and receives; FSDP2's reduce-scatter at the end
                if (losses := self.pipe.step(self.schedule, x, y)) is not None:  # the last stage's
                    total += losses
        else:
            micro = list(zip(x.split(self.args.batch_size), y.split(self.args.batch_size), strict=True))
            for i, (xb, yb) in enumerate(micro):
                with self.syncing(last=i == len(micro) - 1), parallel_loss():
                    with amp:
                        # The mean over this rank's tokens: each cp rank holds as many, so the cp ranks' mean loss is
                        # the windows' loss, and their averaged gradient (DDP's, FSDP2's) the windows' gradient.
                        loss = next_char_loss(self.model(xb), yb)
                    # Sync point (the last micro-batch): DDP all-reduces the gradients, FSDP2 reduce-scatters them.
                    (loss / len(micro)).backward()  # (and the balancing loss's gradient: experts.py)
                total += (loss.to_local() if isinstance(loss, DTensor) else loss).detach()  # (--sp: Replicate)
        if self.args.sp:  # each tp rank routed its own tokens: the routers' and experts' gradients are parts
            sum_over_tp(self.model, self.grid.group("tp"))
        if self.ep.size > 1:  # the expert weights: DDP left them alone (parallelize.py)
            self.ep.average_gradients(self.model, self.dp * self.cp.size)
        self.expert_log.step_done(self.args.accumulate)
        norm = clip_gradients(self.model, self.args.clip, self.pipe)  # a collective under FSDP2, tp and pp
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(self.steps, self.args)
        self.optimizer.step()  # on this rank's pieces: no communication
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack([total / self.args.accumulate, norm.to(total.dtype)])  # the step's loss, gradient norm

    @torch.no_grad()
    def estimate_held_out(self) -> float:
        """The loss on the fixed held-out windows (16 x --context characters): a point of the curve."""
        self.model.eval()
        x, y = (self.cp.share(t).to(self.device) for t in self.curve_windows)  # every cp group: the same windows
        logits = self.pipe.forward(self.model, x)  # None but on the last stage
        loss = torch.zeros((), dtype=torch.float64, device=self.device) if logits is None else \
            F.cross_entropy(logits.flatten(0, 1).double(), y.flatten(), reduction="sum")
        if self.cp.size > 1:  # each cp rank scored its share of the positions
            dist.all_reduce(loss, group=self.cp.group)
        self.pipe.from_last(loss)
        loss = loss.item() / y.numel() / self.cp.size
        if not isinstance(self.model, DDP):  # FSDP2 keeps the root unit gathered after a forward, for the backward
            self.model.reshard()  # that follows in training; none follows here
        self.model.train()
        return loss

    def train(self, max_steps: int) -> None:
        self.record()
        if self.steps >= max_steps and self.master_process:  # a finished checkpoint: say so, do not look stuck
            print(f"nothing to train: the checkpoint is at step {self.steps} and --max-steps is {max_steps}; "
                  f"pass --max-steps {self.steps + 100} --decay-steps {self.args.decay_steps} to train 100 more at "
                  f"the schedule's last rate, or another --snapshot to start afresh")
        since, seconds, tokens_per_step = 0, 0.0, self.global_batch * self.cfg.context
        while self.steps < max_steps:
            start = clock(self.device)  # (a GPU runs ahead of Python: the clock waits for its queued work)
            self.pending.append(self._run_step())  # tensors: reading them now would wait for the GPU every step
            self.steps += 1
            since += 1
            seconds += clock(self.device) - start
            log = self.steps % self.args.eval_every == 0 or self.steps == max_steps
            save = self.args.snapshot is not None and self.steps % self.args.save_every == 0
            if log or save:  # the checkpoint keeps every step's numbers: settle them first
                self._settle()
            if log:
                speed = since * tokens_per_step / seconds
                self.curve.append([self.steps, sum(self.losses[-since:]) / since, self.estimate_held_out(), speed])
                if self.master_process:
                    print(f"step {self.steps:>5}/{max_steps} | train loss {self.curve[-1][1]:.4f} | held-out "
                          f"{self.curve[-1][2]:.4f} | lr {learning_rate(self.steps - 1, self.args):.2e} | grad norm "
                          f"{self.grad_norms[-1]:.2f} | balancing loss {self.expert_log.aux_losses[-1]:.3f}"
                          + (f" | dropped {self.expert_log.dropped[-1]:.1%}" if self.args.capacity_factor else "")
                          + f" | {speed:,.0f} tokens/s")
                self.train_seconds += seconds
                since, seconds = 0, 0.0
            if save:
                self._save_snapshot()
                dist.barrier()  # sync point: past it, the checkpoint of this step is complete on every rank
                self.record()
        if self.trajectory and self.trajectory[-1]["step"] != self.steps:
            self.record()

    def _settle(self) -> None:
        """The steps' losses and gradient norms since the last call, from tensors to the lists: the loss averaged
        over the dp x cp ranks is the global batch's (the tp ranks of a row hold the same), one all_reduce for all."""
        losses, norms = torch.stack(self.pending).T.contiguous()  # (a collective needs contiguous memory)
        dist.all_reduce(losses, group=self.grid.group("dp_cp"))
        self.pipe.from_last(losses)  # --pp: the last stage computed them
        self.losses += (losses / (self.dp * self.cp.size)).tolist()
        self.grad_norms += norms.tolist()  # the same on every rank: the whole gradient's
        self.pending = []
        self.expert_log.settle(self.grid, self.pipe, self.args, self.global_batch * self.cfg.context)  # (--sp: tp too)

    def record(self) -> None:
        """--out: keep the whole state (gathered: every rank calls this), for the tests to compare runs step by step."""
        if self.args.out is not None:
            self.trajectory.append(reports.state_at(self.model, self.optimizer, self.steps, self.pipe))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # ArgumentParser and positive() are in checks.py: a bad value is one line of error and exit 2.
    p = checks.ArgumentParser(prog=f"{STAGE}/train.py", description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=checks.positive(int), default=800,
                   help="optimizer steps in all (the length of training: a text has no epochs here; a resumed "
                        "run goes on to it)")
    p.add_argument("--batch-size", type=checks.positive(int), default=16, help="windows per micro-batch per dp rank")
    p.add_argument("--lr", type=checks.positive(float), default=6e-3,
                   help="AdamW's top learning rate (see --warmup-steps)")
    p.add_argument("--warmup-steps", type=checks.positive(int),
                   help="steps of the rate's linear rise to --lr (default: a twentieth of --decay-steps)")
    p.add_argument("--decay-steps", type=checks.positive(int),
                   help="the step where the rate's cosine decay reaches --lr / 10 (default: --max-steps)")
    p.add_argument("--clip", type=float, default=1.0, help="the largest gradient norm a step takes (0: no clipping)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="float64 rounds 5e8 times finer than float32: for checking results, not for speed")
    p.add_argument("--out", type=Path, help="write summary.json, model.pt and trajectory.pt here")
    p.add_argument("--timeout", type=checks.positive(float), default=60.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    p.add_argument("--snapshot", type=Path,
                   help="checkpoint directory: resumed from if it holds one, written during training")
    p.add_argument("--save-every", type=checks.positive(int), default=100, help="steps between checkpoints")
    p.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp",
                   help="over the dp ranks: a replica each (DDP) or a shard each (FSDP2, every block a unit)")
    p.add_argument("--replicate", type=checks.positive(int), default=1, help="HSDP: R replicas of FSDP2's shards")
    p.add_argument("--tp", type=checks.positive(int), default=1,
                   help="tensor-parallel degree: processes that split every block (with --parallel fsdp)")
    p.add_argument("--sp", action="store_true",
                   help="sequence parallelism (with --tp): norms, residual stream and loss split by sequence over tp")
    p.add_argument("--cp", type=checks.positive(int), default=1,
                   help="context-parallel degree: processes that split every sequence (--context must be a multiple "
                        "of 2 x cp)")
    p.add_argument("--cp-impl", choices=["ring", "allgather"], default="ring",
                   help="how a cp rank's queries reach the others' keys and values: passed round a ring, one block "
                        "a hop (memory of a few blocks), or all gathered at once (memory of the whole sequence)")
    p.add_argument("--no-zigzag", action="store_true",
                   help="give each cp rank one contiguous piece of the sequence (the later pieces then do more of "
                        "the causal attention's work) instead of chunks r and 2cp-1-r")
    p.add_argument("--pp", type=checks.positive(int), default=1, help="pipeline-parallel degree: processes that "
                   "split the blocks into stages (--layers at least pp; --accumulate micro-batches go through them)")
    p.add_argument("--pp-schedule", choices=list(SCHEDULES), default="1f1b",
                   help="GPipe or 1F1B (stage 10); with --stages-per-rank 2 or more, stage 13's interleaved1f1b, "
                        "interleavedzb, zbv or dualpipev")
    p.add_argument("--stages-per-rank", type=checks.positive(int), default=1,
                   help="pipeline stages each pp rank holds (virtual stages): the blocks are cut into pp x this")
    add_expert_flags(p, checks.positive)  # --experts --top-k --ep --capacity-factor --aux-weight --balance
    p.add_argument("--accumulate", type=checks.positive(int), default=1,
                   help="micro-batches of --batch-size per step (under --pp, the pipeline's micro-batches)")
    p.add_argument("--amp", choices=["bf16"], help="autocast the forward to bfloat16 (the weights stay float32)")
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none",
                   help="activation checkpointing: recompute every block's forward in backward, or all but its matmuls")
    p.add_argument("--data", type=Path, default=DATA, help="a UTF-8 text to learn (default: tiny Shakespeare)")
    p.add_argument("--context", type=checks.positive(int), default=64, help="characters the model reads at once")
    p.add_argument("--layers", type=checks.positive(int), default=4, help="transformer blocks")
    p.add_argument("--heads", type=checks.positive(int), default=4, help="attention heads per block")
    p.add_argument("--width", type=checks.positive(int), default=128, help="size of the residual stream")
    p.add_argument("--eval-every", type=checks.positive(int), default=50,
                   help="steps between log lines (and curve points)")
    p.add_argument("--sample", type=int, default=500, help="characters to generate at the end (0: none)")
    args = p.parse_args(argv)
    # The schedule's defaults follow the run's length: decay over the whole run, warm up over its first twentieth.
    args.decay_steps = args.decay_steps or args.max_steps
    args.warmup_steps = args.warmup_steps or max(1, args.decay_steps // 20)
    return checks.check_gpt_args(p, checks.check_checkpoint_arg(p, checks.check_args(p, args)))


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, grid: Grid,
          cp: ContextParallel, ep: ExpertParallel, pipe: Pipeline, snapshot: dict | None) -> None:
    master_process = rank == 0
    corpus = load_corpus(args.data)
    cfg, model, optimizer = load_train_objs(args, corpus, device, grid, cp, ep, pipe)
    trainer = Trainer(model, optimizer, corpus, cfg, args, grid, cp, ep, pipe, device, snapshot)
    dp = trainer.dp
    floor = baselines(corpus)
    total, active = parameters(cfg)
    if master_process:
        fallback = " (no GPU visible: using the CPU)" if args.device == "auto" and device.type == "cpu" else ""
        options = ", ".join(o for o in [f"--accumulate {args.accumulate}" if args.accumulate > 1 else "",
                                        f"--amp {args.amp}" if args.amp else "", "--compile" if args.compile else "",
                                        f"--ac {args.ac}" if args.ac != "none" else "", "--sp" if args.sp else ""] if o)
        how = f" ({args.cp_impl}{', zigzag' if cp.zigzag else ', contiguous'})" if cp.size > 1 else ""
        virtual = f", stages {pipe.count}: this rank's {pipe.stages}" if pipe.count > pipe.size else ""
        stages = f"pp {pipe.size} ({args.pp_schedule}, {args.accumulate} micro-batch" \
            f"{'es' if args.accumulate > 1 else ''}{virtual}) x " if pipe.size > 1 else ""
        split = f" (replicate {args.replicate} x shard {dp // args.replicate})" if args.replicate > 1 else ""
        print(f"[{STAGE}] world size {world_size} = dp {dp}{split} x {stages}cp {cp.size}{how} x tp {args.tp}"
              + (f", ep {ep.size} of the dp x cp" if ep.size > 1 else "") + f" | {args.parallel} | backend "
              f"{dist.get_backend()} | device {device.type}{fallback} | {args.dtype}"
              + (f" | {options}" if options else ""))
        if world_size > 1:
            print(grid.describe())  # which ranks each group holds (grid.py)
        if pipe.size > 1:  # the stage-sized activations a rank keeps for backward at most (reports.py)
            print(reports.activations_held(trainer.schedule, args, pipe))
        print(f"data: {args.data.name}, {len(corpus.train) + len(corpus.held_out):,} characters ({len(corpus.chars)} "
              f"distinct): {len(corpus.train):,} to train on, the last {len(corpus.held_out):,} held out")
        print(f"model: {cfg.layers} blocks, {cfg.heads} heads, width {cfg.width}, context {cfg.context}: "
              f"{total:,} parameters, {active:,} of them used by a token | batch {args.batch_size} x "
              f"{args.accumulate} windows per dp rank, {trainer.global_batch} global = "
              f"{trainer.global_batch * cfg.context:,} tokens a step | {args.max_steps} steps"
              + (f" | {cfg.context // cp.size} positions of each window per cp rank" if cp.size > 1 else ""))
        print(describe_experts(args, cfg, ep, split=dp * cp.size > 1 or args.sp))
        print(f"AdamW: learning rate up to {args.lr:g} in {args.warmup_steps} step"
              f"{'s' if args.warmup_steps > 1 else ''}, then a cosine down to "
              f"{args.lr / 10:g} at step {args.decay_steps} | weight decay 0.1 on the matrices | "
              + (f"gradient norm clipped to {args.clip:g}" if args.clip else "no clipping"))
        print("baselines, held-out loss in nats per character: " + " | ".join(f"{k} {v:.3f}" for k, v in floor.items()))
        if trainer.steps:
            ranks = snapshot["world_size"]
            print(f"resumed from {snapshot['path']} (written by {ranks} rank{'s' if ranks > 1 else ''}) at step "
                  f"{trainer.steps}")
    start = clock(device)
    trainer.train(args.max_steps)
    seconds = clock(device) - start

    loss_sum, count = held_out_loss(model, corpus.held_out, cfg.context, grid, cp, pipe, device)
    # DDP's replicas must agree; FSDP has none to compare (each rank holds other shards): no gather of the model.
    max_diff = replica_max_abs_diff(model, grid, ep) if args.parallel == "ddp" else None
    memory = reports.peak_memory(model, optimizer, device)  # every rank's, gathered (reports.py)
    peak = reports.machine_peak(device, args)  # the FLOP/s the MFU is of: measured on a CPU (reports.py)
    text = sample(model, corpus.chars, args.sample, cfg.context, args.seed, cp, pipe, device) if args.sample else ""
    if master_process:
        loss = loss_sum / count
        print(f"held-out loss {loss:.4f} nats/char over {count:,} characters | bigram {floor['bigram']:.3f}, "
              f"unigram {floor['unigram']:.3f}, uniform {floor['uniform']:.3f}")
        speed = reports.report_speed(trainer, cfg, device, peak)
        print(f"peak memory per rank ({memory['how']}): " + " | ".join(
            f"rank {r} {m / 2**20:,.0f} MiB" for r, m in enumerate(memory["peak"])) + " | model state per rank "
            "(weights, gradients, AdamW's moments): " + " | ".join(f"{b / 2**20:.2f} MiB" for b in memory["state"]))
        if text:
            print(f"sample ({args.sample} characters, temperature 0.8):\n{text}")
    if args.out is not None:  # model.pt: the whole model, gathered once at the end, onto rank 0's CPU only
        full = full_model(model, cfg, pipe)
        if master_process:
            reports.write_run(args, trainer, full, floor, (loss, count), seconds, speed, memory, max_diff, text)
    if max_diff:  # every rank of a dp group computed the same max_diff (all_gather), so they stop here together
        raise RuntimeError(f"DDP's replicas diverged (max |difference| {max_diff:.3g})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun?
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())  # auto: CUDA if visible
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    try:  # check the checkpoint before joining the group: a bad one is one line and exit 2 on every rank
        dp = world_size // (args.pp * args.tp * args.cp)
        snapshot = None if args.snapshot is None else checks.load_snapshot(args, dp)
    except checks.SnapshotError as e:
        print(f"{STAGE}/train.py: error: argument --snapshot: {e}", file=sys.stderr)
        sys.exit(2)
    if rank == 0 and args.snapshot is not None:  # a save cut short by a crash: never loaded, so never needed
        for stale in args.snapshot.glob("step_*.tmp"):  # (no other rank writes before the group is joined)
            shutil.rmtree(stale)
    ddp_setup(ddp, device, args.timeout)
    try:
        # Every process group, from one grid (grid.py): a stage of the pipeline is a dp x cp x tp block of consecutive
        # ranks, tp innermost; dp = R x S (HSDP); the ep groups are runs of its dp x cp ranks.
        grid = Grid({"pp": args.pp, "replicate": args.replicate, "dp": dp, "cp": args.cp, "tp": args.tp}, args.ep,
                    device, args.timeout)
        # --sp: every cp share split again over tp (evaluate pads it to a multiple), as is what the stages pass on
        split = args.tp if args.sp else 1
        cp = ContextParallel(grid.group("cp"), args.cp_impl, zigzag=not args.no_zigzag, split=split)
        pipe = Pipeline(grid.group("pp"), args.width, DTYPES[args.dtype], split, args.stages_per_rank,
                        args.pp_schedule in V_SHAPED)
        ep = ExpertParallel(grid.group("ep"), grid.group("ep_replicas"), device)
        train(rank, world_size, device, args, grid, cp, ep, pipe, snapshot)
    except RuntimeError as e:  # gloo raises a peer's death or stall here, as a timeout or a closed connection
        if (hint := checks.explain_peer_failure(e, args.timeout)) is not None:
            print(f"[{STAGE}] rank {rank}: {hint}", file=sys.stderr)
        raise
    finally:
        # train() has returned, its model gone: destroying a group a DDP model still holds can hang gloo (pytorch#75097)
        dist.destroy_process_group()
    checks.exit_without_teardown()  # skips Python's teardown, which a gloo thread can crash (checks.py)


if __name__ == "__main__":
    main()
