"""Sequence parallelism on stage 11 (--sp, with --tp: parallelize.SP_PLAN and SP_AROUND, train.py's loss_parallel):
the same training as one process, the collectives it says, and the activations it keeps.

Launched, tiny (2 blocks, width 32, context 32, 3 steps), float64, against one process, within sqrt(eps)
(test_gpt.gaps: the states, every step's loss and gradient norm): --parallel fsdp --tp 2 --sp (dp 1 x tp 2), and dp 2
x tp 2 --sp on 4 processes with --ac selective beside it. Both print a held-out loss and a sample (padded windows,
gathered logits: evaluate.logits_of), and their model.pt (full_model) is the trained state.

Forked, two ranks of tp 2 (harness.forked_ranks), Trainer._run_step itself on the GPT split by split_over_tp, with
and without --sp, against this rank's one-process step (same gradients); every collective counted by op and size:
- a block's all-reduces (2 forward, 4 backward: q, k, v's input gradient, fc's) become as many all-gathers +
  reduce-scatters of the same [b, t, w] (each moves half an all-reduce's bytes);
- the logits are never gathered: no collective of [b t, vocab]; the loss all-reduces [b t] numbers;
- the activations one block keeps for backward, counted (saved_tensors_hooks) against kept_formula.
In this process: --sp without --tp, or with a context tp does not divide, refused in one line (test_gpt.refusal).

Stages 12-14, launched, one 4-rank run each against one process (is_one_process; -s prints each row's gaps):
12 --cp 2 --tp 2 --sp (a cp share split again over tp), 13 --pp 2 --tp 2 --sp with 2 micro-batches (the stages pass
[b, t/tp, w]; the schedule's step under loss_parallel), 14 dp 2 x tp 2 --sp --ep 2 (each tp rank routes its own
tokens; the experts' load and balancing loss, step by step, one process's too).
"""
from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_activation_checkpointing import kept_elements, module_of
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from harness import ROOT, Run, Step, forked_ranks, load_stage, run_chains, tolerance
from test_gpt import gaps, refusal, refused_in_one_line

TOL = tolerance("float64")
DATA = ROOT / "11_gpt" / "data" / "input.txt"
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "32", "--dtype", "float64", "--device", "cpu",
        "--eval-every", "3", "--sample", "20", "--lr", "0.01", "--warmup-steps", "2", "--clip", "1.0",
        "--max-steps", "3", "--data", str(DATA))
B, T, W, H, V, TP = 2, 32, 32, 2, 65, 2  # the forked ranks' batch, context, width, heads, vocabulary, tp


# ─── Bytes kept for backward by one block, per tp rank, in elements (b windows of t tokens, width w, h heads) ─────
# Without --sp (test_activation_checkpointing.kept_formula's 16 btw + 4 bt + h bt, split by tp where tp splits it):
# whole on every tp rank, norm1's input and output, norm2's input and output (4 btw) and the norms' mean and 1/std
# (4 bt); split, q, k, v, attention's output, fc's and gelu's outputs (12 btw / tp) and the log-sum-exp (h bt / tp).
# With --sp the norms' inputs and their statistics shrink by tp (Korthikanti et al. 2022), but torch keeps what the
# column-wise layers multiply, the all-gathered norm outputs, whole (2 btw); Megatron keeps them split and
# all-gathers them again in backward, which would make every term / tp.
def kept_formula(sp: bool, b: int, t: int, w: int, h: int, tp: int) -> float:
    btw, bt = b * t * w, b * t
    split = 12 * btw / tp + h * bt / tp
    return split + (2 * btw + 2 * btw / tp + 4 * bt / tp if sp else 4 * btw + 4 * bt)


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


