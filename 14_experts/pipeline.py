"""Pipeline parallelism (stage 10's) on the GPT: the blocks cut into stages, one after another, each stage's ranks
holding its part of the model; the micro-batches go through them under torch's schedule in training, and the whole
batch in evaluation and sampling."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from model import GPT

# --pp-schedule: stage 10's two, one stage a rank; then the four that hold --stages-per-rank v stages a rank (virtual
# stages): interleaved 1F1B (Megatron's, Llama 3's) and its zero-bubble form place them round-robin; ZB-V and
# DualPipeV (DeepSeek-V3's DualPipe, folded) in a V, two a rank.
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
             "interleavedzb": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
             "dualpipev": ScheduleDualPipeV}
MULTI = {"interleaved1f1b", "interleavedzb", "zbv", "dualpipev"}  # v stages a rank (v >= 2)
V_SHAPED = {"zbv", "dualpipev"}  # exactly 2 a rank, in the V
SPLIT_BACKWARD = {"interleavedzb", "zbv", "dualpipev"}  # backward as two: input gradient (B), weight gradient (W)


# Stage 10's pipelining on the GPT: the pp ranks of a pipeline each hold a run of consecutive blocks, the first also
# the embeddings, the last also the final norm and the head (so the loss is computed there). A step's rows are cut
# into --accumulate micro-batches that follow one another through the stages, so that the stages work at once, each
# on another micro-batch; torch's schedule sends the activations forward and their gradients back (GPipe: every
# forward, then every backward; 1F1B: a backward as soon as one can start, so a stage holds the activations of at most
# pp micro-batches). The pp dimension is the outermost of the grid: a stage's ranks are consecutive (one node), and
# the pipeline's sends, the least traffic of all, are what crosses nodes.

def stage_blocks(layers: int, stages: int, index: int) -> range:
    """The blocks stage `index` of `stages` holds: consecutive, as many on each stage as can be (the first ones one
    more, when the stages do not divide the blocks)."""
    size, extra = divmod(layers, stages)
    start = index * size + min(index, extra)
    return range(start, start + size + (index < extra))


def stages_of(rank: int, pp: int, v: int, v_shaped: bool) -> list[int]:
    """The stages rank `rank` of `pp` holds, v of them: round-robin (r, r + pp, ...), or the V (r and 2pp - 1 - r:
    down the ranks and back up, so that rank 0 holds the first stage and the last, and the loss is computed where
    the backward starts)."""
    return [rank, 2 * pp - 1 - rank] if v_shaped else [rank + i * pp for i in range(v)]


def pipeline_stage(model: GPT, stages: int, index: int) -> GPT:
    """The model cut down to stage `index` of `stages`: the other stages' parts removed (None: forward skips them)."""
    kept = stage_blocks(len(model.blocks), stages, index)
    for i in [i for i in model.blocks if int(i) not in kept]:
        del model.blocks[i]
    if index > 0:
        model.tokens = model.positions = None
    if index < stages - 1:
        model.norm = model.head = None
    return model


class Stages(nn.Module):
    """--stages-per-rank v > 1: this rank's v stages, each its own model (cut by pipeline_stage, wrapped by FSDP2:
    torch's schedule runs each as a stage), seen as one model for the rest of the code: the optimizer, the gradient
    norm, the checkpoints and the trajectory see their parts under the whole model's names (blocks.5, head, ...).
    The stages themselves are not registered as parts (their names would prefix every weight's)."""

    def __init__(self, parts: list[GPT]) -> None:
        super().__init__()
        object.__setattr__(self, "parts", parts)
        for name in ("tokens", "positions", "norm", "head"):
            setattr(self, name, next((getattr(p, name) for p in parts if getattr(p, name) is not None), None))
        self.blocks = nn.ModuleDict(sorted(((k, b) for p in parts for k, b in p.blocks.items()), key=lambda kb:
                                           int(kb[0])))

    def train(self, mode: bool = True) -> Stages:
        for part in self.parts:
            part.train(mode)
        return super().train(mode)

    def reshard(self) -> None:
        """After a forward without a backward (evaluation): every unit's weights back to shards, the blocks' too (the
        zero-bubble schedules keep them gathered after a forward: parallelize)."""
        for part in self.parts:
            for unit in part.modules():
                if isinstance(unit, FSDPModule):
                    unit.reshard()


def held_at_most(schedule, microbatches: int, pp: int) -> int:
    """The most micro-batches' activations of one stage a rank holds at once, over the ranks: forwards run whose
    backward (under the zero-bubble schedules, whose weight gradient) has not. Read from torch's own table of each
    rank's actions where it has one (the multi-stage schedules), else from the schedule's rule."""
    order = getattr(schedule, "pipeline_order", None)
    if order is None:  # GPipe: every forward before the backwards; 1F1B: rank 0 runs pp forwards before its first
        return microbatches if isinstance(schedule, ScheduleGPipe) else min(microbatches, pp)
    most = 0
    for actions in order.values():
        held = 0
        for action in filter(None, actions):
            for a in action.sub_actions or [action]:  # (DualPipeV overlaps a forward and a backward: both count)
                held += (a.computation_type == "F") - (a.computation_type in ("B", "W"))
                most = max(most, held)
    return most


