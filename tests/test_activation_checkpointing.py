"""Activation checkpointing on the GPT stages (--ac none|full|selective, parallelize.checkpointed): backward gets the
same gradients, keeps the bytes a formula says, and recomputes what the mode says, on every layout it combines with.

In this process, float64 (stage 11's model; stage 14's for the experts):
- the gradients of one step under --ac full and --ac selective are bit-equal (torch.equal) to --ac none's, through
  parallelize() itself (DDP on a group of one), and under --amp bf16 likewise;
- the bytes one block keeps for backward, counted: what autograd saves (saved_tensors_hooks, which also sees what
  torch's checkpoint saves: the block's input) plus what selective checkpointing keeps in its own store (the outputs
  its policy marks MUST_SAVE, read from that store), each storage once and the weights aside, equal KEPT's formula at
  two shapes;
- FlopCounterMode over backward: full recomputes a forward of every block but its last matmul (torch stops
  recomputing once backward has every tensor it needs: that matmul's output is needed by nobody), and the attention
  kernel once a block; selective recomputes no matmul and no attention;
- stage 14: the recomputed forward routes every token to the experts the forward did (the tokens per expert of each
  call equal), and the tally of the experts' load counts the forward's once.
Forked, two ranks of tp 2 (harness.forked_ranks): backward's ops counted; selective recomputes no all-reduce (it
keeps the row-wise layers' all-reduced sums), full recomputes attn.proj's.

Launched, tiny (2 blocks, width 32, context 32, 3 steps), float64, against one process with --ac none, within
sqrt(eps) (test_gpt.gaps: the states, every step's loss and gradient norm): 11 FSDP2 + tp 2 with selective, 12 cp 2
(DDP over the cp ranks) with full, 13 pp 2 (FSDP2, 2 micro-batches) with selective; 14 dp 2 (DDP) with selective and
ep 2 (FSDP2, the attention alone checkpointed) with full, each against 14's one process, the experts' load too.
"""
from __future__ import annotations

import sys
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from types import ModuleType, SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from harness import ROOT, Run, Step, forked_ranks, group_of_one, load_stage, run_chains, tolerance
from test_gpt import gaps

TOL = tolerance("float64")
MODES = ("none", "full", "selective")
DATA = ROOT / "11_gpt" / "data" / "input.txt"
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "32", "--dtype", "float64", "--device", "cpu",
        "--eval-every", "3", "--sample", "0", "--lr", "0.01", "--warmup-steps", "2", "--clip", "1.0",
        "--max-steps", "3", "--data", str(DATA))


def module_of(stage: str, name: str) -> ModuleType:
    """The stage's file `name` (parallelize, model, experts) as load_stage imported it."""
    load_stage(stage)
    return sys.modules[f"stage_{stage}.{name}"]


# ─── Bytes kept for backward, per block ───────────────────────────────────────────────────────────────────────────
# In elements of the dtype, for b windows of t tokens, width w, h heads (Korthikanti et al. 2022's way; their 34 sbh
# bytes in 16-bit per layer are these 16 btw elements plus two dropout masks, which this model has not, and their
# 5 a s^2 b the attention matrix, which the fused kernel never keeps: it keeps a log-sum-exp per head and token).
#   none       the input (norm1's), norm1's mean and 1/std (2 bt), norm1's output (q, k, v's input), q, k and v
#              (3 btw), attention's output (proj's input: one storage) and log-sum-exp (h bt), the residual after
#              attention (norm2's input), norm2's mean and 1/std (2 bt), norm2's output (fc's input), fc's output
#              (gelu's input, 4 btw), gelu's output (proj's input, 4 btw): 16 btw + 4 bt + h bt.
#   full       the input alone: btw.
#   selective  the input, and what the policy keeps: q, k, v (3 btw), attention's output and log-sum-exp (btw + h bt),
#              attn.proj's output (btw), fc's output (4 btw), mlp.proj's output (btw): 11 btw + h bt.
def kept_formula(ac: str, b: int, t: int, w: int, h: int) -> int:
    btw, bt = b * t * w, b * t
    return {"none": 16 * btw + 4 * bt + h * bt, "full": btw, "selective": 11 * btw + h * bt}[ac]


