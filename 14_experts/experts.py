"""A mixture of experts, and expert parallelism by hand. The MLP of every block becomes E experts (small MLPs) and a
router that sends each token to k of them; under --ep the experts live on different processes, and each token travels
to its experts and back by all-to-all (forward and backward, written out)."""
from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# What every trainer of experts does (Switch Transformer, GShard, Mixtral, DeepSeek): the router, a linear layer, scores
# the E experts for each token; the token goes to its k best, and its output is the sum of their outputs weighted by
# the router's probabilities (the gates: renormalised over the k, or at k = 1 the probability itself). A token then
# costs k experts' compute, while the model holds E experts' weights: more parameters for the same compute per token.
# Left alone, the router sends most tokens to a few experts (they learn fastest, so they win more tokens); the
# balancing loss (Switch's) pushes back.


def balance_loss(probs: torch.Tensor, chosen: torch.Tensor, groups: list[dist.ProcessGroup | None]) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, E * sum_i f_i * P_i: f_i the share of the routed tokens that went to
    expert i (counted, no gradient), P_i the router's mean probability for expert i (the gradient flows here). It is
    1 when the load is even and grows as it concentrates. f is counted over the whole micro-batch, every process's
    tokens (`groups`: an all-reduce of E numbers over each; --sp: over tp too, where each rank routes its own tokens),
    so the loss is one process's; P is this rank's mean, and averaging the ranks' gradients (DDP) averages it into the
    whole batch's. (Most trainers count f per rank: --balance rank.)"""
    counts = torch.bincount(chosen.flatten(), minlength=probs.shape[-1]).to(probs.dtype)
    for group in groups:
        if group is not None:  # (None: a group of one)
            dist.all_reduce(counts, group=group)
    return probs.shape[-1] * (counts / counts.sum() * probs.mean(0)).sum()


def expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The expert weights (what ep splits) by name, as `model.named_parameters()` names them."""
    return {name: p for name, p in model.named_parameters() if ".experts." in name}


class AllToAll(torch.autograd.Function):
    """Rows to the ranks of `group`: send_splits[r] of them to rank r (in rank order), recv_splits[r] from rank r.
    Its backward is the same exchange the other way round: each row's gradient goes back to where the row came from."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = rows.new_empty(sum(recv_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group)
        return back, None, None, None


class WithBalanceLoss(torch.autograd.Function):
    """x unchanged; in backward, `aux` receives the gradient `weight`, as if weight x aux had been added to the loss.
    The balancing loss so reaches the router of every block without being carried to the loss (on a pipeline, the
    first stages' blocks never see it; Megatron-LM does the same)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        # A copy, not a view: where --compile's graph takes x as an input, it rebuilds a view of it outside the graph,
        # and this backward is lost (the balancing loss's gradient with it: seen, torch 2.13)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=grad.dtype, device=grad.device), None


class ExpertParallel:
    """This rank's place among the ep ranks that split the experts (each holds E / ep of every block's), and the
    ranks that hold the same experts as it (`replicas`). ep = 1 (no group): every expert here, as in one process."""

    def __init__(self, group: dist.ProcessGroup | None, replicas: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.group, self.replicas = group, replicas
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        # A 1-D mesh of the ep ranks: the expert weights are DTensors on it (checkpoints then name every expert alike
        # on any layout, and the gradient norm sums the ep ranks' parts).
        self.mesh = None if group is None else DeviceMesh.from_group(group, device.type)

    def shard(self, weight: nn.Parameter) -> nn.Parameter:
        """This rank's experts of a stacked weight [E, ...]: rows rank * E/ep onwards, as a DTensor (no copy sent:
        every rank drew the same whole weight)."""
        if self.size == 1:
            return weight
        local = weight.detach().chunk(self.size)[self.rank].clone()
        return nn.Parameter(DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False))

    def run(self, experts: Experts, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each row through its expert, wherever the expert lives; rows sorted by expert, counts[e] of them for expert
        e (of all E). Returns the outputs in the rows' order."""
        if self.size == 1:
            return experts(rows, counts)
        # 1. How many rows each rank sends each of another's experts: an all-to-all of the counts, so that every rank
        # knows what it will receive. (.tolist(): the sizes must be on the host; on a GPU this waits for the router.)
        sent = counts.view(self.size, -1)  # [ep, E/ep]: to rank r, for its experts
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)  # from rank r, for my experts
        send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        # 2. The rows to their experts' ranks. They arrive by sender, each sender's by expert: regroup by expert.
        got = AllToAll.apply(rows, send_splits, recv_splits, self.group)
        # the expert of each (sender, expert) pair, in the order they arrive
        expert_of = torch.arange(sent.shape[1], device=rows.device).repeat(self.size)
        by_expert = expert_of.repeat_interleave(received.flatten()).argsort(stable=True)
        out = experts(got[by_expert], received.sum(0))
        # 3. The outputs back to the ranks that sent the rows, in the order they came.
        return AllToAll.apply(out[by_expert.argsort()], recv_splits, send_splits, self.group)

    def average_gradients(self, model: nn.Module, world: int) -> None:
        """The expert weights' gradients as DDP leaves the others': of the mean loss over all `world` ranks. An
        expert's gradient here already sums what its ep group's tokens sent it; adding its replicas' (the ranks that
        hold the same experts) sums every rank's, and / world makes it the mean's. (Not / the replicas: off by ep.)"""
        for p in expert_params(model).values():
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if self.replicas is not None:
                dist.all_reduce(grad, group=self.replicas)
            grad.div_(world)


