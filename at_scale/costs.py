"""What one rank of a layout holds, sends and computes in a training step, by formula: the planner's counts.

The formulas follow the GPT stages' code (11-14: which weights tp splits, what FSDP2 gathers and when, what the
pipeline and the ring send), so that they can be checked against simulate.py, which runs that code. The model is a
parameter: the tutorial's GPT (multi-head attention, a GELU MLP, learned positions, LayerNorm with biases) or Llama 3's
(grouped-query attention, a SwiGLU MLP, rotary positions, RMSNorm, no biases). Stdlib only: the planner weighs
thousands of layouts in seconds.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer's shape and architecture."""
    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int  # = heads: multi-head attention; fewer: grouped-query (Llama 3: 8)
    ffn: int  # the MLP's inner width (the tutorial's GPT: 4 x width)
    vocab: int
    context: int  # tokens per sequence
    mlp: str = "gelu"  # "gelu": fc, GELU, proj; "swiglu": (w1 x) * silu(w3 x), then w2
    biases: bool = True  # the tutorial's linear layers and LayerNorms have biases; Llama's have none
    learned_positions: bool = True  # the tutorial's position embedding (a weight); Llama's rotary ones are not
    vocab_over_tp: bool = False  # the embedding and the head split over tp (Megatron, torchtitan); not the stages'
    experts: int = 0  # stage 14: E experts per block in place of the MLP (0: a dense MLP)
    top_k: int = 1

    @property
    def head_size(self) -> int:
        return self.width // self.heads


def tutorial_gpt(layers: int, width: int, heads: int, context: int, vocab: int, experts: int = 0,
                 top_k: int = 1) -> Model:
    """The GPT stages' model at any shape (11_gpt/model.py; 14_experts/ with experts)."""
    return Model("gpt", layers, width, heads, heads, 4 * width, vocab, context, experts=experts, top_k=top_k)


def llama3(name: str, layers: int, width: int, heads: int, ffn: int, context: int = 8192) -> Model:
    """Llama 3's architecture (the Llama 3 paper, Table 3): 8 KV heads, SwiGLU, vocabulary 128,256, untied embeddings.
    Its embedding and head split over tp, as the runs that train it do (Megatron-LM, torchtitan)."""
    return Model(name, layers, width, heads, 8, ffn, 128256, context, mlp="swiglu", biases=False,
                 learned_positions=False, vocab_over_tp=True)


PRESETS = {"llama3-8b": llama3("llama3-8b", 32, 4096, 32, 14336),
           "llama3-70b": llama3("llama3-70b", 80, 8192, 64, 28672),
           "llama3-405b": llama3("llama3-405b", 126, 16384, 128, 53248)}


@dataclass(frozen=True)
class Layout:
    """How the job is split: dp x cp x tp x pp ranks (ep carved from dp x cp), and how the dp x cp ranks hold the
    state: "ddp" a replica each; "zero1" AdamW's moments sharded; "zero2" the gradients too; "fsdp" (ZeRO-3) the
    weights too, each block a unit gathered when it computes (FSDP2, the stages' --parallel fsdp)."""
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    parallel: str = "ddp"
    micro_batch: int = 1  # sequences per micro-batch per dp rank
    accumulate: int = 1  # micro-batches per step (under pp: the pipeline's)
    schedule: str = "1f1b"  # the pipeline's: "1f1b", "gpipe" or "interleaved1f1b" (the stages' --pp-schedule)
    stages_per_rank: int = 1  # interleaved1f1b: v stages a rank, round robin (the stages' --stages-per-rank)
    ac: str = "none"  # activation checkpointing (the stages' --ac): "full", each block keeps its input alone and
    #                   recomputes the rest in backward; "selective", it keeps its matmuls' and attention's outputs too
    sp: bool = False  # sequence parallelism (the stages' --sp, with tp): between the blocks' matmuls the residual
    #                   stream and the norms split by sequence over tp, the head by vocabulary, the loss on its pieces
    precision: str = "float32"  # "float32": everything (the stages' default); "bf16": compute and activations in
    #                             bfloat16, the weights, gradients and AdamW's moments float32 (the stages' --amp bf16)
    replicate: int = 1  # HSDP (the stages' --replicate R, FSDP2 only): dp = R x S; FSDP2 shards over S x cp ranks
    #                     (a node), R replicas of those shards all-reduce their gradient shards once a step
    cp_impl: str = "ring"  # cp's attention (the stages' --cp-impl): "ring" or "allgather", the same bytes a step
    #                        (each rank's keys and values to every other); the ring's hide behind the attention, the
    #                        all-gather's do not (plan.predict, hardware.OVERLAP). Memory counted as the ring's.

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def shard_cp(self) -> int:
        """The ranks one FSDP2 shard group spans: dp x cp, or under HSDP S x cp."""
        return self.dp_cp // self.replicate

    def describe(self) -> str:
        dims = " x ".join(f"{d} {getattr(self, d)}" for d in ("dp", "tp", "pp", "cp", "ep") if getattr(self, d) > 1)
        return f"{dims or 'one rank'} {self.parallel}, micro-batch {self.micro_batch} x {self.accumulate}" + \
            (f", interleaved x {self.stages_per_rank}" if self.stages_per_rank > 1 else "") + \
            (f", --ac {self.ac}" if self.ac != "none" else "") + (", --sp" if self.sp else "") + \
            (f", --replicate {self.replicate}" if self.replicate > 1 else "")


# ─── Parameters: the tensors each rank holds ───────────────────────────────────────────────────────────────────────
# A tensor is (rows, columns, kind): kind "tp" split over tp, "replicated", "expert" (split over ep, never over tp),
# "vocab" (the embeddings and head). FSDP2 shards dim 0 (rows) over dp x cp, padded to a multiple.

def block_tensors(m: Model, tp: int, ep: int) -> list[tuple[int, int, str]]:
    """One block's weights as this rank holds them (13_pipeline_4d/parallelize.py TP_PLAN: q, k, v, fc
    column-wise, the projections row-wise, whose biases stay whole; stage 14: the experts whole on every tp rank)."""
    w, hd = m.width, m.head_size
    q, kv = m.heads * hd // tp, m.kv_heads * hd // tp
    t: list[tuple[int, int, str]] = [(q, w, "tp"), (kv, w, "tp"), (kv, w, "tp"), (w, q, "tp")]
    if m.biases:
        t += [(q, 1, "tp"), (kv, 1, "tp"), (kv, 1, "tp"), (w, 1, "replicated")]
    t += [(w, 1, "replicated")] * (4 if m.biases else 2)  # two norms: weight (and bias)
    if m.experts:  # stage 14: a router [E, width]; E / ep experts of stage 11's MLP, stacked: [e, ffn, width],
        # [e, ffn], [e, width, ffn], [e, width]. Rows are dim 0, the experts: FSDP2 (ep 1) shards whole experts, so
        # at dp x cp above E a rank holds one whole expert of each, padded (experts.py MoE)
        e = m.experts // ep
        return t + [(m.experts, w, "replicated"), (e, m.ffn * w, "expert"), (e, m.ffn, "expert"),
                    (e, w * m.ffn, "expert"), (e, w, "expert")]
    f = m.ffn // tp
    if m.mlp == "swiglu":
        return t + [(f, w, "tp"), (f, w, "tp"), (w, f, "tp")]
    return t + [(f, w, "tp"), (f, 1, "tp"), (w, f, "tp"), (w, 1, "replicated")]


