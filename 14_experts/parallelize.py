"""What the stages taught, on the GPT: who holds and computes what, on the grid of processes that grid.py makes. Each
block's experts shared out over ep of the dp x cp ranks (experts.py), its attention split over tp (stage 09), the
model wrapped in DDP (stages 03-06) or sharded by FSDP2 (stage 08) over dp x cp, the gradient clipped by its norm over
the whole model however it is split (over the pipeline's stages too), and the whole model gathered for saving."""
from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from context_parallel import ContextParallel
from experts import ExpertParallel, MoE, expert_params
from grid import Grid
from model import GPT, Config
from pipeline import SPLIT_BACKWARD, Pipeline

# Stage 09's pairing, on a transformer block: q, k and v split column-wise (each tp rank computes whole heads, its
# share of them, without talking), the attention's output projection row-wise (partial sums, all-reduced over tp).
# Per block, one all-reduce forward and three backward (the gradient of each column-wise layer's input is a sum over
# tp). The experts are not split over tp: a tp row's ranks hold the same tokens, and each computes the experts whole
# (ep splits them instead). Embeddings, norms and the head stay whole on every tp rank; FSDP2 shards them over dp.
TP_PLAN = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.proj": RowwiseParallel()}

# --sp (sequence parallelism, Korthikanti et al. 2022): between the blocks' matmuls, the residual stream and the norms
# are split by sequence over tp (Shard(1): each tp rank holds t / tp of every window's tokens) instead of whole on
# every tp rank. A block's edges change: q, k and v need every token, so the attention's input is all-gathered first
# (Shard(1) -> Replicate); the row-wise layer's partial sums are reduce-scattered back to Shard(1) instead of
# all-reduced. An all-reduce is a reduce-scatter then an all-gather: the same bytes, moved to
# where the norms can work on t / tp tokens (backward moves fewer: q, k and v's input gradients, DTensors now, are
# summed before one reduce-scatter, where TP_PLAN all-reduces each). The norms' weights become Replicate DTensors
# on the tp mesh (SequenceParallel): see split_over_tp for their gradients, and sum_over_tp for the experts'.
SP_PLAN = {"norm1": SequenceParallel(), "norm2": SequenceParallel(),  # on Shard(1); their weights Replicate DTensors
           "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),  # all-gather
           "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
           "attn.proj": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter
           # The experts take norm2's Shard(1) as it is, a plain tensor (its local part): each tp rank routes its own
           # t / tp tokens (and under --ep sends its own to their experts), no gather; the output is those tokens'.
           "moe": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                     use_local_output=True)}
# Around the blocks, under --sp. The embeddings stay whole on every rank (small here) and each rank keeps its tokens'
# rows of their outputs (Replicate -> Shard: a slice, no traffic forward; backward all-gathers their gradient, so
# every rank's embedding gradient is whole). The positions: GPT.forward looks up this cp rank's positions, [t/cp, w]
# (cp.positions: zigzag chunks r and 2cp-1-r); cut on its dim 0 by the same rule (torch.chunk's) as the tokens'
# [b, t/cp, w] on dim 1: the cp rule first, then tp rank r takes the r-th contiguous t/(cp tp) of its cp share, the
# very tokens it holds: the sum is right token by token. Attention needs a cp share whole: SP_PLAN's all-gather over
# tp rebuilds it before q, k and v, then the ring (or all-gather) over cp reaches the other shares' keys and values.
# The head column-wise over the vocabulary, its input all-gathered from Shard(1), its logits left split by vocabulary
# (a DTensor, Shard(-1)): the loss is computed on them under loss_parallel (train.py), never gathering [tokens, vocab].
SP_AROUND = {"tokens": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
             "positions": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)),
             "norm": SequenceParallel(),
             "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)}