def expert_capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """GShard's capacity: at most factor x the even share of this rank's routed tokens per expert."""
    return math.ceil(factor * tokens * top_k / experts)


class Experts(nn.Module):
    """E MLPs (stage 11's shape: width -> 4 width -> width), their weights stacked [E, ...] so that ep can split them
    by expert. Under --ep a rank holds E / ep of them (DTensors: `.to_local()` is its experts)."""

    def __init__(self, experts: int, width: int) -> None:
        super().__init__()
        self.fc_weight = nn.Parameter(torch.empty(experts, 4 * width, width))
        self.fc_bias = nn.Parameter(torch.zeros(experts, 4 * width))
        self.proj_weight = nn.Parameter(torch.empty(experts, width, 4 * width))
        self.proj_bias = nn.Parameter(torch.zeros(experts, width))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows sorted by expert, counts[e] of them for this rank's expert e: each run through its own."""
        # (.to: under --amp with FSDP2 the rows come in bfloat16, as FSDP2 gathers the other weights; not these)
        weights = [(p.to_local() if isinstance(p, DTensor) else p).to(rows.dtype)
                   for p in (self.fc_weight, self.fc_bias, self.proj_weight, self.proj_bias)]
        outs = [F.gelu(chunk @ w1.T + b1) @ w2.T + b2
                for chunk, w1, b1, w2, b2 in zip(rows.split(counts.tolist()), *weights, strict=True)]
        return torch.cat(outs)