class Collectives(TorchDispatchMode):
    """Every collective called, as [op, elements of the whole tensor it reduces or gathers] (an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):  # let DTensor run first: its ops' collectives then come here
            return NotImplemented  # (loss_parallel's among them), as torch's CommDebugMode does
        out = func(*args, **(kwargs or {}))
        name = func.name()
        if name.startswith("_c10d_functional::") and name.split("::")[1] in COLLECTIVES:
            size = out.numel() if "all_gather" in name else args[0].numel()
            self.calls.append([name.split("::")[1], size])
        return out


def one_step(gpt, model: torch.nn.Module, tokens: torch.Tensor, sp: bool, batch: int = B, dp_rank: int = 0,
             dp: int = 1) -> tuple[dict, list]:
    """Trainer._run_step, the stage's own code, on a stand-in trainer (dp rank `dp_rank` of `dp`, `batch` windows
    each, no clipping): the gradients its backward left (whole), and the collectives it called."""
    grads: list = []

    class KeepGradient:  # the optimizer: keeps what backward accumulated instead of stepping
        param_groups: list[dict] = []

        def step(self) -> None:
            grads.append({n: p.grad for n, p in model.named_parameters()})

        def zero_grad(self, set_to_none: bool = True) -> None:
            pass

    trainer = SimpleNamespace(
        model=model, optimizer=KeepGradient(), corpus=SimpleNamespace(train=tokens), cfg=model.cfg,
        args=SimpleNamespace(seed=3, batch_size=batch, accumulate=1, amp=None, clip=0, lr=0.1, warmup_steps=1,
                             decay_steps=10, sp=sp),
        steps=0, dp_rank=dp_rank, dp=dp, global_batch=dp * batch, device=torch.device("cpu"),
        syncing=lambda last: nullcontext())
    with Collectives() as seen:
        gpt.Trainer._run_step(trainer)
    whole = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads[0].items()}
    return whole, seen.calls


def tp_worker(rank: int, world: int, store: str, out: str) -> None:
    """One rank of tp 2 (gloo over a FileStore, no port): one training step of the GPT split over tp, without and
    with --sp, its gradients against one process's, its collectives, and the bytes one block keeps."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    gpt, parallelize = load_stage("11_gpt"), module_of("11_gpt", "parallelize")
    mesh = gpt.Grid({"dp": 1, "tp": world}, torch.device("cpu"), 60).mesh["tp"]
    tokens = torch.randint(0, V, (4096,), generator=torch.Generator().manual_seed(2))
    cfg = gpt.Config(V, T, 2, H, W)

    def model(split: bool | None) -> torch.nn.Module:
        torch.manual_seed(0)
        m = gpt.GPT(cfg).double()
        if split is not None:
            parallelize.split_over_tp(m, mesh, split)
        return m

    reference, _ = one_step(gpt, model(None), tokens, sp=False)
    found = {}
    for sp in (False, True):
        grads, calls = one_step(gpt, model(sp), tokens, sp)
        gap = {n: (grads[n] - reference[n]).abs().max().item() for n in reference}
        block = model(sp).blocks[0]
        x = torch.randn(B, T // world if sp else T, W, dtype=torch.float64, requires_grad=True)
        found["sp" if sp else "tp"] = {"gap": gap, "calls": calls, "kept": kept_elements(block, x)}
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> list[dict]:
    return forked_ranks("test_sequence_parallel", "tp_worker", TP, tmp_path_factory.mktemp("sp_forked"))


def test_a_step_split_by_sequence_has_one_process_s_gradients(forked):
    for found in forked:
        for layout in ("tp", "sp"):
            worst = max(found[layout]["gap"], key=found[layout]["gap"].get)
            assert found[layout]["gap"][worst] <= TOL, f"{layout}: {worst} differs by {found[layout]['gap'][worst]}"


def test_sp_turns_each_all_reduce_into_gathers_and_scatters_and_never_gathers_the_logits(forked):
    btw, bt, layers = B * T * W, B * T, 2
    for found in forked:
        tp, sp = ([tuple(c) for c in found[k]["calls"]] for k in ("tp", "sp"))
        # without --sp: a block's 6 all-reduces of [b, t, w] (2 forward; 4 backward: q's, k's, v's input gradients
        # each, and fc's); the rest are the gradient norm's few numbers
        assert tp.count(("all_reduce", btw)) == 6 * layers and all(c[1] < W for c in tp if c[1] != btw), tp
        # with it, a block's 2 all-gathers + 2 reduce-scatters forward and as many backward (q, k and v's gradients
        # summed first: one reduce-scatter), all of [b, t, w]; besides, the head's input all-gathered (its gradient
        # reduce-scattered), the token embedding's gradient all-gathered, and the positions' ([t, w])
        assert not [c for c in sp if c == ("all_reduce", btw)], sp
        assert sp.count(("all_gather_into_tensor", btw)) == 4 * layers + 2, sp
        assert sp.count(("reduce_scatter_tensor", btw)) == 4 * layers + 1, sp
        assert sp.count(("all_gather_into_tensor", T * W)) == 1, sp
        # the norms' weight and bias gradients, Partial over tp, all-reduced by DTensor: 2 per norm, w numbers each
        assert sp.count(("all_reduce", W)) == 2 * (2 * layers + 1), sp
        # the loss: 3 all-reduces of one number a token (loss_parallel: the max over the vocabulary, the sum of the
        # exponentials, the target's logit from the rank that holds it); the logits, [b t, vocab] = 4,160 numbers
        # here, never gathered: nothing moves more than [b, t, w]
        assert max(c[1] for c in sp) == btw, [c for c in sp if c[1] > btw]
        assert sp.count(("all_reduce", bt)) == 3, sp


def test_sp_keeps_the_norms_activations_split_by_tp(forked):
    expected = {layout: kept_formula(layout == "sp", B, T, W, H, TP) for layout in ("tp", "sp")}
    for found in forked:
        kept = {layout: found[layout]["kept"] for layout in ("tp", "sp")}
        assert kept == expected, f"kept per block per rank, in elements: {kept}, the formulas {expected}"


def test_sp_without_tp_or_with_a_context_tp_does_not_divide_is_refused_in_one_line():
    tp2 = ["--parallel", "fsdp", "--tp", "2", "--heads", "2", "--sp"]
    refused_in_one_line([(["--sp"], {}, "argument --sp: sequence parallelism splits the sequence over the tp ranks"),
                         ([*tp2, "--context", "33"], {"WORLD_SIZE": "2"}, "--tp 2 does not divide --context 33")])
    assert refusal([*tp2, "--context", "32"], {"WORLD_SIZE": "2"})[0] == "accepted"  # the control


# ─── Launched: the stage's real launcher, against one process ──────────────────────────────────────────────────────

def step(nproc: int, *args: str, stage: str = "11_gpt") -> Step:
    return Step(stage, "python" if nproc == 1 else "torchrun", (*TINY, *args), nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    chains = {
        "dp2tp2": [step(4, "--batch-size", "2", "--parallel", "fsdp", "--tp", "2", "--sp", "--ac", "selective")],
        "tp2": [step(2, "--batch-size", "4", "--parallel", "fsdp", "--tp", "2", "--sp")],
        "one": [step(1, "--batch-size", "4")],
    }
    return run_chains(chains, tmp_path_factory.mktemp("sp"))


@pytest.mark.parametrize("name, world, ac", [("tp2", 2, "none"), ("dp2tp2", 4, "selective")])
def test_every_layout_with_sp_is_one_process(runs, name, world, ac):
    run = runs[name]
    assert (run.summary["sp"], run.summary["tp"], run.summary["world_size"], run.summary["ac"]) == (True, 2, world, ac)
    is_one_process(name, run, runs["one"])


def is_one_process(name: str, run: Run, one: Run) -> None:
    """run (--sp) trained as one process: states, every step's loss and gradient norm, the held-out loss, the sample
    and the saved model, within TOL."""
    assert "--sp" in run.stdout
    found, shared = gaps(run, one)
    print(f"\n| {name} | {found['state']:.1e} | {found['losses']:.1e} | {found['grad_norms']:.1e} |")  # (-s: the rows)
    assert shared == [0, 3] and max(found.values()) <= TOL, f"{name} --sp vs one process: {found}"
    # evaluation and sampling (padded, the logits gathered) and the saved model (full_model) work under --sp
    assert abs(run.summary["eval_loss"] - one.summary["eval_loss"]) <= TOL and run.summary["eval_count"] == \
        one.summary["eval_count"], (run.summary["eval_loss"], one.summary["eval_loss"])
    assert run.summary["sample"] == one.summary["sample"] and len(one.summary["sample"]) == 20
    model, reference = run.model, one.model
    assert model.keys() == reference.keys()
    assert max((model[k] - reference[k]).abs().max().item() for k in model) <= TOL


# ─── Stages 12-14: --sp beside cp, pp and the experts, launched, against one process ──────────────────────────────
# One 4-rank run a stage, on the first 30,000 characters of the text (a held-out tenth of 3,000: evaluation is most
# of a tiny run's time), each against one process of the same data: stage 11's for 12 and 13 (the same GPT, drawn
# alike), stage 14's own for its experts.
SMALL = 30_000


def later(stage: str, nproc: int, data: Path, *args: str) -> Step:
    return step(nproc, "--batch-size", "4", *args, "--data", str(data), stage=stage)


@pytest.fixture(scope="module")
def later_runs(tmp_path_factory) -> dict[str, Run]:
    tmp = tmp_path_factory.mktemp("sp_later")
    data = tmp / "small.txt"
    data.write_text(DATA.read_text()[:SMALL])
    chains = {
        "cp2tp2": [later("12_context_parallel", 4, data, "--parallel", "fsdp", "--cp", "2", "--tp", "2", "--sp")],
        "pp2tp2": [later("13_pipeline_4d", 4, data, "--parallel", "fsdp", "--pp", "2", "--tp", "2", "--sp",
                         "--accumulate", "2", "--batch-size", "2")],  # 2 micro-batches through the 2 stages
        # dp 2 x tp 2, the experts shared out over the dp ranks (ep 2): each tp rank routes its own tokens
        "ep2tp2": [later("14_experts", 4, data, "--parallel", "fsdp", "--tp", "2", "--sp", "--ep", "2",
                         "--batch-size", "2")],
        "one": [later("11_gpt", 1, data)],
        "one_experts": [later("14_experts", 1, data)],
    }
    return run_chains(chains, tmp)


@pytest.mark.parametrize("name, reference, layout", [
    ("cp2tp2", "one", {"cp": 2, "tp": 2, "world_size": 4}),
    ("pp2tp2", "one", {"pp": 2, "tp": 2, "world_size": 4, "accumulate": 2}),
    ("ep2tp2", "one_experts", {"dp": 2, "tp": 2, "world_size": 4})])
def test_sp_beside_cp_pp_and_experts_is_one_process(later_runs, name, reference, layout):
    run = later_runs[name]
    assert {k: run.summary[k] for k in (*layout, "sp")} == {**layout, "sp": True}
    is_one_process(name, run, later_runs[reference])
    if "experts" in run.summary:  # every expert's tokens, summed over the tp ranks that routed them, and the
        # balancing loss (its load counted over dp x tp), step by step, as one process's
        mine, theirs = run.summary["experts"], later_runs[reference].summary["experts"]
        assert (mine["ep"], mine["load"]) == (2, theirs["load"]), (mine["load"], theirs["load"])
        assert max(abs(a - b) for a, b in zip(mine["aux_losses"], theirs["aux_losses"], strict=True)) <= TOL, \
            (mine["aux_losses"], theirs["aux_losses"])