def stage_blocks(layers: int, pp: int, stage: int) -> int:
    """Blocks on pipeline stage `stage` (13_pipeline_4d/pipeline.py: as many each as can be, the first ones one
    more)."""
    size, extra = divmod(layers, pp)
    return size + (stage < extra)


def rank_chunks(m: Model, lay: Layout, rank: int) -> list[int]:
    """The blocks of each pipeline stage rank `rank` of the pipeline holds, in order: one stage, or under
    interleaved1f1b v of pp x v, round robin (13_pipeline_4d/pipeline.py stages_of: r, r + pp, ...)."""
    v = lay.stages_per_rank
    return [stage_blocks(m.layers, lay.pp * v, s) for s in range(rank, lay.pp * v, lay.pp)]


def round_size(acc: int, pp: int) -> int:
    """The micro-batches of one round: interleaved 1F1B runs each round through one of a rank's stages, then the next
    (torch's microbatches_per_round: acc // max(1, acc // pp))."""
    return acc // max(1, acc // pp)


def interleaved_warmup(acc: int, pp: int, v: int, rank: int) -> int:
    """The forwards rank `rank` runs before its first backward under interleaved 1F1B (schedules.py _get_warmup_ops):
    (v - 1) rounds, two more for each rank after this one, at most every forward."""
    return min((v - 1) * round_size(acc, pp) + 2 * (pp - 1 - rank), acc * v)


def held_forwards(lay: Layout, rank: int) -> int:
    """The most forwards (a stage's, a micro-batch's) whose backward has not run that rank `rank` of the pipeline holds
    at once: GPipe every micro-batch; 1F1B pp - rank; interleaved 1F1B its warm-up, then one more, at most every
    forward (13_pipeline_4d/pipeline.py held_at_most reads the same from torch's table)."""
    acc, pp, v = lay.accumulate, lay.pp, lay.stages_per_rank
    if pp == 1:
        return 1
    if lay.schedule == "gpipe":
        return acc
    if v == 1:
        return min(acc, pp - rank)
    return min(interleaved_warmup(acc, pp, v, rank) + 1, acc * v)


