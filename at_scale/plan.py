"""Which layout for my model on my cluster: every layout weighed by formula, those that fit ranked by throughput.

    python at_scale/plan.py --model llama3-8b --gpus 8 --gpu h100 --context 8192 --global-batch-tokens 1048576

For every way to split the job (dp x tp x pp x cp, ep for experts; DDP, ZeRO-1, ZeRO-2 or FSDP over the dp x cp ranks,
or HSDP: FSDP over a node's S x cp of them, R replicas of that; the micro-batch; activation checkpointing none, full
or selective; sequence parallelism on or off where tp > 1), costs.py counts what each rank holds, sends and
computes in a step (the formulas simulate.py checks against the stages' own code), and this file turns them into
memory per GPU and time per step on the GPUs of hardware.py (each figure there with its source; nothing fitted to
the runs it is checked against). A layout fits if its busiest rank's state and activation peak fit in the GPU's
memory. Step time:

- compute: the rank's FLOPs (and what --ac full computes again) at the matmul rate the GPU reaches;
- tp, ep: exposed (the next matmul needs the result); cp's ring: hidden behind the attention beside it;
- dp x cp (DDP's all-reduce, ZeRO's and FSDP's all-gathers and reduce-scatters, HSDP's all-reduce over its
  replicas): hidden behind the compute, but the first gather and the last reduce;
- the pipeline (the stages' 1F1B, or interleaved 1F1B with v stages a rank): each stage idle for (pp - 1)
  micro-batches' time, interleaved (pp - 1) / v of them: the bubble.
A group's bandwidth is NVLink's when its ranks share a node (the grid puts tp innermost, then cp, dp, pp; HSDP's
shard group inside dp, its replicas outside), else the network's; every collective also pays NCCL's latency per
step of its ring.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/
sys.path.insert(0, str(ROOT / "at_scale"))
import costs  # noqa: E402
import hardware  # noqa: E402
from costs import Layout, Model  # noqa: E402

from tools.cli import ArgumentParser, positive, print_table  # noqa: E402

PARALLEL = ("ddp", "zero1", "zero2", "fsdp")
MICRO_BATCHES = (1, 2, 4, 8)  # weighed, and any other --micro-batch asks for
VOCAB, TOP_K = 128256, 2  # the shape flags' defaults: Llama 3's vocabulary; experts a token goes to


@dataclass
class Prediction:
    layout: Layout
    fits: bool
    why_not: str  # "" when it fits
    memory: dict  # bytes on the busiest rank: parameters, gradients, optimizer, activations, total
    seconds: dict  # the step: compute, tp, cp, ep, pp, dp (exposed), bubble, total
    tokens_per_s: float
    flops_per_gpu: float  # model FLOPs per second per GPU (recomputation not counted, as MFU does)
    mfu: float


def group_link(lay: Layout, dim: str, gpu: hardware.GPU) -> str:
    """'nvlink' when every group of this grid dimension lies within one node, else 'network'. The grid (13_pipeline_4d/
    grid.py) orders the ranks pp, dp, cp, tp, tp fastest: a group spans its size times the product of the sizes
    inside it, from a multiple of that span; where the span does not divide a node's GPUs, the node's first boundary
    cuts a group (6 ranks a group, 8 GPUs a node: ranks 6-11), and a collective waits for its slowest link."""
    inner = {"tp": 1, "cp": lay.tp, "ep": lay.tp, "dp_cp": lay.tp, "ep_replicas": lay.tp * lay.ep,
             "shard_cp": lay.tp, "replicate": lay.tp * lay.shard_cp, "pp": lay.dp * lay.cp * lay.tp}[dim]
    size = group_size(lay, dim)
    if dim == "ep_replicas":  # every ep-th rank of dp x cp: it spans the whole dp x cp line
        inner, size = lay.tp, lay.dp_cp
    span = inner * size
    return "nvlink" if gpu.gpus_per_node % span == 0 or lay.world <= gpu.gpus_per_node else "network"


@dataclass(frozen=True)
class Links:
    """Collectives as measured on one machine (at_scale/this_machine.py), in place of hardware.py's NCCL figures: per
    kind of collective, the seconds a call costs before its bytes and the bytes a rank sends per second (at the group
    size measured), and the share of each kind of communication that hides behind compute (hardware.OVERLAP's keys)."""
    latency_s: dict[str, float]
    bytes_per_s: dict[str, float]
    overlap: dict[str, float]
    after_compute: float = 0.0  # what a call costs more per second of compute before it (the ranks drift apart, and
    #                             the threads that wait wake slowly): seconds per second


def comm_seconds(kind: str, calls: int, sent: float, n: int, link: str, gpu: hardware.GPU,
                 links: Links | None = None, interval: float = 0.0) -> float:
    """A rank's time in `calls` collectives of `kind` that send `sent` bytes from it in all, over a group of n;
    `interval`: the compute before each call (with measured links)."""
    if links is not None:
        return sent / links.bytes_per_s[kind] + calls * (links.latency_s[kind] + links.after_compute * interval)
    if link == "nvlink":
        eff = hardware.NVLINK_EFFICIENCY.get(kind, hardware.NVLINK_EFFICIENCY["all_gather"]).value
        bw, step = gpu.nvlink_bytes_per_s * eff, hardware.NVLINK_STEP_LATENCY_S.value
    else:
        bw, step = gpu.network_bytes_per_s * hardware.NETWORK_EFFICIENCY.value, hardware.NETWORK_STEP_LATENCY_S.value
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}.get(kind, 1)
    return sent / bw + calls * (hardware.COLLECTIVE_LATENCY_S.value + steps * step)