# --ac selective keeps the outputs of the ops costly to recompute, named as autograd sees them: the matmuls (nn.Linear
# is addmm; mm and bmm as they appear), attention (aten::_scaled_dot_product_..., one kernel per device), and under
# --tp the all-reduce of a row-wise layer's sums (else a collective again in backward), under --sp its
# reduce-scatter. The rest (norms, gelu, adds, reshapes) is recomputed from them.
KEEP = {"aten::mm", "aten::addmm", "aten::bmm", "_c10d_functional::all_reduce",
        "_c10d_functional::reduce_scatter_tensor"}


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    keep = op.name() in KEEP or op.name().startswith("aten::_scaled_dot_product")
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block: nn.Module, ac: str) -> None:
    """--ac full: the block keeps its input alone for backward, which runs its forward again to rebuild the rest.
    --ac selective: it keeps what KEEP makes too, and recomputes only the cheap ops between them. (In place: the
    parameters keep their names.) Its experts are told when they are recomputed: they tally their tokens once."""
    forward, moes = block.forward, [m for m in block.modules() if isinstance(m, MoE)]

    def contexts():  # (the first runs around the forward, the second around each recomputation)
        keep, replay = create_selective_checkpoint_contexts(keep_matmuls) if ac == "selective" else noop_context_fn()
        return keep, Recomputing(moes, replay)
    block.forward = lambda x: checkpoint(forward, x, use_reentrant=False, context_fn=contexts)


class Recomputing:
    """The context torch's checkpoint enters around a recomputation of the block: its experts' `recomputing` flag set
    inside. Entered once per backward that needs the block's activations: once, or twice under the split backward
    (--pp-schedule interleavedzb, zbv, dualpipev: the input gradient, then the weights', each an autograd call of its
    own, and checkpoint recomputes for each). So a class, entered anew each time: a @contextmanager enters once."""

    def __init__(self, moes: list[MoE], replay) -> None:
        self.moes, self.replay = moes, replay

    def __enter__(self) -> None:
        for moe in self.moes:
            moe.recomputing = True
        self.replay.__enter__()

    def __exit__(self, *error) -> None:
        try:
            self.replay.__exit__(*error)
        finally:
            for moe in self.moes:
                moe.recomputing = False