def held_blocks(lay: Layout, chunks: list[int], forwards: int) -> int:
    """Blocks' activations held by the first `forwards` forwards of a step on a rank with stages of `chunks` blocks:
    interleaved 1F1B runs a round of micro-batches through each of its stages in turn."""
    if len(chunks) == 1:
        return forwards * chunks[0]
    per_round, v = round_size(lay.accumulate, lay.pp), len(chunks)
    rounds, rest = divmod(max(forwards, 0), per_round)  # whole rounds, stage after stage, then part of one
    return per_round * (rounds // v * sum(chunks) + sum(chunks[:rounds % v])) + rest * chunks[rounds % v]


def interleaved_peak(lay: Layout, chunks: list[int], rank: int, block_bytes: float, send_bytes: float) -> float:
    """Interleaved 1F1B: the most bytes rank `rank` holds at once of its stages' activations (block_bytes a block, from
    a forward to its backward) and of what it sent (send_bytes each: torch's multi-stage runtime keeps every send's
    work, and the work its tensor, to the step's end: schedules.py _PipelineScheduleRuntime, send_ops waited last)."""
    return max(blocks * block_bytes + sends * send_bytes
               for blocks, sends in interleaved_held(lay.accumulate, lay.pp, tuple(chunks), rank))


@functools.cache
def interleaved_held(acc: int, pp: int, chunks: tuple[int, ...], rank: int) -> list[tuple[int, int]]:
    """(blocks' activations, sends) a rank holds after each of its actions, walked in torch's order (schedules.py
    ScheduleInterleaved1F1B: the warm-up's forwards, then a forward and a backward each, then the backwards; a round of
    micro-batches through each stage in turn, the backwards from the last stage down). Only the moments no later one
    holds as many blocks: the sends only grow, so the most bytes come at one of them."""
    v, per_round = len(chunks), round_size(acc, pp)
    warmup = interleaved_warmup(acc, pp, v, rank)
    first, last = rank == 0, rank == pp - 1
    blocks = sends = 0
    moments = []
    for op in range(acc * v + warmup):
        if op < acc * v:  # a forward: its stage's activations held, its output sent (but the model's last stage's)
            c = op // per_round % v
            blocks += chunks[c]
            sends += not (last and c == v - 1)
            moments.append((blocks, sends))
        if op >= warmup:  # a backward: its activations freed, its input gradient sent (but the first stage's)
            c = v - 1 - (op - warmup) // per_round % v
            blocks -= chunks[c]
            sends += not (first and c == 0)
            moments.append((blocks, sends))
    kept, most = [], -1
    for blocks, sends in reversed(moments):
        if blocks > most:
            kept.append((blocks, sends))
            most = blocks
    return kept


def root_tensors(m: Model, tp: int, first: bool, last: bool, sp: bool = False) -> list[tuple[int, int, str]]:
    """The embeddings (first stage), the final norm and the head (last stage). --sp splits the head over tp by
    vocabulary (13_pipeline_4d/parallelize.py SP_AROUND: the loss on its pieces), not the stages' embeddings."""
    v = m.vocab // tp if m.vocab_over_tp else m.vocab
    t: list[tuple[int, int, str]] = []
    if first:
        t += [(v, m.width, "vocab")] + ([(m.context, m.width, "replicated")] if m.learned_positions else [])
    if last:
        t += [(m.width, 1, "replicated")] * (2 if m.biases else 1) + [(head_vocab(m, tp, sp), m.width, "vocab")]
    return t


def head_vocab(m: Model, tp: int, sp: bool) -> int:
    """The head's rows, and the logits' columns, on one rank: split over tp under --sp (or where the model splits
    its vocabulary: Llama 3's runs)."""
    return m.vocab // tp if m.vocab_over_tp or sp else m.vocab


def parameters(m: Model) -> int:
    """The whole model's parameters."""
    return m.layers * sum(r * c for r, c, _ in block_tensors(m, 1, 1)) + \
        sum(r * c for r, c, _ in root_tensors(m, 1, True, True))


def active_parameters(m: Model) -> int:
    """The parameters a token uses: k of the E experts' (all of a dense model's)."""
    if not m.experts:
        return parameters(m)
    expert = sum(r * c for r, c, kind in block_tensors(m, 1, 1) if kind == "expert")
    return parameters(m) - m.layers * expert * (m.experts - m.top_k) // m.experts


def sharded(rows: int, cols: int, n: int) -> int:
    """Elements of one rank's FSDP2 shard of a [rows, cols] tensor over n ranks: dim 0 cut in n, padded. (AdamW's
    moments follow the unpadded shard: the first ranks' is this; the last ranks of a dp larger than a tensor's
    rows / its shard hold less, down to nothing. The formulas count the first ranks': the busiest.)"""
    return math.ceil(rows / n) * cols


@dataclass
class Rank:
    """What one rank of one pipeline stage holds, sends and computes in a step (bytes, FLOPs)."""
    parameters: int
    gradients: int
    optimizer: int
    activation_peak: int
    sent: dict[tuple[str, str], list]  # (kind, dimension) -> [calls, bytes sent]
    flops: float  # of the model (what FlopCounterMode counts; cp's ring: the whole matrix, ring_skipped_flops),
    #               recomputation not included
    recompute_flops: float

    @property
    def state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    def sent_by_dimension(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for (_, dim), (_, b) in self.sent.items():
            out[dim] = out.get(dim, 0.0) + b
        return out


def ring(kind: str, n: int) -> float:
    """Bytes a ring algorithm sends from a rank, per byte of the tensor it hands over (simulate.py RING)."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "reduce_scatter": (n - 1) / n}[kind]


def rank_costs(m: Model, lay: Layout, stage: int = 0) -> Rank:
    """One rank of pipeline stage `stage`: its state, activation peak, bytes sent and FLOPs in one step."""
    check_ac(m, lay)
    first, last = stage == 0, stage == lay.pp - 1
    n = lay.dp_cp  # the ranks that hold copies (DDP) or shards (FSDP2) of the same weights
    s, shards = lay.shard_cp, "shard_cp" if lay.replicate > 1 else "dp_cp"  # FSDP2's shard group (HSDP: S x cp)
    chunks = rank_chunks(m, lay, stage)  # (interleaved: the blocks of each of its stages)
    blocks = sum(chunks)
    per_block = block_tensors(m, lay.tp, lay.ep)
    root = root_tensors(m, lay.tp, first, last, lay.sp)
    whole = [t for t in per_block if t[2] != "expert" or lay.ep == 1]  # what DDP or FSDP2 hold
    own = [t for t in per_block if t[2] == "expert" and lay.ep > 1]  # stage 14: a rank's experts, its own
    f4, act = 4, BYTES["bfloat16" if lay.precision == "bf16" else "float32"]  # state bytes; activations' and sends'
    # the elements of one block's and the root's weights, whole and as FSDP2 shards
    block_elems = sum(r * c for r, c, _ in whole)
    root_elems = sum(r * c for r, c, _ in root)
    own_elems = sum(r * c for r, c, _ in own)
    if lay.parallel == "fsdp":
        block_shard = sum(sharded(r, c, s) for r, c, _ in whole)
        root_shard = sum(sharded(r, c, s) for r, c, _ in root)
    else:
        block_shard, root_shard = block_elems, root_elems
    params = blocks * (block_shard + own_elems) + root_shard  # elements held
    full = blocks * (block_elems + own_elems) + root_elems  # elements of this rank's part before dp sharding
    tensors = blocks * len(per_block) + len(root)
    shard_of_full = math.ceil(full / n)  # ZeRO-1/2's share of the flat state
    grads = {"ddp": full, "zero1": full, "zero2": shard_of_full, "fsdp": params}[lay.parallel]
    opt_elems = 2 * (shard_of_full if lay.parallel in ("zero1", "zero2") else params)
    state_params, state_grads = params * f4, grads * f4
    optimizer = opt_elems * f4 + tensors * 4  # AdamW's two moments, and a float32 step counter per tensor

    # ── bytes sent ──
    sent: dict[tuple[str, str], list] = {}

    def add(kind: str, dim: str, calls: int, tensor_bytes: float, factor: float) -> None:
        if calls:
            row = sent.setdefault((kind, dim), [0, 0.0])
            row[0] += calls
            row[1] += calls * tensor_bytes * factor

    mb, acc = lay.micro_batch, lay.accumulate
    tokens = mb * m.context // lay.cp  # one micro-batch's tokens on this rank
    stream = tokens * m.width  # elements of the residual stream of one micro-batch
    gathered = "bfloat16" if lay.precision == "bf16" else "float32"
    if lay.parallel == "fsdp" and s > 1:
        # FSDP2 (13_pipeline_4d/parallelize.py): a unit per block, the rest the root. Without a pipeline a block is
        # gathered for each micro-batch's forward and again for its backward, the root once a micro-batch (kept
        # from forward to backward); under a pipeline torch's stage keeps the weights gathered from the first
        # backward on (reshard_after_backward off): a block gathered for each forward and once more, the root once.
        block_gathers = acc + 1 if lay.pp > 1 else 2 * acc
        root_gathers = (1 if lay.pp > 1 else acc) if root else 0
        add("all_gather", shards, blocks * block_gathers, block_shard * BYTES[gathered], ring("all_gather", s))
        add("all_gather", shards, root_gathers, root_shard * BYTES[gathered], ring("all_gather", s))
        # each unit's gradient reduce-scattered once a step (the last micro-batch's backward), in float32
        add("reduce_scatter", shards, blocks, block_shard * s * f4, ring("reduce_scatter", s))
        add("reduce_scatter", shards, 1 if root else 0, root_shard * s * f4, ring("reduce_scatter", s))
        # HSDP: then each unit's gradient shard (1/S of it) all-reduced over the R ranks holding the same shard
        # (stage 11's README, tests/test_hsdp.py: P / S elements a step)
        if lay.replicate > 1:
            add("all_reduce", "replicate", blocks, block_shard * f4, ring("all_reduce", lay.replicate))
            add("all_reduce", "replicate", 1 if root else 0, root_shard * f4, ring("all_reduce", lay.replicate))
    elif n > 1:  # DDP: every gradient all-reduced once a step (its buckets); ZeRO-1/2 as zero_by_hand does
        bucket = (full - blocks * own_elems) * f4
        if lay.parallel == "ddp":
            add("all_reduce", "dp_cp", 1, bucket, ring("all_reduce", n))
        else:  # the gradients reduce-scattered, the updated weights all-gathered
            add("reduce_scatter", "dp_cp", 1, bucket, ring("reduce_scatter", n))
            add("all_gather", "dp_cp", 1, bucket / n, ring("all_gather", n))
    if own and lay.dp_cp // lay.ep > 1:  # stage 14: the experts' gradients all-reduced over their replicas
        add("all_reduce", "ep_replicas", blocks * len(own), own_elems / len(own) * f4,
            ring("all_reduce", lay.dp_cp // lay.ep))
    # Experts: stage 14 checkpoints the whole block at ep 1 (its rerun runs to the balancing loss, the block's last
    # op), under --ep the attention alone (its rerun stops before the projection's matmul: no sum over tp again)
    whole_rerun = lay.ac != "none" and not (m.experts and lay.ep > 1)
    if lay.tp > 1 and lay.sp:  # SP_PLAN, per block and micro-batch: the attention's and the MLP's input all-gathered
        # (a rank hands over its t / tp tokens), the row-wise layers' sums reduce-scattered (the whole stream handed
        # over), forward; backward the reverse, 2 + 2 (q, k and v's input gradients summed before one). --ac reruns
        # the forward's all-gathers (full and selective: KEEP keeps the reduce-scatters, not them) and full the
        # attention's reduce-scatter (its rerun stops before the MLP's last matmul). Experts: the attention's alone,
        # 1 + 1 (the MoE takes its rank's tokens as they are), and the rerun's (under --ep outside the checkpoint)
        gathers = (2 if m.experts else 4) + (1 if m.experts else 2) * whole_rerun
        add("all_gather", "tp", blocks * acc * gathers, stream / lay.tp * act, ring("all_gather", lay.tp))
        add("reduce_scatter", "tp", blocks * acc * ((2 if m.experts else 4) + (lay.ac == "full" and whole_rerun)),
            stream * act, ring("reduce_scatter", lay.tp))
        # Around the blocks, each micro-batch (SP_AROUND): the first stage's embeddings hand back their outputs'
        # gradients all-gathered (the tokens', the positions'); the last all-gathers the head's input forward and
        # reduce-scatters its gradient, and the loss on the logits' pieces all-reduces three numbers a token
        # (loss_parallel: the max, the sum of exponentials, the target's logit; float32).
        add("all_gather", "tp", acc * ((1 + m.learned_positions) * first + last), stream / lay.tp * act,
            ring("all_gather", lay.tp))
        add("reduce_scatter", "tp", acc * last, stream * act, ring("reduce_scatter", lay.tp))
        add("all_reduce", "tp", acc * 3 * last, tokens * 4, ring("all_reduce", lay.tp))
        # The norms' weight gradients, a part on each tp rank (its tokens'), summed over tp: once a step, when
        # FSDP2 reduces the gradients (split_over_tp says why).
        norms = blocks * (4 if m.biases else 2) + last * (2 if m.biases else 1)
        add("all_reduce", "tp", norms, m.width * f4, ring("all_reduce", lay.tp))
        for elems in summed_over_tp(m, lay):  # experts: the routers' and the experts' gradients, tensor by tensor
            add("all_reduce", "tp", blocks, elems * f4, ring("all_reduce", lay.tp))
    elif lay.tp > 1:  # per block and micro-batch: two all-reduces forward, four backward (TP_PLAN); experts: 1 + 3.
        # --ac full reruns the forward in backward up to the MLP's last matmul (torch's checkpoint stops there): the
        # attention's row-wise all-reduce once more. (selective keeps the all-reduce's output: KEEP.)
        per = (6 if not m.experts else 4) + (lay.ac == "full" and whole_rerun)
        add("all_reduce", "tp", blocks * acc * per, stream * act, ring("all_reduce", lay.tp))
    if lay.cp > 1:  # the ring (context_parallel.py): forward, keys and values each hop but the last; backward, the
        # same, and their gradient (float32 at least) every hop
        kv = 2 * tokens * m.kv_heads * m.head_size // lay.tp
        for kind, factor in (("send", 1), ("recv", 0)):  # (a receive sends nothing: counted by its calls)
            # (--ac reruns the forward's hops in backward: RingAttention is one autograd Function, recomputed whole;
            # selective too, its sends being no op KEEP names)
            add(kind, "cp", blocks * acc * (2 + (lay.ac != "none")) * (lay.cp - 1), kv * act, factor)
            add(kind, "cp", blocks * acc * lay.cp, kv * max(act, 4), factor)
    if lay.pp > 1:  # the residual stream forward to the next stage, its gradient back to the previous one
        for kind, factor in (("send", 1), ("recv", 0)):
            # (interleaved: each of its v stages sends to the next rank and back, but the first and the last)
            add(kind, "pp", acc * (2 * len(chunks) - first - last), stream // (lay.tp if lay.sp else 1) * act, factor)
    # The gradient's norm (parallelize.py clip_gradients): a float32 number summed over each mesh its DTensor
    # gradients lie on (FSDP2's dp x cp; tp's layers' dp x cp and tp), then over the pipeline's stages.
    # (--sp: the norms and the head lie on both meshes too: the dp x cp mesh alone holds the first stage's embeddings)
    # (experts: the routers, plain weights under FSDP2, lie on the dp x cp mesh alone on every stage)
    if lay.parallel == "fsdp":  # (HSDP: over the shard group; the replicas' gradients are equal)
        add("all_reduce", shards, 1 + (lay.tp > 1 and (first or not lay.sp or m.experts > 0)), 4,
            ring("all_reduce", s))
    add("all_reduce", "tp", int(lay.tp > 1), 4, ring("all_reduce", lay.tp))
    add("all_reduce", "pp", int(lay.pp > 1), 4, ring("all_reduce", lay.pp))
    if m.experts and lay.ep > 1:  # every token's k rows to their experts and back, forward and backward: an even load
        # leaves (ep - 1) / ep of them off this rank
        rows = tokens // (lay.tp if lay.sp else 1) * m.top_k * (lay.ep - 1) / lay.ep  # (--sp: its own tokens')
        add("all_to_all", "ep", blocks * acc * 4, rows * m.width * act, 1)
        # first the counts of rows each rank will receive (E int64 numbers); the norm over the experts' ep mesh
        add("all_to_all", "ep", blocks * acc, m.experts * 8, (lay.ep - 1) / lay.ep)
        add("all_reduce", "ep", 1, 4, ring("all_reduce", lay.ep))
    if m.experts:  # the balancing loss's load, counted over the micro-batch's dp x cp ranks (--balance batch), and
        # under --sp over tp (each tp rank routed its own tokens); again where the MoE is rerun (ep 1's checkpoint)
        for dim, size in (("dp_cp", n), ("tp", lay.tp if lay.sp else 1)):
            if size > 1:
                add("all_reduce", dim, blocks * acc * (1 + whole_rerun), m.experts * 4, ring("all_reduce", size))

    # ── activations ── (per block and micro-batch, in units of the residual stream: Korthikanti et al. 2022's count,
    # redone for this code: no dropout, attention by a fused kernel that keeps no score matrix)
    kept = block_kept_units(m, lay.tp, lay.ac, lay.sp, lay.cp, ep=lay.ep)
    saved_block = stream * act * kept + ring_kept_bytes(m, lay)
    in_flight = held_forwards(lay, stage)

    def held(forwards: int) -> int:  # the blocks' activations that many forwards hold
        return held_blocks(lay, chunks, forwards)

    if len(chunks) > 1:  # and under interleaving what a rank sent on, held to the step's end (the one-stage schedules
        # wait on each send at once)
        peak = interleaved_peak(lay, chunks, stage, saved_block, stream // (lay.tp if lay.sp else 1) * act)
    else:
        peak = held(in_flight) * saved_block
    # A checkpointed block's backward first rebuilds what it did not keep: one block's worth, beside the rest.
    rebuilt = stream * act * block_recomputed_units(m, lay.tp, lay.ac, lay.sp, ep=lay.ep)
    if lay.ac == "selective" and lay.cp > 1:  # and the ring's output (float32 at least), which KEEP does not name
        rebuilt += stream / lay.tp * max(act, 4)
    if lay.ac == "full" and m.experts and lay.ep == 1:  # (under --ep nothing rebuilt at the peak: the attention's)
        # and it starts at the MoE's end: beside the rebuilt block, the gradient arriving, the ones made for the
        # experts' outputs and for their inner layer's (k rows a token: k, k ffn / width), before the weights'
        moe_start = stream * act * (1 + m.top_k * (1 + m.ffn / m.width) / (lay.tp if lay.sp else 1))
    elif lay.ac == "full" and not m.experts:  # and it starts at the MLP's last matmul: beside the rebuilt block, the
        # gradient arriving, the one made for the matmul's input (ffn / width / tp) and its weight's (ffn x width /
        # tp; under FSDP2 the unit's whole gradient, counted below)
        rebuilt += stream * act * (1 + m.ffn / m.width / lay.tp)
        if not (lay.parallel == "fsdp" and s > 1):
            rebuilt += m.ffn * m.width // lay.tp * act
    last_terms = 0
    if last:  # the final norm's and the head's inputs; the loss's backward: log-softmax's output, the gradient it
        # receives and the one it makes, three [tokens, vocab] in float32. Under a pipeline the loss is computed as
        # each micro-batch's forward ends, and torch's stage keeps its output, the logits, for its backward: two
        # such tensors a micro-batch in flight, and the two gradients.
        v = head_vocab(m, lay.tp, lay.sp)
        logits = 1 if len(chunks) > 1 else in_flight  # (interleaved: the last stage runs each backward at once)
        loss = (2 * logits + 2 if lay.pp > 1 else 3) * tokens * v * 4
        if lay.parallel != "fsdp":  # or, later, the head's backward: the logits' gradient, and the head's weight
            # gradient made whole before DDP copies it into its bucket (float32)
            loss = max(loss, tokens * v * 4 + v * m.width * 4)
        last_terms = (1 + (1 / lay.tp if lay.sp else 1)) * stream * act + loss  # (--sp: the norm's input split)
        if lay.sp:  # loss_parallel works on the logits' pieces, [tokens, vocab / tp]. While it runs, the rank holds
            # its logits (a piece a micro-batch in flight, two under a pipeline) and two [tokens, vocab] whole, as
            # torch's memory trackers count them: DTensor infers the output shape of log-softmax and of its backward
            # on the whole tensor (seen in the simulation: aten._log_softmax and nll_loss_backward on [tokens, vocab],
            # the local ops on [tokens, vocab / tp]). Whether a GPU's allocator holds those two is not checked here;
            # counted, the planner may overstate the last stage by 8 bytes a token and vocabulary entry.
            at_loss = held(in_flight) * saved_block + last_terms - loss + \
                (2 * logits if lay.pp > 1 else 1) * tokens * v * 4 + 2 * tokens * m.vocab * 4
    # Experts: a block's MoE backward makes each expert's weight gradient, then stacks them into the [e, ...] one:
    # both layers' per expert and one stacked, EXPERT_GRADIENTS e ffn x width at once (under --ep a rank's own
    # experts, plain tensors beside DDP or FSDP2: float32; at ep 1 in FSDP2's units: as they were gathered; under
    # DDP the .grad comes after). By then the MoE's backward has used up what it saved (block_mlp_units); held: the
    # gradient arriving and its rows' (k).
    stacked = 0
    if m.experts:
        grad_bytes = BYTES[gathered] if lay.parallel == "fsdp" and lay.ep == 1 else f4
        stacked = EXPERT_GRADIENTS * m.experts // lay.ep * m.ffn * m.width * grad_bytes + \
            int(((m.top_k + 1) / (lay.tp if lay.sp else 1) - block_mlp_units(m, lay.tp, lay.sp)) * stream * act)
        if lay.ac == "full" and lay.ep == 1:
            stacked = max(stacked, int(moe_start))
    # The loss's tensors are gone before the last block's backward rebuilds anything (--ac) or makes the experts'
    # gradients, and before cp's ring is run back; experts_add: what those gradients add to the peak
    ring_back, held_now = ring_backward_bytes(m, lay), peak  # (the ring's moment: counted apart, below)
    peak += max(rebuilt + stacked, last_terms)
    experts_add = max(rebuilt + stacked, last_terms) - max(rebuilt, last_terms)
    if lay.parallel == "fsdp" and s > 1:
        g = BYTES[gathered]
        # Without a pipeline (--sp: at_loss, below) the loss comes as the forward ends, every block resharded: the
        # root alone gathered beside its tensors (at_loss_gathered); the blocks' moments come after, without them
        loss_apart = lay.pp == 1 and not lay.sp
        lt = 0 if loss_apart else last_terms
        peak_blocks = held_now + max(rebuilt + max(stacked, 0), lt) if lay.pp == 1 else peak
        # the head's (and the final norm's) whole gradient, made as the backward begins
        head = sum(r * c for r, c, _ in root_tensors(m, lay.tp, False, True, lay.sp)) * f4
        # what FSDP2 gathers, and holds whole gradients of: not a rank's own experts (under --ep, its own, plain
        # tensors whose gradients are state: counted there)
        unit_elems = full - blocks * own_elems
        # The peak is at the start of the backward: the root gathered (kept from forward to backward), the block at
        # work and the next (prefetched), and every unit's whole gradient while they accumulate (over micro-batches
        # or the pipeline's), else the one block's being reduce-scattered. Or, with little activation, at the
        # root's all-gather: its buffer and the gathered copy, two roots' worth.
        # (a unit's reduce-scatter takes s shards, padded as gathered_now: beside whole gradients, the padding)
        grads_whole = (unit_elems + s * block_shard - block_elems) * f4 if acc > 1 or lay.pp > 1 else \
            s * block_shard * f4
        if m.experts and acc == 1 and lay.pp == 1:  # as each block's MoE backward stacks the experts' gradients
            # (in backward order), beside them: the head's whole gradient (and the final norm's: made first, kept to
            # the root's reduce-scatter at the end); from the second block on, the reduce-scatter's input of the
            # block before (FSDP2 frees it as it starts the next), that block's activations gone; the next block's
            # gather (prefetched), but at the last (block 0: one fewer gathered, its activations alone held). Or the
            # loss's tensors; or a block's reduce-scatter as it starts, the next one gathered, its activations gone.
            moments = [lt, stacked + head, head + grads_whole - saved_block]
            if blocks > 1:
                moments.append(stacked + head + grads_whole - s * block_shard * g - (blocks - 1) * saved_block)
            if blocks > 2:
                moments.append(stacked + head + grads_whole - saved_block)
            grads_whole = max(moments) - max(stacked, lt)
        # Or, on a pipeline's first stage, at the end of a micro-batch's backward: the embeddings' backward makes a
        # dense gradient of each whole table before adding it in. The stage's weights are all gathered by then (kept
        # so from the first backward on), and its whole gradients too, the embeddings' from the second backward on;
        # beside it the micro-batches still in flight (1F1B: fewer as the step ends) and the gradient arriving.
        at_table = 0
        if first and lay.pp > 1:
            table = (m.vocab // (lay.tp if m.vocab_over_tp else 1) + m.context * m.learned_positions) * m.width * f4
            others = [(in_flight - 1, unit_elems - root_elems)] + \
                ([(min(in_flight, acc - 1) - 1, unit_elems)] if acc > 1 else [])
            if len(chunks) > 1:  # (interleaved: the first stage's backwards come while the warm-up's forwards of the
                # others are still held, its tables' gradients whole from its first backward on)
                others = [(in_flight - 1, unit_elems)]
            at_table = max(held(n) * saved_block + grads * f4 for n, grads in others) + unit_elems * g + table + \
                stream * act
        # (a unit's all-gather fills s shards, padded: where s does not divide a tensor's rows, more than the
        # tensor; stage 14's experts under FSDP2 are rows of a [E, ...] tensor: s above E gathers s / E times them).
        # Two blocks' worth: the block at work and the next, prefetched, or a block's gather and its copy-out. A
        # stage of one block has neither while its MoE's backward stacks the experts' gradients: the larger moment.
        gathered_now = (root_elems + 2 * s * block_shard) * g
        if blocks == 1:
            gathered_now -= min(s * block_shard * g, experts_add)
        at_ring = 0
        if lay.pp > 1:  # Under a pipeline the busiest backward is the first, with every micro-batch in flight and
            # the gradients still to make (the block's at work; the last stage's root's, made first), or the second,
            # the gradients whole by then, with the micro-batches still in flight (as many, once the step has more
            # micro-batches than the pipeline holds; one fewer where it has just as many)
            firsts = [(in_flight, (block_elems + last * root_elems) * f4)] + \
                ([(min(in_flight, acc - 1), unit_elems * f4)] if acc > 1 else [])
            at_blocks = max(peak - (held(in_flight) - held(n)) * saved_block + grads for n, grads in firsts)
            if ring_back:  # (cp: the ring run back, a stage of one block gathering no other meanwhile)
                at_ring = max(held_now + ring_back - (held(in_flight) - held(n)) * saved_block + grads
                              for n, grads in firsts) + gathered_now - (s * block_shard * g if blocks == 1 else 0)
        else:
            at_blocks = peak_blocks + grads_whole
        # Interleaved, a rank's stages take turns: a stage's forwards run while its others, after their first
        # backward, keep their weights gathered and their gradients whole. Counted at the worst: the most the rank
        # holds of activations and sends (interleaved_peak) beside all of its stages' weights and gradients whole.
        interleaved = peak + unit_elems * (f4 + g) if len(chunks) > 1 else 0
        # Or, without a pipeline, as the backward ends: the root gathered, its whole gradient made (the embeddings'
        # last) beside the gradient arriving, and every unit's whole gradient if they accumulate
        at_end = root_elems * g + stream * act + (unit_elems if acc > 1 else root_elems) * f4 if lay.pp == 1 else 0
        at_loss_gathered = held_now + last_terms + root_elems * g + \
            (unit_elems * f4 if acc > 1 else 0) if loss_apart else 0
        # Or, with cp, as a block's attention is run back (ring_backward_bytes): beside it the block's weight
        # gradients made so far (all but q, k, v's and the first norm's), the head's whole one (one micro-batch) or
        # every unit's (more); from the second block on, the reduce-scatter's input of the block before, whose
        # activations are gone
        if ring_back and lay.pp == 1:
            qkv = sum(r * c for r, c, _ in per_block[:3]) + (sum(r for r, _, _ in per_block[4:7]) if m.biases else 0)
            made = (block_elems - qkv - m.width * (2 if m.biases else 1)) * g
            beside = head if acc == 1 else (unit_elems + s * block_shard - block_elems) * f4
            at_ring = held_now + ring_back + made + beside + gathered_now
            if acc == 1 and blocks > 1:
                at_ring += max(0, s * block_shard * f4 - saved_block)
        peak = max(at_blocks + gathered_now, at_table, interleaved, at_end, at_loss_gathered, at_ring,
                   2 * root_elems * g + (unit_elems * f4 if acc > 1 and lay.pp == 1 else 0))
        if lay.sp and last:  # (at the loss: the root gathered, no block; the gradients accumulating, if they do)
            # (interleaved: the rank's other stages, after their first backward, kept gathered: all of it)
            at_loss += (unit_elems if len(chunks) > 1 else root_elems) * g + \
                (unit_elems * f4 if acc > 1 or lay.pp > 1 else 0)
    else:  # DDP: the ring run back beside the blocks' activations
        peak = max(peak, held_now + ring_back)
    if lay.sp and last:
        peak = max(peak, at_loss)
    # ── FLOPs ── (FlopCounterMode's: a matmul 2mnk forward, twice that backward; attention the whole score matrix,
    # 2.5 times that backward)
    flops = model_flops(m, lay, blocks, first, last)
    recompute = recomputed_flops(m, lay, blocks)
    return Rank(state_params, state_grads, optimizer, int(peak), sent, flops, recompute)


def block_activation_units(m: Model, tp: int, sp: bool = False) -> float:
    """Bytes a block saves for its backward, in units of its input (the residual stream): the two norms' inputs and
    outputs (4, whole on every tp rank), and this rank's heads' q, k and v, the attention's output and the
    projection's input (a copy: 5 / tp), the MLP's two inner activations (8 / tp; SwiGLU's w1 x, w3 x, silu(w1 x) and
    their product: 4 ffn / width / tp)."""
    return block_norm_units(m, tp, sp) + block_attention_units(m, tp) + block_mlp_units(m, tp, sp)


def block_norm_units(m: Model, tp: int, sp: bool = False) -> float:
    """The two norms' inputs and outputs a block saves, in units of its input. --sp: the norms' inputs split over tp
    (2 / tp); their outputs all-gathered, as q, k, v's and the MLP's input, are kept whole by those matmuls (torch
    saves a matmul's input as it is: Korthikanti et al. keep it split and all-gather it again in backward). With
    experts the MoE takes norm2's output as it is, split (SP_PLAN's "moe"): only norm1's is gathered."""
    if not sp:
        return 4.0
    return 1 + 3 / tp if m.experts else 2 + 2 / tp


def block_attention_units(m: Model, tp: int) -> float:
    """This rank's heads' q, k and v, the attention's output and the projection's input (a copy), in units of the
    block's input."""
    return (1 + 2 * m.kv_heads * m.head_size / m.width + 2) / tp


def block_mlp_units(m: Model, tp: int, sp: bool = False) -> float:
    """What the MLP saves, in units of the block's input: GELU's input and output (2 ffn / width / tp; SwiGLU's w1 x,
    w3 x, silu(w1 x) and their product: 4 ffn / width / tp). Experts: each token's k rows gathered for them, the
    inner layer's output (its bias added: a matmul and an add) and GELU's, and the experts' outputs concatenated (the
    gates' product needs them), whole on every tp rank; --sp: of the rank's own t / tp tokens."""
    w = m.width
    if m.experts:
        return m.top_k * (2 * m.ffn / w + 2) / (tp if sp else 1)
    return (4 if m.mlp == "swiglu" else 2) * m.ffn / w / tp


AC = ("none", "full", "selective")  # activation checkpointing, as the stages' --ac
# A rank's own experts' weight gradients held at once as a block's MoE backward makes them (14_experts/experts.py:
# each expert's two, then each layer's stacked into its [e, ...] .grad): both layers' per expert, one stacked
EXPERT_GRADIENTS = 3


def unmodelled_ac(m: Model, ac: str, cp: int) -> str | None:
    """Why these formulas do not model --ac `ac` for this model at this cp (None: they do). plan.py leaves such
    layouts out and refuses them as flags; rank_costs raises. (Every --ac is modelled, with experts too: stage 14's
    whole block at ep 1, its attention alone under --ep; --sp with experts too, each tp rank routing its own tokens.)"""
    if ac not in AC:
        return f"--ac {ac}: none, full or selective"
    return None


def check_ac(m: Model, lay: Layout) -> None:
    if (why := unmodelled_ac(m, lay.ac, lay.cp)) is not None:
        raise ValueError(why)
    if lay.sp and lay.tp == 1:
        raise ValueError("--sp splits the sequence over tp: it needs tp 2 or more")
    if lay.replicate > 1 and (lay.parallel != "fsdp" or lay.dp % lay.replicate):
        raise ValueError(f"--replicate {lay.replicate}: HSDP replicates FSDP2's shards, R dividing dp {lay.dp}")


def ring_kept_bytes(m: Model, lay: Layout) -> float:
    """What --ac selective keeps inside cp's ring, a block and micro-batch, beside block_kept_units: KEEP names the
    matmuls, and the ring's are matmuls too (context_parallel.py RingAttention.forward: bmm's under torch.matmul).
    The zigzag split gives a rank 2 cp chunks of t / (2 cp) tokens: its two query chunks see 2 cp + 1 key chunks (chunk
    r the r + 1 up to it, chunk 2 cp - 1 - r the 2 cp - r), and each pair keeps its scores [heads / tp, chunk, chunk]
    and their product with the values [heads / tp, chunk, head size], float32 at least (the ring's sums)."""
    if lay.ac != "selective" or lay.cp == 1:
        return 0.0
    chunk = m.context // (2 * lay.cp)
    pairs = 2 * lay.cp + 1
    return lay.micro_batch * pairs * m.heads // lay.tp * chunk * (chunk + m.head_size) * \
        max(BYTES["bfloat16" if lay.precision == "bf16" else "float32"], 4)


def ring_backward_bytes(m: Model, lay: Layout) -> float:
    """What cp's ring backward (context_parallel.py RingAttention.backward) holds beside the blocks' activations, as a
    block's attention is run back: up to six [heads / tp, chunk, chunk] tensors of a pair of chunks at once (float32
    at least: the last pair's scores, probabilities, their gradients, and the next pair's product and scores), the
    stacked keys and values, the next hop's, and their float32 gradient pieces (dkv, part: each 2 kv / tp streams),
    dq, the gradient arriving (q / tp) and the residual stream's (1; --sp: split). Under --ac full also what the
    block rebuilt for it (norm1's output, whole: q, k, v's input; q, k, v and the output); without checkpointing
    those are held already and the block's MLP and second norm are used up by then; selective: counted as none."""
    if lay.cp == 1:
        return 0.0
    act = BYTES["bfloat16" if lay.precision == "bf16" else "float32"]
    wide = max(act, 4)
    tokens = lay.micro_batch * m.context // lay.cp
    stream = tokens * m.width
    q = m.heads * m.head_size / m.width / lay.tp  # in residual streams
    kv = 2 * m.kv_heads * m.head_size / m.width / lay.tp  # keys and values
    chunk = m.context // (2 * lay.cp)
    pairs = 6 * lay.micro_batch * m.heads // lay.tp * chunk * chunk * wide
    units = ((1 / lay.tp if lay.sp else 1) + q) * act + (2 * kv) * act + (q + 2 * kv) * wide
    if act < wide:  # (the float32 copies of q, the gradient arriving and each block of keys and values)
        units += (2 * q + kv) * wide
    if lay.ac == "full":
        units += ((1 + 1 / lay.tp if lay.sp else 1) + 2 * q + kv) * act
    elif lay.ac == "none":
        units -= (block_norm_units(m, lay.tp, lay.sp) / 2 + q + block_mlp_units(m, lay.tp, lay.sp)) * act
    return pairs + units * stream


def block_kept_units(m: Model, tp: int, ac: str, sp: bool = False, cp: int = 1, ep: int = 1) -> float:
    """What a block keeps for its backward under --ac, in units of its input. full: the input alone. selective
    (parallelize.py KEEP): the input, and the outputs of its matmuls and attention: q, k, v and the attention's
    (this rank's heads: (2 + 2 kv) / tp), the projection's (whole, its partial sum; under tp its all-reduced sum
    too), the MLP's inner matmul (ffn / width / tp; SwiGLU's two) and outer one (as the projection). The norms,
    GELU and the adds are recomputed from those. (At tp 4 and more selective keeps more than none: the row-wise
    layers' sums are whole on every tp rank, and none keeps neither.) --sp: the input and the reduce-scatters' outputs
    are split over tp. cp: the ring's output is no op KEEP names (rebuilt); its matmuls are (ring_kept_bytes).
    Experts (stage 14's checkpointed): at ep 1 the whole block; under --ep the attention alone, whose input (norm1's
    output) the norms count: the norms and the MoE keep what they keep under none."""
    if ac == "none":
        return block_activation_units(m, tp, sp)
    kv = m.kv_heads * m.head_size / m.width
    # the row-wise layer's output, and the all-reduce's (--sp: the reduce-scatter's, its t / tp tokens)
    rowwise = (1 + 1 / tp if sp else 2) if tp > 1 else 1
    attention = 1 / tp if cp == 1 else 0  # (cp's ring is no op KEEP names: its output is rebuilt, ring_kept_bytes)
    if m.experts and ep > 1:  # (full: nothing of the attention's; selective: its matmuls', the attention's, the sum's)
        kept = 0 if ac == "full" else (1 + 2 * kv) / tp + attention + rowwise
        return block_norm_units(m, tp, sp) + kept + block_mlp_units(m, tp, sp)
    if ac == "full":  # (--sp: its input is split over tp)
        return 1 / tp if sp else 1.0
    if m.experts:  # the MoE's matmuls' outputs: the router's (E a token), the experts' inner and outer layers' before
        # their biases are added (k rows a token: k ffn / width, k); no row-wise layer, no sum over tp
        moe = m.experts / m.width + m.top_k * (m.ffn / m.width + 1) / (tp if sp else 1)
        return (1 / tp if sp else 1) + (1 + 2 * kv) / tp + attention + rowwise + moe
    inner = (2 if m.mlp == "swiglu" else 1) * m.ffn / m.width / tp
    return (1 / tp if sp else 1) + (1 + 2 * kv) / tp + attention + rowwise + inner + rowwise


def block_recomputed_units(m: Model, tp: int, ac: str, sp: bool = False, ep: int = 1) -> float:
    """What a checkpointed block rebuilds for its backward, held beside what it kept, in units of its input. full:
    all it did not keep (its forward but the MLP's output). selective: what KEEP leaves out: the two norms' outputs
    and the residual sum between attention and MLP (whole on every tp rank: 3), the attention's output reshaped for
    the projection (1 / tp), GELU's output (ffn / width / tp; SwiGLU's silu(w1 x) and the product: twice that).
    Experts under --ep: the attention alone is rebuilt, after the block's MoE has freed more in its backward (its
    k rows a token, 2 k (ffn / width + 1)) than the attention rebuilds (5 / tp at most): never the busiest moment."""
    if ac == "none" or m.experts and ep > 1:
        return 0.0
    if ac == "full":
        return block_activation_units(m, tp, sp) - block_kept_units(m, tp, ac, sp)
    if m.experts:  # the norms' outputs and the residual sum (--sp: split, 3 / tp, and norm1's output gathered for q,
        # k and v), the attention's output reshaped, and all the MoE saves: none of it a matmul's output (the rows
        # gathered, the layers' outputs with their biases added, GELU's, the experts' outputs concatenated)
        return (3 / tp + 1 if sp else 3) + 1 / tp + block_mlp_units(m, tp, sp)
    # (--sp: the norms' outputs and the residual sum split over tp, 3 / tp; the norms' outputs all-gathered for q, k,
    # v and the MLP, whole: 2, an all-gather being no matmul)
    return (3 / tp + 2 if sp else 3) + 1 / tp + (2 if m.mlp == "swiglu" else 1) * m.ffn / m.width / tp


def summed_over_tp(m: Model, lay: Layout) -> list[int]:
    """--sp with experts: the elements of each of a block's router and experts' gradients a rank sums over tp after
    backward, by hand (parallelize.py sum_over_tp: each tp rank routed its own tokens, its gradient a part), as the
    rank holds them: FSDP2's shard (ep 1), or its own experts whole (under --ep, left out of FSDP2)."""
    if not (m.experts and lay.sp and lay.tp > 1):
        return []
    return [r * c if kind == "expert" and lay.ep > 1 or lay.parallel != "fsdp" else sharded(r, c, lay.shard_cp)
            for r, c, kind in block_tensors(m, lay.tp, lay.ep)[-5:]]  # (the router, then the experts' four)


def recomputed_flops(m: Model, lay: Layout, blocks: int) -> float:
    """FLOPs a step spends again in backward: full, a forward of every block but its last matmul (torch's
    checkpoint stops once it has rebuilt what backward needs, and nothing needs the MLP's output); selective,
    none (what it recomputes is not a matmul). Experts: at ep 1 the whole block's forward (the gates' product needs
    the experts' outputs, the balancing loss comes last); under --ep the attention's but its projection."""
    if lay.ac != "full":
        return 0.0
    tokens = lay.micro_batch * m.context // lay.cp * lay.accumulate
    if m.experts and lay.ep > 1:
        return blocks * (2 * tokens * sum(r * c for r, c, _ in block_tensors(m, lay.tp, lay.ep)[:3]) +
                         attention_flops(m, lay))
    forward = flops_forward_blocks(m, lay, blocks) + blocks * attention_flops(m, lay)
    if m.experts:
        return forward
    return forward - blocks * 2 * tokens * m.width * m.ffn // lay.tp


def flops_forward_blocks(m: Model, lay: Layout, blocks: int) -> float:
    """Forward FLOPs of this rank's blocks' matmuls with their weights in one step (every micro-batch); the attention
    apart (attention_flops)."""
    tokens = lay.micro_batch * m.context // lay.cp * lay.accumulate
    w = m.width
    dense = 2 * tokens * sum(r * c for r, c, kind in block_tensors(m, lay.tp, 1)
                             if c > 1 and kind != "replicated" and kind != "expert")
    if m.experts:  # (--sp: each tp rank routes its own t / tp tokens)
        routed = tokens // (lay.tp if lay.sp else 1)
        dense += 2 * routed * w * m.experts  # the router
        dense += 2 * routed * m.top_k * 2 * w * m.ffn  # k experts a token
    return blocks * dense


def attention_flops(m: Model, lay: Layout) -> float:
    """One block's attention forward in a step, q k^T and p v: the whole score matrix (as torch counts a fused
    kernel), this rank's heads; under cp its rows' share, as if the ring computed every pair (ring_skipped_flops)."""
    return 4 * lay.micro_batch * lay.accumulate * (m.heads // lay.tp) * (m.context // lay.cp) * m.context * \
        m.head_size


def ring_skipped_flops(m: Model, lay: Layout, blocks: int) -> float:
    """What the formulas count of cp's ring that it does not compute (so that cp weighs its attention as one fused
    kernel is counted, the causal mask's hidden half too): context_parallel.py's RingAttention computes the visible
    pairs of chunks alone, a rank's two chunks of t / (2 cp) queries seeing 2 cp + 1 key chunks of the 4 cp counted,
    forward, backward and (--ac full) forward again. What FlopCounterMode counts of the step is the formulas' count
    less this."""
    if lay.cp == 1:
        return 0.0
    skipped = 1 - (2 * lay.cp + 1) / (4 * lay.cp)
    return skipped * blocks * attention_flops(m, lay) * (1 + ATTENTION_BACKWARD + (lay.ac == "full"))


# An attention's backward over its forward: it computes the scores again, then the gradients of the scores, of q, of k
# and of v: 5 matmuls to the forward's 2 (torch's sdpa_backward_flop_count; the ring's backward the same, block by
# block). A weight's matmul: 2, its input's gradient and its weight's.
ATTENTION_BACKWARD, MATMUL_BACKWARD = 2.5, 2


def model_flops(m: Model, lay: Layout, blocks: int, first: bool, last: bool) -> float:
    """FLOPs of one step on this rank: forward and backward of its blocks and head (a weight's matmul's backward
    twice its forward, the attention's 2.5 times)."""
    tokens = lay.micro_batch * m.context // lay.cp * lay.accumulate
    head = 2 * tokens * m.width * head_vocab(m, lay.tp, lay.sp) if last else 0
    return (1 + MATMUL_BACKWARD) * (flops_forward_blocks(m, lay, blocks) + head) + \
        (1 + ATTENTION_BACKWARD) * blocks * attention_flops(m, lay)