def next_char_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss over the positions of logits [b, t, vocab], given the next characters y [b, t]."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Pipeline:
    """This rank's place in its pipeline. pp = 1 (no group) holds the whole model: the code then runs as without."""

    def __init__(self, group: dist.ProcessGroup | None, width: int, dtype: torch.dtype, split: int = 1, v: int = 1,
                 v_shaped: bool = False) -> None:
        self.group, self.width, self.dtype = group, width, dtype  # what passes between stages: [b, t, width], dtype
        # --sp: a rank passes on its part of the residual stream only, [b, t / tp, width] (split = tp): the stream is
        # split by sequence between the blocks, and a stage's edge is between two blocks (torch's schedule learns
        # the shape from the first step's forward; `forward` below is told it).
        self.split = split
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        # --stages-per-rank v: pp x v stages, this rank's at `stages` (stages_of); the owner of each
        self.count = self.size * v
        self.stages = stages_of(self.rank, self.size, v, v_shaped)
        self.owner = {s: r for r in range(self.size) for s in stages_of(r, self.size, v, v_shaped)}
        self.first, self.last = 0 in self.stages, self.count - 1 in self.stages  # given the inputs; the targets
        self.last_rank = self.owner[self.count - 1]  # where the loss and the logits are

    def schedule(self, model: nn.Module, device: torch.device, kind: str, microbatches: int):
        """torch's schedule (--pp-schedule) for this rank's stages, None without a pipeline. Each micro-batch's loss is
        its mean; divided by their number (scale_grads), the gradients are of the step's mean, as --accumulate's
        loss / len(micro) computes them without --pp."""
        if self.size == 1:
            return None
        parts = model.parts if isinstance(model, Stages) else [model]
        stages = [PipelineStage(part, index, self.count, device, group=self.group)
                  for part, index in zip(parts, self.stages, strict=True)]
        if kind not in MULTI:
            return SCHEDULES[kind](stages[0], n_microbatches=microbatches, loss_fn=next_char_loss, scale_grads=True)
        schedule = SCHEDULES[kind](stages, n_microbatches=microbatches, loss_fn=next_char_loss, scale_grads=True)
        # torch places the stages itself (round-robin, or the V for zbv and dualpipev) and sends each stage's output
        # to the rank it believes holds the next: a stage built elsewhere would exchange with the wrong rank.
        theirs = [r for s, r in sorted(schedule.stage_index_to_group_rank.items())]
        if theirs != [self.owner[s] for s in range(self.count)]:
            raise RuntimeError(f"{kind} places the stages on ranks {theirs}, this pipeline on "
                               f"{[self.owner[s] for s in range(self.count)]}: the placement (stages_of) is wrong")
        return schedule

    def step(self, schedule, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """A step's micro-batches through the stages, forward and backward: the first stage is given the inputs, the
        last the targets. The sum of the micro-batches' losses on the last stage, None on the others."""
        losses: list[torch.Tensor] = []
        # return_outputs=False: else the last stage keeps every micro-batch's logits to hand them back, [b, t, vocab]
        # each: at a vocabulary of 128,256 and 8,192 tokens, 4 GiB a sequence (at_scale/).
        schedule.step(*([x] if self.first else []), target=y if self.last else None,
                      losses=losses if self.last else None, return_outputs=False)
        if not self.last:
            return None
        # (--sp: each loss a Replicate DTensor, whole on every tp rank: its local tensor is the loss)
        return torch.stack([loss.to_local() if isinstance(loss, DTensor) else loss for loss in losses]).detach().sum()

    @torch.no_grad()
    def forward(self, model: nn.Module, idx: torch.Tensor) -> torch.Tensor | None:
        """The logits for token ids idx [b, t] without a backward (evaluation, sampling): the whole batch through
        the stages one after another (micro-batches would only add steps: there is no backward to overlap with).
        The logits on the last stage, None on the others. Every stage is given idx: the shape of what it receives.
        The logits whole: --sp leaves them split over tp by vocabulary (a DTensor), gathered here (a sample, a loss on
        few windows)."""
        parts = dict(zip(self.stages, model.parts if isinstance(model, Stages) else [model], strict=True))
        x = idx
        for s in self.stages:  # in order: a rank's stages wait on the earlier ones of the other ranks
            if s > 0 and self.owner[s - 1] != self.rank:
                x = torch.empty(idx.shape[0], idx.shape[1] // self.split, self.width, dtype=self.dtype,
                                device=idx.device)
                dist.recv(x, group=self.group, group_src=self.owner[s - 1])
            x = parts[s](x)
            if s == self.count - 1:
                return x.full_tensor() if isinstance(x, DTensor) else x
            if self.owner[s + 1] != self.rank:  # (the V's turn, stage pp - 1 to pp, stays on its rank)
                dist.send(x.to(self.dtype).contiguous(), group=self.group, group_dst=self.owner[s + 1])  # (--amp)
        return None

    def from_last(self, x: torch.Tensor) -> torch.Tensor:
        """x as the last stage's rank holds it, on every rank of the pipeline (in place)."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=self.last_rank)
        return x