def kept_elements(block: torch.nn.Module, x: torch.Tensor, ac: str = "none",
                  parallelize: ModuleType | None = None) -> int:
    """The elements `block`, checkpointed with --ac `ac` (by `parallelize`, the stage's), keeps for backward in its
    forward on x: each storage once (a DTensor's local one), the weights aside."""
    stores: list = []

    def local(t: torch.Tensor) -> torch.Tensor:
        return t._local_tensor if isinstance(t, DTensor) else t

    weights = {local(p).untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = local(t).untyped_storage()
        if s.data_ptr() not in weights:
            kept[s.data_ptr()] = s.nbytes()
        return t

    recorded = nullcontext()
    if ac != "none":
        make = parallelize.create_selective_checkpoint_contexts

        def recording(*args, **kwargs):  # torch's own pair of contexts; the first holds the store of kept outputs
            contexts = make(*args, **kwargs)
            stores.append(contexts[0].storage)
            return contexts

        recorded = mock.patch.object(parallelize, "create_selective_checkpoint_contexts", recording)
    with recorded:
        if ac != "none":
            parallelize.checkpointed(block, ac)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = block(x)
    for store in stores:  # {op: {call: the op's outputs, each wrapped}}; a recomputed op's entry holds no tensor
        for leaf in tree_leaves([list(calls.values()) for calls in store.values()]):
            if isinstance(getattr(leaf, "val", None), torch.Tensor):
                kept[leaf.val.untyped_storage().data_ptr()] = leaf.val.untyped_storage().nbytes()
    del out
    return sum(kept.values()) // x.element_size()


@pytest.mark.parametrize("b, t, w, h", [(2, 32, 32, 2), (3, 16, 48, 4)])
def test_the_bytes_kept_for_backward_are_the_formulas(b, t, w, h):
    parallelize, model = module_of("11_gpt", "parallelize"), module_of("11_gpt", "model")
    found = {}
    for ac in MODES:
        torch.manual_seed(0)
        block = model.Block(model.Config(65, t, 1, h, w)).double()
        x = torch.randn(b, t, w, dtype=torch.float64, requires_grad=True)
        found[ac] = kept_elements(block, x, ac, parallelize)
    expected = {ac: kept_formula(ac, b, t, w, h) for ac in MODES}
    units = {ac: round(n / (b * t * w), 3) for ac, n in found.items()}
    assert found == expected, f"kept per block, in elements: {found}, the formulas {expected} (in btw: {units})"


# ─── Gradients, FLOPs, recomputed attention ───────────────────────────────────────────────────────────────────────

class OpCalls(TorchDispatchMode):
    """How often each op ran, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.name()] += 1
        return func(*args, **(kwargs or {}))


def one_step(ac: str, dtype: torch.dtype = torch.float64, amp: bool = False) -> dict:
    """Stage 11's GPT (2 blocks, width 32, 2 heads, context 32) made by parallelize() with --ac `ac` (DDP on a group
    of one): one forward and backward of a batch of 2; the gradients, and what backward ran."""
    gpt = load_stage("11_gpt")
    torch.manual_seed(0)
    model = gpt.GPT(gpt.Config(65, 32, 2, 2, 32)).to(dtype)
    grid = gpt.Grid({"dp": 1, "tp": 1}, torch.device("cpu"), 60)
    model = gpt.parallelize(model, grid, SimpleNamespace(tp=1, ac=ac, compile=False, parallel="ddp", amp=None))
    idx = torch.randint(0, 65, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1).float(), idx[:, 1:].flatten())
    with FlopCounterMode(display=False) as flops, OpCalls() as ops:
        loss.backward()
    return {"grads": {n: p.grad for n, p in model.named_parameters()}, "flops": flops.get_total_flops(),
            "attention": sum(n for op, n in ops.calls.items() if op.startswith("aten::_scaled_dot_product")
                             and not op.endswith("_backward"))}


def test_full_and_selective_give_none_s_gradients_bit_for_bit_and_recompute_what_they_say():
    with group_of_one():
        steps = {ac: one_step(ac) for ac in MODES}
        bf16 = {ac: one_step(ac, torch.float32, amp=True)["grads"] for ac in MODES}
    for ac in ("full", "selective"):
        for grads, what in ((steps[ac]["grads"], "float64"), (bf16[ac], "float32 --amp bf16")):
            reference = steps["none"]["grads"] if what == "float64" else bf16["none"]
            unequal = [n for n in reference if not torch.equal(grads[n], reference[n])]
            assert grads.keys() == reference.keys() and not unequal, f"--ac {ac} ({what}): {unequal} differ"
    # FlopCounterMode counts the matmuls (not the CPU's attention kernel): a block's forward is 2 b t w (3w + w + 4w
    # + 4w) = 24 btw^2; its last matmul, mlp.proj, 8 btw^2.
    b, t, w, layers = 2, 32, 32, 2
    recomputed = {ac: steps[ac]["flops"] - steps["none"]["flops"] for ac in MODES}
    assert recomputed == {"none": 0, "full": layers * (24 - 8) * b * t * w * w, "selective": 0}, recomputed
    attention = {ac: steps[ac]["attention"] for ac in MODES}
    assert attention == {"none": 0, "full": layers, "selective": 0}, attention


@pytest.mark.parametrize("early_stop", [True, False])
def test_the_experts_route_the_recomputed_tokens_as_the_forward_did_and_tally_them_once(early_stop):
    """Stage 14 (4 experts, 2 a token, one process, float64): under full and selective the recomputation in backward
    sends each expert the tokens the forward did (the tokens per expert of every call), the load is tallied once a
    forward, and the gradients are --ac none's bit for bit. With torch's early stop (the default) the recomputation
    ends at the last tensor backward needs, before the tally; without it, it runs the whole forward, tally included."""
    gpt, parallelize, experts = load_stage("14_experts"), module_of("14_experts", "parallelize"), \
        module_of("14_experts", "experts")
    found = {}
    for ac in MODES:
        torch.manual_seed(0)
        model = gpt.GPT(gpt.Config(65, 32, 2, 2, 32)).double()
        calls: list[tuple[int, bool, list[int]]] = []
        for i, block in enumerate(model.blocks.values()):
            block.moe.aux_weight = 0.01
            block.moe.experts.register_forward_pre_hook(
                lambda mod, args, i=i, moe=block.moe, into=calls: into.append((i, moe.recomputing, args[1].tolist())))
            if ac != "none":
                parallelize.checkpointed(block, ac)
        idx = torch.randint(0, 65, (2, 33), generator=torch.Generator().manual_seed(1))
        with set_checkpoint_early_stop(early_stop):
            F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
        moes = [m for m in model.modules() if isinstance(m, experts.MoE)]
        found[ac] = {"forward": [c for c in calls if not c[1]], "recomputed": [c for c in calls if c[1]],
                     "tallies": [torch.stack(m.tallies) for m in moes],
                     "grads": {n: p.grad for n, p in model.named_parameters()}}
    none = found["none"]
    assert not none["recomputed"] and len(none["forward"]) == 2
    for ac in ("full", "selective"):
        run = found[ac]
        assert run["forward"] == none["forward"], (ac, run["forward"], none["forward"])
        # backward recomputes the blocks last first
        assert [(i, c) for i, _, c in run["recomputed"]] == [(i, c) for i, _, c in reversed(none["forward"])], \
            (ac, run["recomputed"], none["forward"])
        assert all(torch.equal(a, b) for a, b in zip(run["tallies"], none["tallies"], strict=True)), \
            (ac, [t.shape for t in run["tallies"]])
        unequal = [n for n in none["grads"] if not torch.equal(run["grads"][n], none["grads"][n])]
        assert not unequal, f"--ac {ac}: {unequal} differ"


def tp_worker(rank: int, world: int, store: str, out: str) -> None:
    """One rank of tp 2 (harness.forked_ranks: gloo over a FileStore, no port): a block of stage 11 split by its
    TP_PLAN and checkpointed by each mode; the ops its backward ran, and its input's gradient."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    parallelize, model = module_of("11_gpt", "parallelize"), module_of("11_gpt", "model")
    mesh = init_device_mesh("cpu", (world,))
    found = {}
    for ac in MODES:
        torch.manual_seed(0)
        block = model.Block(model.Config(65, 32, 1, 2, 32)).double()
        parallelize_module(block, mesh, parallelize.TP_PLAN)
        if ac != "none":
            parallelize.checkpointed(block, ac)
        x = torch.randn(2, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = block(x)
        with OpCalls() as ops:
            y.square().sum().backward()
        found[ac] = {"calls": dict(ops.calls), "grad": x.grad.sum().item()}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def test_under_tp_selective_recomputes_no_collective_and_full_one_all_reduce_a_block(tmp_path):
    """tp 2: backward's all-reduces are the column-wise layers' (4 a block, q k v as one, and fc); full adds attn.proj's
    forward all-reduce (mlp.proj's, the last, is not recomputed: early stop) and 5 of the 6 matmuls; selective keeps
    the row-wise layers' all-reduced sums and recomputes no collective, no matmul, no attention. Same gradients."""
    ops = ("_c10d_functional::all_reduce", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu")
    for found in forked_ranks("test_activation_checkpointing", "tp_worker", 2, tmp_path):
        calls = {ac: [found[ac]["calls"].get(op, 0) for op in ops] for ac in MODES}
        recomputed = {ac: [n - m for n, m in zip(calls[ac], calls["none"], strict=True)] for ac in MODES[1:]}
        assert calls["none"][0] == 4, found["none"]["calls"]
        assert recomputed == {"full": [1, 5, 1], "selective": [0, 0, 0]}, (ops, recomputed)
        assert found["full"]["grad"] == found["selective"]["grad"] == found["none"]["grad"], found


# ─── Launched: every layout it combines with, against one process ─────────────────────────────────────────────────

def step(stage: str, nproc: int, *args: str) -> Step:
    return Step(stage, "python" if nproc == 1 else "torchrun", (*TINY, *args), nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("ac")
    chains = {
        "tp": [step("11_gpt", 2, "--batch-size", "4", "--parallel", "fsdp", "--tp", "2", "--ac", "selective")],
        "one": [step("11_gpt", 1, "--batch-size", "4")],
        "cp": [step("12_context_parallel", 2, "--batch-size", "4", "--cp", "2", "--ac", "full")],
        "pp": [step("13_pipeline_4d", 2, "--batch-size", "2", "--accumulate", "2", "--pp", "2", "--parallel", "fsdp",
                    "--ac", "selective")],
        "one14": [step("14_experts", 1, "--batch-size", "2", "--accumulate", "2")],
        "dp14": [step("14_experts", 2, "--batch-size", "1", "--accumulate", "2", "--ac", "selective")],
        "ep14": [step("14_experts", 2, "--batch-size", "1", "--accumulate", "2", "--ep", "2", "--parallel", "fsdp",
                      "--ac", "full")],
    }
    return run_chains(chains, tmp)


@pytest.mark.parametrize("name, reference, ac", [("tp", "one", "selective"), ("cp", "one", "full"),
                                                 ("pp", "one", "selective"), ("dp14", "one14", "selective"),
                                                 ("ep14", "one14", "full")])
def test_every_layout_with_checkpointing_is_one_process_without(runs, name, reference, ac):
    run, one = runs[name], runs[reference]
    assert (run.summary["ac"], one.summary["ac"], run.summary["world_size"]) == (ac, "none", 2), run.summary
    assert f"--ac {ac}" in run.stdout
    found, shared = gaps(run, one)
    assert shared == [0, 3] and max(found.values()) <= TOL, f"{name} --ac {ac} vs one process: {found}"
    if "experts" in one.summary:  # the tokens each expert took, each step and block: the forward's, tallied once
        assert run.summary["experts"]["load"] == one.summary["experts"]["load"]