class MoE(nn.Module):
    """The block's MLP as a mixture of experts: route, send each token to its k experts, combine."""

    def __init__(self, width: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = Experts(experts, width)
        self.top_k = top_k
        self.ep: ExpertParallel | None = None  # set by parallelize()
        self.capacity_factor: float | None = None  # --capacity-factor; None: dropless
        self.balance_groups: list[dist.ProcessGroup | None] = []  # --balance batch: the micro-batch's ranks
        self.aux_weight = 0.0  # --aux-weight, per micro-batch (set by parallelize())
        self.recomputing = False  # --ac: True while backward runs the forward again (parallelize.checkpointed)
        # For the log and --out, a tally per forward in training: tokens per expert, balancing loss, dropped pairs.
        self.tallies: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, experts = x.shape, self.router.out_features
        x = x.reshape(-1, shape[-1])  # [tokens, width]: every token routed on its own
        probs = self.router(x).softmax(-1)  # [tokens, E]
        gates, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, k]: each token's k experts, best first
        if self.top_k > 1:  # its output: the experts' outputs weighted by these, renormalised to sum to 1 (Mixtral)
            gates = gates / gates.sum(-1, keepdim=True)
        # At k = 1 the gate stays the router's probability (Switch): renormalised, it would be 1 whatever the router
        # says, and the router would learn from the balancing loss alone, never from the loss.
        # The (token, choice) pairs sorted by expert: each expert's rows then lie together.
        expert_of = chosen.flatten()
        order = expert_of.argsort(stable=True)  # within an expert, in the tokens' order
        counts = torch.bincount(expert_of, minlength=experts)
        routed = counts
        if self.capacity_factor is not None:  # an expert takes its first `capacity` tokens; the rest skip it
            capacity = expert_capacity(len(x), self.top_k, experts, self.capacity_factor)
            start = counts.cumsum(0) - counts  # where each expert's rows begin in `order`
            place = torch.arange(len(order), device=x.device) - start.repeat_interleave(counts)
            order = order[place < capacity]
            counts = counts.clamp(max=capacity)
        token = order // self.top_k
        out = (self.ep.run(self.experts, x[token], counts) if self.ep is not None else self.experts(x[token], counts))
        # Combine: each token's rows, weighted by their gates, added into its place (a dropped choice adds nothing:
        # the block's residual carries the token on).
        out = torch.zeros_like(x).index_add_(0, token, (out * gates.flatten()[order, None]).to(x.dtype))  # (--amp)
        if self.training:
            aux = balance_loss(probs, chosen, self.balance_groups)
            out = WithBalanceLoss.apply(out, aux, self.aux_weight)
            if not self.recomputing:  # (recomputed, the same tokens take the same experts: tallied once)
                dropped = (routed - counts).sum()
                self.tallies.append(torch.cat([routed.double(), aux.detach().double()[None], dropped.double()[None]]))
        return out.view(shape)


class ExpertLog:
    """What the experts did, per step (the log line and --out): the tokens each expert of each block took, the
    balancing loss (the blocks' mean), the share of the (token, expert) pairs dropped; over every rank's tokens.
    Read from the MoE layers once a step, gathered with the losses (one all-reduce for many steps)."""

    def __init__(self, model: nn.Module, cfg, device: torch.device, snapshot: dict | None) -> None:
        # This rank's MoE layers by block number (a pipeline stage holds some blocks only).
        self.moes = {int(name.split(".")[-2]): m for name, m in model.named_modules() if isinstance(m, MoE)}
        self.shape, self.top_k, self.device = (cfg.layers, cfg.experts + 2), cfg.top_k, device
        self.pending: list[torch.Tensor] = []  # a [blocks, E + 2] tally per step not yet settled
        # From the first step on: a resumed run starts with its checkpoint's steps (progress.json keeps them).
        done = (snapshot or {}).get("experts", {})
        self.load: list[list[list[int]]] = list(done.get("load", []))  # per step, per block, per expert: tokens
        self.aux_losses: list[float] = list(done.get("aux_losses", []))  # E x sum f_i P_i, the blocks' mean: 1 = even
        self.dropped: list[float] = list(done.get("dropped", []))

    def history(self) -> dict[str, list]:
        """The lists, per step: progress.json's (a checkpoint) and summary.json's."""
        return {"load": self.load, "aux_losses": self.aux_losses, "dropped": self.dropped}

    def step_done(self, micro_batches: int) -> None:
        """The step's last `micro_batches` forwards of each MoE layer: any before them are not training (in the first
        step under --pp, torch's schedule runs a forward of its own to learn the shapes the stages pass on)."""
        tally = torch.zeros(self.shape, dtype=torch.float64, device=self.device)  # zero for other stages' blocks
        for i, moe in self.moes.items():
            tally[i] = torch.stack(moe.tallies[-micro_batches:]).sum(0)
            moe.tallies = []
        self.pending.append(tally)

    def settle(self, grid, pipe, args: argparse.Namespace, tokens: int) -> None:
        """Summed over the dp x cp ranks (--sp: the tp ranks too, each tallied its own tokens: SP_PLAN's "moe"), then
        the pipeline's stages; the balancing loss averaged over the forwards that computed it (each dp x cp rank's
        micro-batches; --sp: each tp rank's too, its loss taken over its own tokens); the dropped pairs over those
        routed in a step's `tokens` (k a token in every block)."""
        groups = [grid.group("dp_cp")] + ([grid.group("tp")] if args.sp else []) + ([pipe.group] if pipe.size > 1
                                                                                     else [])
        forwards = grid.sizes["dp"] * grid.sizes["cp"] * args.accumulate * (args.tp if args.sp else 1)
        tally = torch.stack(self.pending)  # [steps, blocks, E + 2]
        for group in groups:
            dist.all_reduce(tally, group=group)
        self.load += tally[:, :, :-2].long().tolist()
        self.aux_losses += (tally[:, :, -2].mean(1) / forwards).tolist()
        self.dropped += (tally[:, :, -1].sum(1) / (tokens * self.top_k * self.shape[0])).tolist()
        self.pending = []