def parallelize(model: GPT, grid: Grid, cp: ContextParallel, ep: ExpertParallel,
                args: argparse.Namespace) -> nn.Module:
    """The model as this rank trains it: its experts over ep (--ep), its attention over cp (--cp), split over tp
    (--tp), compiled (--compile), then DDP or FSDP2 over dp x cp: every cp rank holds the whole model (or a shard of
    it, as a dp rank does) and computes a gradient of its own tokens' loss; averaged over dp x cp, that is the
    gradient of the global batch. The expert weights under --ep are averaged by hand (ExpertParallel)."""
    for block in model.blocks.values():
        moe: MoE = block.moe
        moe.ep, moe.capacity_factor = ep, args.capacity_factor
        # The balancing loss joins the step's loss as the mean over its micro-batches, like the loss (under --pp,
        # torch's schedule divides every gradient by the micro-batches itself).
        # --sp: each tp rank's balancing loss takes P over its own t / tp tokens, and sum_over_tp adds the tp ranks'
        # gradients: / tp makes that sum the gradient of P's mean over the micro-batch, as one process's.
        moe.aux_weight = args.aux_weight / (1 if args.pp > 1 else args.accumulate) / (args.tp if args.sp else 1)
        # --balance batch: the loss counts the load over every dp x cp rank's tokens, as one process would (--sp:
        # and over the tp ranks, each routing its own tokens).
        moe.balance_groups = ([grid.group("dp_cp")] + ([grid.group("tp")] if args.sp else [])
                              if args.balance == "batch" else [])
        for name in ("fc_weight", "fc_bias", "proj_weight", "proj_bias"):  # each rank keeps its E / ep experts
            setattr(moe.experts, name, ep.shard(getattr(moe.experts, name)))
    if cp.size > 1:
        model.cp = cp  # (for the positions its tokens are at)
        for block in model.blocks.values():
            block.attn.cp = cp
    if args.tp > 1:  # every rank built the same weights (the same seed): each keeps its slice, no broadcast
        split_over_tp(model, grid.mesh["tp"], args.sp)
        # Gathering a weight split over tp and sharded over dp takes two all-gathers: torch warns, on every rank.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if args.ac != "none":  # torchtitan's order: after tp, so that the recomputed forward is each rank's slice of it;
        # before compile, which then traces the recomputation into each block's graph; before FSDP2, whose hooks on
        # the block gather its weights around the forward and again in backward, where the recomputation runs.
        # Under --ep the attention alone: recomputing the experts would send every token to its experts and back
        # again in backward (two more all-to-alls a block, and a wait for the counts); they keep what they made.
        for block in model.blocks.values():
            checkpointed(block.attn if ep.size > 1 else block, args.ac)
    if args.compile:  # each block compiled on its own, in place (the parameters keep their names)
        for block in model.blocks.values():
            block.compile()
    if args.parallel == "fsdp":  # stage 08: each block a unit, gathered whole only while it computes
        # --amp bf16: the shards stay float32 (the optimizer's), gathered as bfloat16 (half the bytes) for the
        # forward and backward; the gradients are reduce-scattered in float32, so the average rounds as without it.
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.amp == "bf16" \
            else MixedPrecisionPolicy()
        # Under --ep the experts are left out: a rank's are its own, averaged over their replicas by hand.
        expert_weights = set(expert_params(model).values()) if ep.size > 1 else None
        # The zero-bubble schedules (--pp-schedule interleavedzb, zbv, dualpipev) split a backward in two: the input
        # gradient (torch.autograd.grad for the inputs alone), the weights' later. They find the weights by the
        # module's parameters: those must be the gathered ones the forward used, so a block stays gathered from its
        # forward to its backward (stage 13's; else the blocks' weight gradients are lost, the routers' among them).
        keep = args.pp > 1 and args.pp_schedule in SPLIT_BACKWARD
        # --replicate R > 1, HSDP (stage 13's): FSDP2 shards over S x cp ranks and keeps R replicas of the shards; the
        # experts FSDP2 leaves alone under --ep are averaged over their replicas by hand, as without HSDP.
        dp = grid.mesh["replicate", "shard_cp"] if grid.sizes["replicate"] > 1 else grid.mesh["shard_cp"]
        for block in model.blocks.values():
            fully_shard(block, mesh=dp, mp_policy=mp, ignored_params=expert_weights, reshard_after_forward=not keep)
        # the rest (embeddings, norms, head): the root unit
        return fully_shard(model, mesh=dp, mp_policy=mp, ignored_params=expert_weights)
    # Stages 03-06: a replica per rank; the constructor broadcasts rank 0's weights, backward averages gradients.
    device = next(model.parameters()).device
    if ep.size > 1:  # DDP would average them over every rank; a rank's experts are its own (average_gradients)
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(expert_params(model)))
    return DDP(model, device_ids=[device] if device.type == "cuda" else None, process_group=grid.group("dp_cp"))


def split_over_tp(model: GPT, mesh: DeviceMesh, sp: bool) -> None:
    """Every block by TP_PLAN, or by SP_PLAN and the embeddings, final norm and head by SP_AROUND (--sp)."""
    for block in model.blocks.values():
        parallelize_module(block, mesh, SP_PLAN if sp else TP_PLAN)
    if sp:  # The norms' weight gradients: each tp rank's norm sees only its t / tp tokens, so its gradient is a sum
        # over those tokens, a part of the whole. SequenceParallel made the weights Replicate DTensors on the tp mesh,
        # so autograd's layer_norm backward returns their gradient as Partial (a sum pending over tp), and DTensor
        # all-reduces it into the Replicate .grad (as the norms' weights are, every rank's the same). Plain tensors
        # there would each keep their rank's part, and the tp ranks' norms drift apart.
        # A pipeline stage (--pp) holds some of these only: the first the embeddings, the last the norm and the head.
        parallelize_module(model, mesh, {name: plan for name, plan in SP_AROUND.items()
                                         if getattr(model, name) is not None})


