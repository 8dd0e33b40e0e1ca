"""Pipeline parallelism (stage 10's) on the GPT: the blocks cut into stages, one after another, each stage's ranks
holding its part of the model; the micro-batches go through them under torch's schedule in training, and the whole
batch in evaluation and sampling."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

from model import GPT

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # --pp-schedule (stage 10's)


# Stage 10's pipelining on the GPT: the pp ranks of a pipeline each hold a run of consecutive blocks, the first also
# the embeddings, the last also the final norm and the head (so the loss is computed there). A step's rows are cut
# into --accumulate micro-batches that follow one another through the stages, so that the stages work at once, each
# on another micro-batch; torch's schedule sends the activations forward and their gradients back (GPipe: every
# forward, then every backward; 1F1B: a backward as soon as one can start, so a stage holds the activations of at most
# pp micro-batches). The pp dimension is the outermost of the grid: a stage's ranks are consecutive (one node), and
# the pipeline's sends, the least traffic of all, are what crosses nodes.

def stage_blocks(layers: int, pp: int, rank: int) -> range:
    """The blocks stage `rank` of `pp` holds: consecutive, as many on each stage as can be (the first ones one more)."""
    size, extra = divmod(layers, pp)
    start = rank * size + min(rank, extra)
    return range(start, start + size + (rank < extra))


def pipeline_stage(model: GPT, pp: int, rank: int) -> GPT:
    """The model cut down to stage `rank` of `pp`: the other stages' parts removed (None: forward skips them)."""
    kept = stage_blocks(len(model.blocks), pp, rank)
    for i in [i for i in model.blocks if int(i) not in kept]:
        del model.blocks[i]
    if rank > 0:
        model.tokens = model.positions = None
    if rank < pp - 1:
        model.norm = model.head = None
    return model


def next_char_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean loss over the positions of logits [b, t, vocab], given the next characters y [b, t]."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class Pipeline:
    """This rank's place in its pipeline. pp = 1 (no group) holds the whole model: the code then runs as without."""

    def __init__(self, group: dist.ProcessGroup | None, width: int, dtype: torch.dtype, split: int = 1) -> None:
        self.group, self.width, self.dtype = group, width, dtype  # what passes between stages: [b, t, width], dtype
        # --sp: a rank passes on its part of the residual stream only, [b, t / tp, width] (split = tp): the stream is
        # split by sequence between the blocks, and a stage's edge is between two blocks (torch's schedule learns
        # the shape from the first step's forward; `forward` below is told it).
        self.split = split
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.first, self.last = self.rank == 0, self.rank == self.size - 1

    def schedule(self, model: nn.Module, device: torch.device, kind: str, microbatches: int):
        """torch's schedule (--pp-schedule) for this rank's stage, None without a pipeline. Each micro-batch's loss is
        its mean; divided by their number (scale_grads), the gradients are of the step's mean, as --accumulate's
        loss / len(micro) computes them without --pp."""
        if self.size == 1:
            return None
        stage = PipelineStage(model, self.rank, self.size, device, group=self.group)
        return SCHEDULES[kind](stage, n_microbatches=microbatches, loss_fn=next_char_loss, scale_grads=True)

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
        x = idx
        if not self.first:
            x = torch.empty(idx.shape[0], idx.shape[1] // self.split, self.width, dtype=self.dtype, device=idx.device)
            dist.recv(x, group=self.group, group_src=self.rank - 1)
        out = model(x)
        if self.last:
            return out.full_tensor() if isinstance(out, DTensor) else out
        dist.send(out.to(self.dtype).contiguous(), group=self.group, group_dst=self.rank + 1)  # (--amp: from bf16)
        return None

    def from_last(self, x: torch.Tensor) -> torch.Tensor:
        """x as the last stage holds it, on every stage of the pipeline (in place)."""
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=self.size - 1)
        return x