# ─── The flags, and the line the run starts with ────────────────────────────────────────────────────────────────────

def add_expert_flags(p: argparse.ArgumentParser, positive) -> None:
    """This stage's flags (train.py's parse_args): `positive(kind)` parses a value > 0 or refuses it in one line."""
    p.add_argument("--experts", type=positive(int), default=4, help="E: experts per block")
    p.add_argument("--top-k", type=positive(int), default=2, help="k: the experts each token goes to")
    p.add_argument("--ep", type=positive(int), default=1,
                   help="expert-parallel degree: dp x cp processes that share out the experts (E / ep each)")
    p.add_argument("--capacity-factor", type=positive(float),
                   help="an expert takes at most this x its even share of a rank's tokens, the rest skip it "
                        "(default: none, every token reaches its k experts)")
    p.add_argument("--aux-weight", type=float, default=0.01,
                   help="the balancing loss's weight in the loss (Switch Transformer's 0.01; 0: none)")
    p.add_argument("--balance", choices=["batch", "rank"], default="batch",
                   help="count the experts' load over the whole micro-batch, as one process (batch), or over each "
                        "rank's tokens, as most trainers do (rank: trains differently)")


def describe_experts(args: argparse.Namespace, cfg, ep: ExpertParallel, split: bool) -> str:
    """The run's experts in a line, and what makes its training another than one process's of the same batch (said
    before it starts): `split`, whether the batch is split over several dp x cp ranks."""
    differs = ["each rank counts the experts' load over its own tokens (--balance rank)"] \
        if args.balance == "rank" and split else []
    if args.capacity_factor and split:
        differs.append("a rank's experts drop the tokens past its capacity, so which are dropped depends on the split "
                       "(--capacity-factor)")
    capacity = "dropless: every token reaches its experts" if not args.capacity_factor else \
        f"capacity {args.capacity_factor:g} x an expert's even share of a rank's tokens, the rest skip it"
    # At k = 1 the gate is the router's probability (Switch), said because k > 1 renormalises the gates (MoE.forward).
    gate = ", weighted by the router's probability (k = 1: not renormalised, as Switch)" if cfg.top_k == 1 else ""
    per_rank = cfg.experts // ep.size
    return (f"experts: {cfg.experts} per block, each token to {cfg.top_k}{gate} | ep {ep.size}: {per_rank} "
            f"expert{'s' if per_rank > 1 else ''} a rank | balancing loss x {args.aux_weight:g}, its load counted over "
            f"{'the whole micro-batch' if args.balance == 'batch' else 'each rank'} | {capacity}"
            + (" | this run trains differently from one process: " + "; ".join(differs) if differs else ""))