def sum_over_tp(model: nn.Module, group: dist.ProcessGroup) -> None:
    """--sp: the routers' and the experts' gradients summed over tp (an all-reduce, after backward). Each tp rank
    routed its own t / tp tokens (SP_PLAN's "moe"), so its gradient of these weights is a sum over those tokens only:
    a part, as the norms' are, but these are plain tensors (DTensor's ops do not route tokens), so the sum is written
    here. Left out, the tp ranks' routers and experts drift apart."""
    for name, p in model.named_parameters():
        if p.grad is not None and (".moe.router." in name or ".experts." in name):
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)


def full_model(model: nn.Module, cfg: Config, pipe: Pipeline) -> GPT | None:
    """The whole model as a plain GPT on rank 0's CPU, None on the other ranks (every rank calls this): the pieces
    are sent unit by unit and only rank 0 keeps them (full_state_dict with cpu_offload), as when saving one file.
    --pp: each stage's ranks gather its part so, and the stages send theirs to the first stage."""
    if pipe.size == 1:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:  # (cpu_offload keeps the state on global rank 0 only, which holds the first stage alone)
        part = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        parts = [{} for _ in range(pipe.size)] if pipe.first else None
        dist.gather_object({k: v.cpu() for k, v in part.items()}, parts, group=pipe.group, group_dst=0)
        state = {k: v for part in parts for k, v in part.items()} if pipe.first else {}
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):  # no memory and no random draws: the weights come from `state`
        full = GPT(cfg)
    full.load_state_dict(state, assign=True)  # (no "module." prefix: get_model_state_dict drops DDP's)
    return full


def clip_gradients(model: nn.Module, max_norm: float, pipe: Pipeline) -> torch.Tensor:
    """Scale the gradients down so that their norm, over the whole model, is at most max_norm (0: never); return
    the norm before. One rare large gradient then cannot undo many steps. The norm is of the whole gradient, as one
    process would compute it, however it is split: DDP's gradients are whole on every rank (already averaged), but
    a DTensor's (FSDP2's shards, tp's slices) is this rank's piece, and its norm a collective over the piece's mesh:
    DTensor sums the pieces' squares there (an all-reduce, inside get_total_norm). The embeddings and norms lie on
    the dp x cp mesh, tp's layers on (dp x cp) x tp: one norm per mesh (torch's clip_grad_norm_ refuses a mix), then
    the total, over the stages of the pipeline (--pp: each holds the gradient of its blocks only)."""
    by_mesh: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for params in by_mesh.values():  # the same meshes in the same order on every rank (the model's order)
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)  # (already whole: a copy)
    total = torch.stack(squares).sum()
    if pipe.size > 1:
        dist.all_reduce(total, group=pipe.group)
    total = total.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.detach()



def replica_max_abs_diff(model: nn.Module, grid: Grid, ep: ExpertParallel) -> float:
    """DDP's replicas must agree: the largest difference of any rank's parameters from its first replica's, over dp x
    cp (with --tp, each rank's own slices, which its replicas hold too); under --ep a rank's experts are compared
    with the ranks that hold the same experts (ep.replicas) only."""
    experts = list(expert_params(model).values()) if ep.size > 1 else []
    own = {id(p) for p in experts}
    rest = [p for p in model.parameters() if id(p) not in own]
    gap = largest_gap(rest, grid.group("dp_cp"))
    return max(gap, largest_gap(experts, ep.replicas)) if experts and ep.replicas is not None else gap


def largest_gap(params: list[nn.Parameter], group: dist.ProcessGroup) -> float:
    local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
    flat = torch.cat([p.detach().flatten() for p in local])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return max((g - gathered[0]).abs().max().item() for g in gathered)