def group_size(lay: Layout, dim: str) -> int:
    if dim in ("tp", "cp", "ep", "replicate", "pp"):  # (the grid's own degrees; the others are made of them)
        return getattr(lay, dim)
    return {"dp_cp": lay.dp * lay.cp, "ep_replicas": lay.dp * lay.cp // lay.ep,
            "shard_cp": lay.dp * lay.cp // lay.replicate}[dim]


def predict(m: Model, lay: Layout, gpu: hardware.GPU, links: Links | None = None,
            compute_s: list[float] | None = None) -> Prediction:
    """Memory and step time of a layout: its busiest stage's memory, its slowest stage's time. links: collectives as
    measured on a machine (else hardware.py's NCCL and overlap figures); compute_s: each pipeline stage's compute in
    a step, measured (else its FLOPs at the GPU's matmul rate)."""
    stages = [costs.rank_costs(m, lay, s) for s in range(lay.pp)]
    # DDP's buckets hold a second copy of the gradients, made at its construction (gradient_as_bucket_view off, the
    # stages' default: recipes/ddp_options counts the two storages; simulate.py, which tracks the step, does not).
    buckets = 2 if lay.parallel == "ddp" else 1
    memory = max(({"parameters": r.parameters, "gradients": buckets * r.gradients, "optimizer": r.optimizer,
                   "activations": r.activation_peak,
                   "total": r.state + (buckets - 1) * r.gradients + r.activation_peak} for r in stages),
                 key=lambda d: d["total"])
    rate = gpu.matmul_flops  # the matmul rate it reaches (hardware.py: measured, a ceiling)
    overlap = links.overlap if links is not None else {k: f.value for k, f in hardware.OVERLAP.items()}
    worst: dict[str, float] = {}
    for i, r in enumerate(stages):
        compute = (r.flops + r.recompute_flops) / rate if compute_s is None else compute_s[i]
        t = {"compute": compute, "tp": 0.0, "cp": 0.0, "ep": 0.0, "pp": 0.0, "dp": 0.0}
        talks = {key: calls for key, (calls, _) in r.sent.items() if group_size(lay, key[1]) > 1 and key[0] != "recv"}
        interval = compute / max(1, sum(talks.values()))  # the compute between two collectives, on average
        for (kind, dim), calls in talks.items():
            n, sent = group_size(lay, dim), r.sent[kind, dim][1]
            s = comm_seconds(kind, calls, sent, n, group_link(lay, dim, gpu), gpu, links, interval)
            key = {"dp_cp": "dp", "ep_replicas": "dp", "shard_cp": "dp", "replicate": "dp"}.get(dim, dim)
            t[key] += s
        # What hides: cp's ring behind the attention beside it (at most the compute; an all-gather first: nothing),
        # the pipeline's sends behind the next micro-batch's compute, dp's behind the step's compute but its first
        # gather and last reduce.
        t["cp"] = max(0.0, t["cp"] - overlap[f"cp_{lay.cp_impl}"] * t["compute"])
        t["pp"] = max(0.0, t["pp"] - overlap["pp"] * t["compute"])
        units = sum(costs.rank_chunks(m, lay, i)) + 1  # this stage's blocks and its root
        edge = 2 * t["dp"] / units  # one unit's gather and one's reduce: nothing to hide them behind
        t["dp"] = edge + max(0.0, t["dp"] - edge - overlap["dp"] * t["compute"])
        if sum(t.values()) > sum(worst.values()):
            worst = t
    per_micro = sum(v for k, v in worst.items() if k != "dp") / lay.accumulate
    # 1F1B and GPipe alike: pp - 1 micro-batches idle; interleaved, pp - 1 of a rank's v stages' worth of one
    # (Narayanan et al. 2021; Llama 3's bubble ratio (pp - 1) / (v x micro-batches): hardware.LLAMA3_405B_TRAINING)
    bubble = (lay.pp - 1) * per_micro / lay.stages_per_rank if lay.pp > 1 else 0.0
    seconds = {**worst, "bubble": bubble}
    seconds["total"] = sum(seconds.values())
    tokens = lay.dp * lay.micro_batch * lay.accumulate * m.context
    model_flops = (6 * matmul_parameters(m) + attention_flops(m)) * tokens
    flops_per_gpu = model_flops / seconds["total"] / lay.world
    why = "" if memory["total"] <= gpu.memory_bytes else \
        f"needs {memory['total'] / 1e9:,.1f} GB of {gpu.memory_bytes / 1e9:,.0f}"
    return Prediction(lay, not why, why, memory, seconds, tokens / seconds["total"], flops_per_gpu,
                      flops_per_gpu / gpu.peak_flops)


def matmul_parameters(m: Model) -> int:
    """The parameters a token multiplies by (k experts' of E): all but the embeddings, which are looked up (PaLM's
    MFU counts 6 FLOPs a token for each, forward and backward)."""
    looked_up = m.vocab * m.width + (m.context * m.width if m.learned_positions else 0)
    return costs.active_parameters(m) - looked_up


def attention_flops(m: Model) -> float:
    """Attention's FLOPs per token, forward and backward, the whole score matrix, as PaLM's MFU counts them: 12 x
    layers x context x width, the backward twice the forward. (The step's time counts what a kernel computes:
    FlopCounterMode's 14, the backward recomputing the scores; costs.ATTENTION_BACKWARD.)"""
    return 12 * m.layers * m.context * m.heads * m.head_size


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(m: Model, gpus: int, gpus_per_node: int, sequences: int, fixed: dict) -> list[Layout]:
    """Every layout of `gpus` GPUs for `sequences` sequences a step that the stages can run: tp within a node and
    dividing the heads (and KV heads) and the MLP, pp at most the blocks (1F1B: at least pp micro-batches; and its
    interleaved schedules: pipeline_schedules), cp with 2 x cp dividing the context (zigzag), ep dividing the experts
    and dp x cp, dp dividing the sequences."""
    out, micro_batches = [], sorted({*MICRO_BATCHES, fixed.get("micro_batch", 1)})  # (and any asked for)
    for tp in divisors(gpus):
        if tp > gpus_per_node or m.heads % tp or m.kv_heads % tp or m.ffn % tp or (m.vocab_over_tp and m.vocab % tp):
            continue
        for pp in divisors(gpus // tp):
            if pp > m.layers:
                continue
            for cp in divisors(gpus // (tp * pp)):
                dp = gpus // (tp * pp * cp)
                if cp > 1 and m.context % (2 * cp):
                    continue
                if sequences % dp:
                    continue
                for ep in (divisors(m.experts) if m.experts else [1]):
                    if (dp * cp) % ep:
                        continue
                    for mb in micro_batches:
                        if (sequences // dp) % mb:
                            continue
                        acc = sequences // dp // mb
                        if pp > 1 and acc < pp:
                            continue
                        for parallel, replicate in ((p, r) for p in PARALLEL for r in replicas(
                                p, dp, cp, tp, gpus_per_node, fixed.get("replicate"))):
                            if parallel == "ddp" and (pp > 1 or tp > 1) or \
                                    parallel in ("zero1", "zero2") and dp != gpus:
                                continue  # the stages split layers (tp, pp) under FSDP2; zero_by_hand is dp alone
                            for ac, sp in ((ac, sp) for ac in costs.AC for sp in (False, True)):
                                if costs.unmodelled_ac(m, ac, cp) is not None or (sp and (
                                        tp == 1 or m.context % (cp * tp))):
                                    continue  # (--sp: the stages' check, tp dividing each cp share)
                                for schedule, v in pipeline_schedules(m.layers, pp, acc, fixed.get("stages_per_rank")):
                                    lay = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, parallel=parallel, micro_batch=mb,
                                                 accumulate=acc, schedule=schedule, stages_per_rank=v, ac=ac, sp=sp,
                                                 precision="bf16", replicate=replicate,
                                                 cp_impl=fixed.get("cp_impl", "ring"))
                                    if all(getattr(lay, k) == value for k, value in fixed.items()):
                                        out.append(lay)
    return out


def pipeline_schedules(layers: int, pp: int, acc: int, asked: int | None = None) -> list[tuple[str, int]]:
    """The schedules (and stages a rank) a pipeline of pp ranks and acc micro-batches is weighed with: 1F1B, and
    interleaved 1F1B at v = 2, 4, the most the blocks allow (a block a stage, or nearly) and the v asked for
    (--stages-per-rank), where the stages' checks let it run (13_pipeline_4d/checks.py: pp x v stages at most the
    blocks; the micro-batches in equal rounds)."""
    if pp == 1:
        return [("1f1b", 1)]
    rounds = max(1, acc // pp)
    return [("1f1b", 1)] + [("interleaved1f1b", v) for v in sorted({2, 4, layers // pp, asked or 1})
                            if v > 1 and pp * v <= layers and acc % rounds == 0]


def replicas(parallel: str, dp: int, cp: int, tp: int, gpus_per_node: int, asked: int | None) -> list[int]:
    """The R (--replicate) a layout is weighed with: 1, and under FSDP2 the HSDP whose shard group fills a node (S x
    cp x tp = the GPUs of a node: the gathers on NVLink, the replicas' all-reduce across nodes), where dp has more
    than one such group; or the R asked for, where it divides dp."""
    out = [1]
    if parallel != "fsdp":
        return out
    if gpus_per_node % (cp * tp) == 0 and (s := gpus_per_node // (cp * tp)) * cp > 1 and dp % s == 0 and dp > s:
        out.append(dp // s)
    if asked is not None and asked not in out and dp % asked == 0 and dp // asked * cp > 1:
        out.append(asked)
    return out


def plan(m: Model, gpus: int, gpu: hardware.GPU, gpus_per_node: int, batch_tokens: int,
         fixed: dict | None = None) -> list[Prediction]:
    """Every layout considered, predicted; those that fit first, fastest first."""
    sequences = batch_tokens // m.context
    node = gpu._replace(gpus_per_node=gpus_per_node)
    preds = [predict(m, lay, node) for lay in layouts(m, gpus, gpus_per_node, sequences, fixed or {})]
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s))


def llama3_predictions(cp_impl: str = "allgather") -> list[tuple[hardware.Run, Prediction]]:
    """Each of Llama 3 405B's published layouts (hardware.LLAMA3_405B_RUNS), micro-batch 1 under FSDP, with sequence
    parallelism (hardware.LLAMA3_405B_TRAINING["tensor_parallelism"]) and its context parallelism
    (["context_parallelism"]: an all-gather, exposed; or, asked, the stages' ring), predicted with the least
    recomputation that fits (--ac none, else selective, else full: what a run would choose)."""
    out = []
    for run in hardware.LLAMA3_405B_RUNS:
        m = replace(costs.PRESETS["llama3-405b"], context=run.sequence)
        fixed = dict(tp=run.tp, pp=run.pp, cp=run.cp, dp=run.dp, micro_batch=1, parallel="fsdp", sp=True, replicate=1,
                     cp_impl=cp_impl)
        preds = [p for ac in ("none", "selective", "full")
                 for p in plan(m, run.gpus, hardware.GPUS["h100"], 8, run.tokens_per_batch, {**fixed, "ac": ac})]
        out.append((run, next((p for p in preds if p.fits), preds[-1])))
    return out


def llama3_rows() -> list[str]:
    """at_scale/README.md's table: llama3_predictions() beside what Llama 3 published."""
    return [f"| {run.gpus:,} | {run.tp} | {run.cp} | {run.pp} | {run.dp} | {run.sequence:,} | "
            f"{run.flops_per_gpu / 1e12:.0f} | {p.flops_per_gpu / 1e12:.0f} "
            f"({p.flops_per_gpu / run.flops_per_gpu - 1:+.0%}) | "
            f"{'yes' if p.fits else 'no'}: {p.memory['total'] / 1e9:.1f} GB, --ac {p.layout.ac} --sp |"
            for run, p in llama3_predictions()]


def model_from(args: argparse.Namespace, p: ArgumentParser) -> Model:
    shape = ("layers", "width", "heads", "vocab", "experts", "top_k")
    if args.model is not None:  # (a shape flag beside a preset would be left unread: said, not ignored)
        for f in (f for f in shape if getattr(args, f) is not None):
            flag = f"--{f.replace('_', '-')}"
            p.error(f"argument {flag}: --model {args.model} sets the shape; leave {flag} out, or give the shape "
                    "flags without --model")
        return replace(costs.PRESETS[args.model], context=args.context)
    missing = [f"--{f}" for f in ("layers", "width", "heads") if getattr(args, f) is None]
    if missing:
        p.error(f"argument --model: give a preset ({', '.join(costs.PRESETS)}) or the shape: {', '.join(missing)}")
    if args.top_k is not None and not args.experts:
        p.error("argument --top-k: the experts a token goes to, and the model has none; give --experts, or leave "
                "--top-k out")
    args.vocab, args.top_k = args.vocab or VOCAB, args.top_k or TOP_K
    m = costs.tutorial_gpt(args.layers, args.width, args.heads, args.context, args.vocab, args.experts or 0,
                           args.top_k)
    if args.width % args.heads:
        p.error(f"argument --heads: {args.heads} does not divide --width {args.width}")
    if args.experts and args.top_k > args.experts:
        p.error(f"argument --top-k: {args.top_k} is more than --experts {args.experts}")
    return m


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="at_scale/plan.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(costs.PRESETS), help="a preset (Llama 3's shapes); or the shape flags")
    p.add_argument("--layers", type=positive(int), help="transformer blocks (the tutorial's GPT)")
    p.add_argument("--width", type=positive(int), help="size of the residual stream")
    p.add_argument("--heads", type=positive(int), help="attention heads per block")
    p.add_argument("--vocab", type=positive(int), help=f"tokens in the vocabulary (default {VOCAB:,}: Llama 3's)")
    p.add_argument("--experts", type=positive(int), help="experts per block (stage 14's mixture)")
    p.add_argument("--top-k", type=positive(int), help=f"experts a token goes to (default {TOP_K})")
    p.add_argument("--gpus", type=positive(int), required=True, help="GPUs in the job")
    p.add_argument("--gpu", choices=list(hardware.GPUS), default="h100", help="the GPU (hardware.py)")
    p.add_argument("--gpus-per-node", type=positive(int), help="GPUs on one NVLink domain (default: the GPU's)")
    p.add_argument("--context", type=positive(int), default=8192, help="tokens per sequence")
    p.add_argument("--global-batch-tokens", type=positive(int), required=True, help="tokens per step, all GPUs")
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        p.add_argument(f"--{dim}", type=positive(int), help=f"only layouts with this {dim} degree")
    p.add_argument("--parallel", choices=PARALLEL, help="only layouts that hold the state so")
    p.add_argument("--replicate", type=positive(int),
                   help="only layouts with R replicas of FSDP2's shards (HSDP, the stages' --replicate; 1: none)")
    p.add_argument("--stages-per-rank", type=positive(int),
                   help="only layouts with this many pipeline stages a rank (the stages' --stages-per-rank: 1 runs "
                        "1F1B, more interleaved 1F1B)")
    p.add_argument("--micro-batch", type=positive(int), help="only layouts with this micro-batch")
    p.add_argument("--ac", choices=costs.AC, help="only layouts with this activation checkpointing (the stages' --ac)")
    p.add_argument("--sp", choices=("yes", "no"),
                   help="only layouts with (yes) or without (no) sequence parallelism (the stages' --sp, with tp)")
    p.add_argument("--cp-impl", choices=("ring", "allgather"),
                   help="cp's attention (the stages' --cp-impl; default ring): the ring's sends hide behind the "
                        "attention, an all-gather of the keys and values first does not (Llama 3's)")
    p.add_argument("--show", type=positive(int), default=10, help="rows of the table")
    p.add_argument("--out", type=Path, help="write plan.json (every layout considered) and plan.png here")
    args = p.parse_args(argv)
    args.model_ = model_from(args, p)
    gpu = hardware.GPUS[args.gpu]
    args.gpus_per_node = args.gpus_per_node or gpu.gpus_per_node
    if args.global_batch_tokens % args.context:
        p.error(f"argument --global-batch-tokens: {args.global_batch_tokens:,} is not a whole number of sequences "
                f"of --context {args.context:,}; use a multiple of it")
    sequences = args.global_batch_tokens // args.context
    for dim in ("dp", "tp", "pp", "cp", "ep"):
        value = getattr(args, dim)
        if value is not None and args.gpus % value:
            p.error(f"argument --{dim}: {value} does not divide --gpus {args.gpus}")
    if args.tp and (args.model_.heads % args.tp or args.model_.kv_heads % args.tp):
        p.error(f"argument --tp: {args.tp} does not divide the {args.model_.kv_heads} (KV) heads")
    if args.ep and not args.model_.experts:
        p.error(f"argument --ep: {args.model_.name} has no experts; give --experts, or leave --ep out")
    if args.ep and args.model_.experts % args.ep:
        p.error(f"argument --ep: {args.ep} does not divide --experts {args.model_.experts} (each ep rank holds as "
                "many experts)")
    if args.tp and args.tp > args.gpus_per_node:
        p.error(f"argument --tp: {args.tp} is more than --gpus-per-node {args.gpus_per_node}; tensor parallelism "
                "stays within a node (its all-reduces come every block)")
    if args.pp and args.pp > args.model_.layers:
        p.error(f"argument --pp: {args.pp} stages for {args.model_.layers} blocks; use at most {args.model_.layers}")
    if args.stages_per_rank and args.stages_per_rank > 1 and args.pp == 1:
        p.error(f"argument --stages-per-rank: {args.stages_per_rank} stages a rank cut a pipeline, and --pp 1 has "
                f"none; use --pp 2 or more, or leave --pp out")
    if args.stages_per_rank and args.stages_per_rank * (args.pp or 2) > args.model_.layers:
        pp = args.pp or 2  # (a pipeline has 2 ranks or more)
        p.error(f"argument --stages-per-rank: {args.stages_per_rank} a rank x pp {pp} = {args.stages_per_rank * pp} "
                f"stages need a block each, and the model has {args.model_.layers}; use at most "
                f"{args.model_.layers // pp}")
    if args.dp and sequences % args.dp:
        p.error(f"argument --dp: {args.dp} does not divide the {sequences:,} sequences of a step")
    if args.replicate and args.replicate > 1:
        if args.parallel not in (None, "fsdp"):
            p.error("argument --replicate: HSDP keeps replicas of FSDP2's shards; use --parallel fsdp or leave "
                    "--parallel out")
        if args.gpus % args.replicate or args.dp and args.dp % args.replicate:
            p.error(f"argument --replicate: {args.replicate} does not divide "
                    + (f"--dp {args.dp}" if args.dp and args.dp % args.replicate else f"--gpus {args.gpus}"))
    if args.out is not None:
        p.check_out_writable(args.out)
    args.fixed = {k: getattr(args, k) for k in ("dp", "tp", "pp", "cp", "ep", "parallel", "micro_batch", "replicate",
                                                "stages_per_rank", "cp_impl") if getattr(args, k) is not None}
    if args.ac is not None:
        if (why := costs.unmodelled_ac(args.model_, args.ac, args.cp or 1)) is not None:
            p.error(f"argument --ac: {why}; choose another --ac or leave it out (costs.unmodelled_ac)")
        args.fixed["ac"] = args.ac
    if args.sp is not None:
        if args.sp == "yes" and args.tp == 1:
            p.error("argument --sp: sequence parallelism splits the sequence over tp; --tp 1 has none (use --tp 2 or "
                    "more, or leave --tp out)")
        args.fixed["sp"] = args.sp == "yes"
    return args


def row(p: Prediction, experts: bool) -> list[str]:
    lay, GB = p.layout, 1e9
    pp = f"{lay.pp}" + (f" x {lay.stages_per_rank}" if lay.stages_per_rank > 1 else "")  # (interleaved: v a rank)
    return [f"{lay.dp}", f"{lay.tp}", pp, f"{lay.cp}"] + ([f"{lay.ep}"] if experts else []) + [
        lay.parallel if lay.replicate == 1 else f"hsdp {lay.replicate}", f"{lay.micro_batch} x {lay.accumulate}",
        lay.ac, "yes" if lay.sp else "no",
        f"{p.memory['total'] / GB:,.1f}", f"{p.seconds['total']:,.2f}", f"{p.tokens_per_s:,.0f}",
        f"{p.flops_per_gpu / 1e12:,.0f}", f"{p.mfu:.0%}"]


def to_json(p: Prediction) -> dict:
    return {"layout": asdict(p.layout), "fits": p.fits, "why_not": p.why_not, "memory_bytes": p.memory,
            "seconds": p.seconds, "tokens_per_s": p.tokens_per_s, "flops_per_gpu": p.flops_per_gpu, "mfu": p.mfu}


MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations")  # (activations: the step's peak beyond the
# state, FSDP's gathered weights and whole gradients included)
TIME_PARTS = ("compute", "tp", "cp", "ep", "pp", "dp", "bubble")


def draw(preds: list[Prediction], gpu: hardware.GPU, title: str, path: Path) -> None:
    """plan.png: the best layouts side by side, each one's memory per GPU (left) and step time (right) broken down."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (mem, time) = plt.subplots(1, 2, figsize=(12, 0.5 * len(preds) + 2), sharey=True)
    labels = [p.layout.describe().replace(", micro-batch", "\nmicro-batch") for p in preds]
    y = range(len(preds))
    for axis, parts, values, unit in ((mem, MEMORY_PARTS, lambda p, k: p.memory[k] / 1e9, "GB per GPU"),
                                      (time, TIME_PARTS, lambda p, k: p.seconds[k], "seconds per step")):
        left = [0.0] * len(preds)
        for part in parts:
            widths = [values(p, part) for p in preds]
            if any(widths):
                axis.barh(y, widths, left=left, label=part)
                left = [a + b for a, b in zip(left, widths, strict=True)]
        axis.set_xlabel(unit)
        axis.legend(ncol=4, fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    mem.axvline(gpu.memory_bytes / 1e9, color="black", linestyle="--", linewidth=1)
    mem.set_yticks(list(y), labels, fontsize=7)
    mem.invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    m, gpu = args.model_, hardware.GPUS[args.gpu]
    preds = plan(m, args.gpus, gpu, args.gpus_per_node, args.global_batch_tokens, args.fixed)
    fit = [p for p in preds if p.fits]
    print(f"{m.name}: {costs.parameters(m):,} parameters, context {m.context:,} | {args.gpus:,} x {gpu.name}, "
          f"{args.gpus_per_node} a node | {args.global_batch_tokens:,} tokens a step "
          f"({args.global_batch_tokens // m.context:,} sequences)")
    print(f"{len(preds):,} layouts considered, {len(fit):,} fit in {gpu.memory_bytes / 1e9:,.0f} GB")
    if not preds:
        asked = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.fixed.items() if k != "sp") + \
            (f" --sp {args.sp}" if "sp" in args.fixed else "")
        # (with flags fixed, theirs is the likelier cause: say them, so the reader knows which to loosen)
        print("no layout: the GPUs do not divide into the degrees the model allows"
              + (f" with {asked} (one at a time, left out, shows which)" if asked else "") + " (see --help)")
    elif not fit:
        best = min(preds, key=lambda p: p.memory["total"])
        print(f"none fits: the least memory is {best.memory['total'] / 1e9:,.1f} GB a GPU "
              f"({best.layout.describe()})")
    else:
        head = ["dp", "tp", "pp", "cp"] + (["ep"] if m.experts else []) + [
            "state", "micro-batch", "ac", "sp", "GB/GPU", "step s", "tokens/s", "TFLOP/s/GPU", "MFU"]
        rows = [row(p, m.experts > 0) for p in fit[:args.show]]
        print_table([head, *rows])
    if args.out is not None:
        (args.out / "plan.json").write_text(json.dumps({
            "model": asdict(m), "parameters": costs.parameters(m), "gpus": args.gpus, "gpu": args.gpu,
            "gpus_per_node": args.gpus_per_node, "global_batch_tokens": args.global_batch_tokens,
            "layouts": [to_json(p) for p in preds]}, indent=1) + "\n")
        if fit:
            draw(fit[:args.show], gpu, f"{m.name} on {args.gpus:,} x {gpu.name}: the {min(args.show, len(fit))} "
                 "fastest layouts that fit", args.out / "plan.png")


if __name__ == "__main__":
    main()
