"""Stage 11: a GPT on Shakespeare computes the same training however it is split, resumes exactly, and refuses bad
input in one line.

Nine launches of a tiny model (2 blocks, 2 heads, width 32, context 32), global batch 4, on 24,000 characters of tiny
Shakespeare (harness.small_corpus: every run scores its held-out tenth whole), serve every assert; the single-process
run in float64 is the reference. All of them train with the stage's recipe: the rate warmed up over
2 steps and decayed over 12 (half's and fsdp's first legs are told --decay-steps 12), the gradient clipped to a norm
of 1, which the first steps exceed and the later ones do not, so the layouts are compared on steps of both kinds:

    one       python, batch 4, 12 steps, a checkpoint every 3 (its trajectory: the state at 0, 3, 6, 9, 12)
    half      python, batch 4, 6 steps, its checkpoint at step 5, between two log lines (3 and 6);
              resumed: one's command from half's checkpoint (step 5) to 12
    ddp       torchrun, 2 processes of batch 1 x --accumulate 2 (DDP, no_sync), 12 steps, a checkpoint every 3
    fsdp      torchrun, 2 processes of batch 1 x --accumulate 2, --parallel fsdp, 6 steps
    tp        torchrun, --parallel fsdp --tp 2 (dp 1 x tp 2) of batch 4, resumed from fsdp's checkpoint to 12 steps
    broken    ddp's command exactly, on a copy of the stage with the causal mask dropped on rank 1: the negative
              control of ddp's check
    compiled  python, --compile, batch 4, 3 steps (float64): torch.compile computes the eager reference's steps
    bf16      python, --amp bf16 --dtype float32, batch 4, 3 steps: the bf16 autocast path, end to end

States are compared whole (weights and both AdamW moments) at every step where both runs recorded one, and with
them every step's loss and gradient norm, within sqrt(eps) of float64 (1.5e-8; correct runs differ by ~1e-14); the
resumed single process bit for bit. Bad input is
checked in this process, through main() up to where it would join a group; so are the rows each dp rank takes
(Trainer._run_step itself, on a stand-in model), the dtype bf16 autocast computes the matmuls in, and the
dtypes FSDP2's mixed-precision policy computes and reduces in under --amp bf16 --parallel fsdp. The scaling
benchmark's check reads the run of its quick command in 11_gpt/README.md (the readme_run marker), which the README
test runs anyway. The compiled run costs the most here (~35 CPU-s with a cold inductor cache, most of it gcc).
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import math
import os
import re
import statistics
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import readme_run
from harness import ROOT, Run, Step, clean_env, group_of_one, load_stage, mutate, run_chains, small_corpus, tolerance
from readme_blocks import BLOCKS
from tools.cli import read_csv

STAGE = "11_gpt"
TOL = tolerance("float64")
DATA = ROOT / STAGE / "data" / "input.txt"
CLIP = 1.0  # the tiny model's gradient norms fall from 1.8 to about 0.6 over the 12 steps: the first 4 are clipped
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "32", "--dtype", "float64", "--device", "cpu",
        "--eval-every", "3", "--save-every", "3", "--sample", "40", "--lr", "0.01", "--warmup-steps", "2",
        "--clip", str(CLIP))
CAUSAL = "y = F.scaled_dot_product_attention(q, k, v, is_causal=True)"


def step(launcher: str, *args: str, nproc: int = 1) -> Step:
    return Step(STAGE, launcher, (*TINY, *args), nproc=nproc)


# ddp's flags, and its negative control's: the same. (--data names the stage's own corpus, which the control's copy
# of the stage, in another folder, would not find beside it.)
DDP_ARGS = ("--batch-size", "1", "--accumulate", "2", "--max-steps", "12", "--data", str(DATA))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """The nine runs, two at a time (independent ones side by side; a resumed run after the one it resumes)."""
    tmp = tmp_path_factory.mktemp("gpt")
    # (model.py imports no os: the planted line brings its own)
    broken = mutate(STAGE, CAUSAL, CAUSAL.replace("is_causal=True", 'is_causal=__import__("os").environ.get("RANK") '
                                                                    '!= "1"'), tmp / "broken_stage")
    chains = {  # the compiled run first: the longest (compiling), so that the others fill in beside it
        "compiled": [step("python", "--compile", "--batch-size", "4", "--max-steps", "3")],
        "one": [step("python", "--batch-size", "4", "--max-steps", "12", "--snapshot", str(tmp / "ck_one"))],
        "half": [step("python", "--batch-size", "4", "--max-steps", "6", "--decay-steps", "12", "--save-every", "5",
                      "--snapshot", str(tmp / "ck_half")),
                 step("python", "--batch-size", "4", "--max-steps", "12", "--snapshot", str(tmp / "ck_half"))],
        "ddp": [step("torchrun", *DDP_ARGS, "--snapshot", str(tmp / "ck_ddp"), nproc=2)],
        "fsdp": [step("torchrun", "--batch-size", "1", "--accumulate", "2", "--parallel", "fsdp", "--max-steps", "6",
                      "--decay-steps", "12", "--snapshot", str(tmp / "ck_fsdp"), nproc=2),
                 step("torchrun", "--batch-size", "4", "--parallel", "fsdp", "--tp", "2", "--max-steps", "12",
                      "--snapshot", str(tmp / "ck_fsdp"), nproc=2)],
        "broken": [step("torchrun", *DDP_ARGS, "--snapshot", str(tmp / "ck_broken"), nproc=2)],
        "bf16": [step("python", "--dtype", "float32", "--amp", "bf16", "--batch-size", "4", "--max-steps", "3")],
    }
    # Compiling counts as 3 processes: with inductor's cache empty it took 14-19 start-ups here (92 s with a start-up
    # of 6.7 s, 74 s with 3.8 s), a tiny run about 2.
    return run_chains(chains, tmp, names={"half": ["half", "resumed"], "fsdp": ["fsdp", "tp"]},
                      scripts={"broken": broken}, weights={"compiled": 3},
                      args=("--data", str(small_corpus(tmp))))  # every run's: 24,000 characters, 2,400 held out


def gap(a: dict, b: dict) -> float:
    """Largest |difference| between two recorded states: the weights and AdamW's two moments, by name."""
    keys = ("params", "exp_avg", "exp_avg_sq")  # no moments yet at step 0
    assert a["step"] == b["step"] and all(a[key].keys() == b[key].keys() for key in keys)
    return max((a[key][n] - b[key][n]).abs().max().item() for key in keys for n in a[key])


def states(run: Run) -> dict[int, dict]:
    return {s["step"]: s for s in run.trajectory}


def gaps(run: Run, reference: Run) -> tuple[dict[str, float], list[int]]:
    """The largest gap of each kind over the steps both recorded ({"state", "losses", "grad_norms"}: the weights and
    AdamW's moments; every step's loss; its gradient norm before clipping, the one clipping divides by, which a layout
    that took it over its own shard or slice would get wrong), and those steps."""
    ours, theirs = states(run), states(reference)
    shared = sorted(ours.keys() & theirs.keys())
    found = {"state": max((gap(ours[s], theirs[s]) for s in shared), default=0.0)}
    for key in ("losses", "grad_norms"):
        mine, reference_values = run.summary[key], reference.summary[key]
        assert len(mine) == run.summary["steps"] and len(mine) <= len(reference_values), (key, len(mine))
        found[key] = max((abs(a - b) for a, b in zip(mine, reference_values, strict=False)), default=0.0)
    return found, shared


def compare(run: Run, reference: Run) -> tuple[float, list[int]]:
    """(the largest gap over the steps both recorded, those steps): the states, and beside them the per-step losses
    and gradient norms (numbers the state determines, so they count in the same gap)."""
    found, shared = gaps(run, reference)
    return max(found.values()), shared


def speed_is_the_runs_own_count(run: Run) -> None:
    """tokens/s is the tokens this run trained on over the seconds its steps took: the summary's figure, the line it
    printed, and the curve's per-interval rates (each over its own steps) all say the same."""
    s = run.summary
    steps, tokens_per_step = s["steps"] - s["resumed_at"], s["global_batch"] * s["model"]["context"]
    assert 0 < s["train_seconds"] <= s["seconds"], (s["train_seconds"], s["seconds"])
    assert s["tokens_per_s"] == pytest.approx(steps * tokens_per_step / s["train_seconds"], rel=1e-9)
    printed = re.search(r"^tokens/s ([\d,]+) over (\d+) steps \(([\d.]+)s of training\) \| ", run.stdout, re.M)
    assert printed, run.stdout
    assert (int(printed[1].replace(",", "")), int(printed[2])) == (round(s["tokens_per_s"]), steps), printed[0]
    # The curve: [step, train loss, held-out loss, tokens/s since the previous point]. Each interval's seconds,
    # recovered from its rate, add up to train_seconds, which the trainer summed separately.
    points = [c for c in s["curve"] if c[0] > s["resumed_at"]]
    intervals = [b[0] - a for a, b in zip([s["resumed_at"], *(c[0] for c in points)], points, strict=False)]
    seconds = sum(n * tokens_per_step / c[3] for n, c in zip(intervals, points, strict=True))
    assert sum(intervals) == steps and seconds == pytest.approx(s["train_seconds"], rel=1e-9), (seconds, s)


def test_the_reference_learns_and_reports(runs):
    s = runs["one"].summary
    assert (s["world_size"], s["dp"], s["tp"], s["parallel"], s["global_batch"]) == (1, 1, 1, "ddp", 4)
    assert s["steps"] == 12 and len(s["losses"]) == 12 and [c[0] for c in s["curve"]] == [3, 6, 9, 12]
    # Clipping acted: the layouts below are compared on steps it scaled down, and on steps it left alone.
    assert sum(n > CLIP for n in s["grad_norms"]) >= 3 and sum(n < CLIP for n in s["grad_norms"]) >= 3 and \
        s["clip"] == CLIP, s["grad_norms"]
    assert s["losses"][-1] < s["losses"][0] - 0.2, s["losses"]  # 12 steps at lr 0.01: from ln 65 = 4.17 down
    # The held-out loss counts every held-out character but the first, once (the small corpus's last 2,400); the
    # baselines are the corpus's: ln 65 for the uniform one, and bigram < unigram < uniform.
    b = s["baselines"]
    assert s["eval_count"] == 2_399 and b["uniform"] == pytest.approx(math.log(65))
    assert "data: input.txt, 24,000 characters (65 distinct): 21,600 to train on, the last 2,400 held out" in \
        runs["one"].stdout, runs["one"].stdout
    assert b["bigram"] < b["unigram"] < b["uniform"]
    assert len(s["sample"]) == 40 and "sample (40 characters" in runs["one"].stdout
    assert s["memory"]["peak"][0] > 0
    # The MFU is of the matmul peak the run measured, and a model can go no faster than its large matmuls.
    assert s["mfu"] == pytest.approx(s["tokens_per_s"] * s["flops_per_token"] / s["peak_flops"], rel=1e-12)
    assert 0 < s["mfu"] < 1 and "a float64 matmul measured now" in s["peak"], s["peak"]
    for name in ("one", "resumed", "ddp", "tp"):  # one process, resumed (7 steps here), accumulated, tensor parallel
        speed_is_the_runs_own_count(runs[name])
    assert [t["step"] for t in runs["one"].trajectory] == [0, 3, 6, 9, 12]
    model = load_stage(STAGE).GPT(load_stage(STAGE).Config(**s["model"]))
    model.load_state_dict(runs["one"].model)  # the plain GPT: no "module." prefix, every shape whole


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(runs):
    resumed, one = runs["resumed"], runs["one"]
    assert "at step 5" in resumed.stdout and resumed.summary["resumed_at"] == 5
    # Step 5 was no log step: its checkpoint still kept steps 4 and 5's losses and norms (settled when saving).
    assert resumed.summary["losses"] == one.summary["losses"]
    assert resumed.summary["grad_norms"] == one.summary["grad_norms"]
    assert [t["step"] for t in resumed.trajectory] == [5, 6, 9, 12]
    for s in (6, 9, 12):
        assert gap(states(resumed)[s], states(one)[s]) == 0.0, s
    assert all(torch.equal(resumed.model[k], one.model[k]) for k in one.model)


def ddp_gap(run: Run, one: Run) -> float:
    """The check of ddp's run: the largest gap from the one-process run over every recorded state, the per-step
    losses and the final held-out loss (both runs record the states at 0, 3, 6, 9, 12)."""
    s = run.summary
    assert (s["world_size"], s["dp"], s["accumulate"], s["global_batch"]) == (2, 2, 2, 4)
    worst, shared = compare(run, one)
    assert shared == [0, 3, 6, 9, 12], shared
    return max(worst, abs(s["eval_loss"] - one.summary["eval_loss"]))


def test_ddp_over_two_processes_with_accumulation_is_one_process(runs):
    """2 processes x batch 1 x 2 micro-batches (no_sync on the first) = 1 process of batch 4."""
    worst = ddp_gap(runs["ddp"], runs["one"])
    assert worst <= TOL, f"DDP vs one process: {worst:.2e}"


def test_fsdp_is_ddp(runs):
    """FSDP2 over 2 ranks (every block a unit, accumulation without reduce-scatter) against the reference, state by
    state at 0, 3, 6, and against DDP likewise; each rank held half of the training state."""
    for reference in ("one", "ddp"):
        worst, shared = compare(runs["fsdp"], runs[reference])
        assert shared == [0, 3, 6] and worst <= TOL, f"FSDP vs {reference}: {worst:.2e}"
    ddp, fsdp = runs["ddp"].summary["memory"]["state"], runs["fsdp"].summary["memory"]["state"]
    assert sum(fsdp) == pytest.approx(ddp[0], rel=0.02) and max(fsdp) < 0.52 * ddp[0], (fsdp, ddp)


def test_tensor_parallel_resumes_fsdps_checkpoint_and_computes_the_same(runs):
    """dp 1 x tp 2, from the checkpoint two FSDP ranks wrote at step 6 (resharded: other shards, other slices)."""
    run = runs["tp"]
    s = run.summary
    assert (s["world_size"], s["dp"], s["tp"], s["resumed_at"]) == (2, 1, 2, 6)
    assert "(written by 2 ranks) at step 6" in run.stdout
    worst, shared = compare(run, runs["one"])
    assert shared == [6, 9, 12] and worst <= TOL, f"tp 2 vs one process: {worst:.2e}"
    # No replicas to compare with FSDP (11_gpt/train.py reports None, or 0.0 where it still assembles the model).
    assert s["replica_max_abs_diff"] in (0.0, None) and s["sample"] == runs["one"].summary["sample"]


def test_a_causal_mask_dropped_on_one_rank_is_caught(runs):
    """Negative control of the DDP check: ddp's very command (the same flags: 2 processes x batch 1 x --accumulate 2,
    12 steps), on a copy of the stage whose rank 1 lets each position see the characters after it. The job runs to
    the end without an error (the replicas stay equal: DDP averages whatever gradients it gets), and ddp_gap, the
    check the correct run passes at ~4e-14, is off by far more than the tolerance (measured: 0.09 over the 12 steps)."""
    worst = ddp_gap(runs["broken"], runs["one"])
    assert worst > 1e3 * TOL, f"the broken copy is within {worst:.2e} of one process"
    assert runs["broken"].summary["replica_max_abs_diff"] == 0.0


class Accepted(Exception):
    """Raised where main() would join a process group: it got past every check of its arguments and files."""


def refusal(args: list[str], env: dict[str, str] | None = None, stage: str = STAGE) -> tuple[object, str]:
    """(exit code, stderr) of the stage's main(args) in this process, stopped before it would join a group."""
    module, err = load_stage(stage), io.StringIO()
    with mock.patch.dict(os.environ, {**clean_env(), **(env or {})}, clear=True), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()), mock.patch.object(module, "ddp_setup", side_effect=Accepted):
        try:
            module.main(args)
        except SystemExit as e:
            return e.code, err.getvalue()
        except Accepted:
            pass
    return "accepted", err.getvalue()


def refused_in_one_line(cases: list[tuple[list[str], dict[str, str], str]], stage: str = STAGE) -> None:
    """Each (args, environment, message): the stage refuses it before joining a group, in one line that names the
    script and holds the message, with exit status 2."""
    for args, env, message in cases:
        code, err = refusal(args, env, stage)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{stage}/train.py: error: ") \
            and message in lines[0], (args, code, err)


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    """A tp that does not divide the heads, a context longer than the text or than the checkpoint's model, an
    unreadable corpus, each as the README shows it; and, as a control, the same settings made right are accepted."""
    binary = tmp_path / "binary.txt"
    binary.write_bytes(bytes(range(256)))
    short = tmp_path / "short.txt"
    short.write_text("to be or not to be\n" * 3)
    ck = str(runs["tp"].out.parent / "ck_fsdp")  # the tp run's checkpoints: context 32
    cases = [
        (["--parallel", "fsdp", "--tp", "4", "--heads", "2"], {"WORLD_SIZE": "4"}, "--tp: 4 does not divide --heads 2"),
        (["--context", "200000"], {}, "--context: 200000 characters is longer than"),
        (["--data", str(short), "--context", "8"], {}, "--context: 8 characters is longer than"),
        (["--data", str(tmp_path / "missing.txt")], {}, "--data: cannot read"),
        (["--data", str(binary)], {}, "--data: cannot read"),
        ([*TINY, "--context", "64", "--batch-size", "4", "--snapshot", ck], {}, "holds another model: context 32"),
        ([*TINY, "--batch-size", "4", "--snapshot", ck], {}, "was made with --lr 0.01 --warmup-steps 2 --decay-steps "
                                                            "12; resume with the same"),  # default --max-steps
    ]
    refused_in_one_line(cases)
    # The README's block shows four of these as a learner meets them: the same lines, word for word.
    shown = [b for b in BLOCKS if b.doc == ROOT / STAGE / "README.md" and b.lang == "text"
             and b.body.startswith(f"{STAGE}/train.py: error: argument --tp")]
    printed = [refusal(args, env)[1].strip().replace(ck, "runs/ck") for args, env in [
        (["--parallel", "fsdp", "--tp", "4", "--heads", "2"], {"WORLD_SIZE": "4"}), (["--context", "200000"], {}),
        (["--data", "missing.txt"], {}), ([*TINY, "--context", "64", "--batch-size", "4", "--snapshot", ck], {})]]
    assert len(shown) == 1 and shown[0].body.strip().splitlines() == printed, printed
    # The controls: a tp that divides 4 heads, a context the text holds, the checkpoint's own model.
    assert refusal(["--parallel", "fsdp", "--tp", "4"], {"WORLD_SIZE": "4"})[0] == "accepted"
    assert refusal(["--data", str(short), "--context", "4"])[0] == "accepted"
    assert refusal([*TINY, "--batch-size", "4", "--max-steps", "12", "--snapshot", ck])[0] == "accepted"


class Recorder(torch.nn.Module):
    """A stand-in for the GPT in Trainer._run_step: a table of logits per character (so the loss and the gradient
    are real), and a record of the windows each forward was given."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.logits = torch.nn.Parameter(torch.randn(vocab, vocab, dtype=torch.float64))
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.clone())
        return self.logits[x]


def trainer_step(gpt, tokens: torch.Tensor, dp_rank: int, dp: int, batch: int, accumulate: int, step: int = 5):
    """Trainer._run_step, the stage's own code, on a stand-in trainer of dp rank `dp_rank` of `dp`: (the micro-batches
    its model was given, the loss it returned, the gradient the backward left before the optimizer's step)."""
    model = Recorder(int(tokens.max()) + 1)
    grads = []

    class KeepGradient:  # the optimizer: keeps what backward accumulated instead of stepping
        param_groups: list[dict] = []

        def step(self) -> None:
            grads.append(model.logits.grad.clone())

        def zero_grad(self, set_to_none: bool = True) -> None:
            model.logits.grad = None

    trainer = SimpleNamespace(
        model=model, optimizer=KeepGradient(), corpus=SimpleNamespace(train=tokens), cfg=SimpleNamespace(context=16),
        args=SimpleNamespace(seed=3, batch_size=batch, accumulate=accumulate, amp=None, clip=0, lr=0.1, sp=False,
                             warmup_steps=1, decay_steps=10),
        steps=step, dp_rank=dp_rank, dp=dp, global_batch=dp * accumulate * batch, device=torch.device("cpu"),
        syncing=lambda last: contextlib.nullcontext())
    loss, _ = gpt.Trainer._run_step(trainer)  # the step's loss and gradient norm
    return model.seen, loss.item(), grads[0]


@pytest.mark.parametrize("dp,batch,accumulate", [(2, 2, 1), (2, 1, 2), (4, 1, 2)])
def test_w_ranks_take_the_windows_of_one_process(dp, batch, accumulate):
    """Trainer._run_step, run for each dp rank of W (each cutting its rows in --accumulate micro-batches), against
    one process of batch W x b x K: every window of the global batch goes to exactly one rank, each micro-batch has
    --batch-size windows, and the mean of the ranks' losses and gradients (what DDP's all-reduce makes of them) is
    the one process's, to float64 rounding. The batch itself depends on --seed and the step alone."""
    gpt = load_stage(STAGE)
    tokens = torch.randint(0, 50, (1000,), generator=torch.Generator().manual_seed(1))
    whole, loss, grad = trainer_step(gpt, tokens, 0, 1, dp * batch * accumulate, 1)
    (everything,) = whole
    x, y = gpt.batch_of_windows(tokens, 16, dp * batch * accumulate, seed=3, step=5)
    assert torch.equal(everything, x) and torch.equal(y[:, :-1], x[:, 1:])
    assert not torch.equal(gpt.batch_of_windows(tokens, 16, len(x), seed=3, step=6)[0], x)
    ranks = [trainer_step(gpt, tokens, r, dp, batch, accumulate) for r in range(dp)]
    micro = [m for seen, _, _ in ranks for m in seen]
    assert [len(m) for m in micro] == [batch] * dp * accumulate, [m.shape for m in micro]
    assert sorted(map(tuple, torch.cat(micro).tolist())) == sorted(map(tuple, x.tolist())), "not a partition"
    assert sum(r[1] for r in ranks) / dp == pytest.approx(loss, abs=1e-12, rel=0)
    worst = (sum(r[2] for r in ranks) / dp - grad).abs().max().item()
    assert worst <= 1e-15, f"the mean of the ranks' gradients is {worst:.2e} from one process's"



class Recording(TorchDispatchMode):
    """Every op torch dispatches inside the `with`, run as it is; `what(func, args, kwargs)` says what to keep of each
    (a set, empty for ops of no interest): the dtypes a computation really ran in, whatever autocast or FSDP2 did."""

    def __init__(self, what) -> None:
        super().__init__()
        self.what, self.seen = what, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen |= self.what(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))

def test_bf16_autocast_computes_the_matmuls_in_bfloat16(runs):
    """--amp bf16: Trainer._run_step on the tiny GPT in float32 runs every matrix product (the linear layers and the
    attention) in bfloat16, and without --amp in float32 (the control); its loss stays within bf16's rounding
    (8 bits of mantissa; measured 3e-5 on the first step) of float32's, and outside float32's own (~1e-7). The
    launched run took the same path end to end: its per-step losses are the float64 reference's within that
    margin, and not within float32's."""
    gpt = load_stage(STAGE)
    products = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product")  # the aten ops that multiply matrices

    def matrix_products(func, args, kwargs) -> set[tuple[str, torch.dtype]]:
        name = func.__name__.split(".")[0]
        if not name.startswith(products) or name.endswith("_backward"):
            return set()
        operands = args[:3] if name.startswith("_scaled_dot_product") else args  # attention's: q, k and v
        return {(name, a.dtype) for a in operands if isinstance(a, torch.Tensor)}

    corpus = gpt.load_corpus(DATA)
    found = {}
    for amp in ("bf16", None):
        torch.manual_seed(0)
        model = gpt.GPT(gpt.Config(len(corpus.chars), 32, 2, 2, 32))
        trainer = SimpleNamespace(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), corpus=corpus,
            cfg=model.cfg, args=SimpleNamespace(seed=0, batch_size=4, accumulate=1, amp=amp, clip=0, lr=0.0, sp=False,
                                                warmup_steps=1, decay_steps=1),
            steps=0, dp_rank=0, dp=1, global_batch=4, device=torch.device("cpu"),
            syncing=lambda last: contextlib.nullcontext())
        with Recording(matrix_products) as mode:
            loss = gpt.Trainer._run_step(trainer)[0].item()
        found[amp] = (loss, {dtype for _, dtype in mode.seen}, {name for name, _ in mode.seen})
    assert found["bf16"][1] == {torch.bfloat16} and found[None][1] == {torch.float32}, found
    names = found["bf16"][2]  # the linear layers forward (addmm) and backward (mm), and the attention forward
    assert {"addmm", "mm"} <= names and any(n.startswith("_scaled_dot_product") for n in names), names
    assert 2e-6 < abs(found["bf16"][0] - found[None][0]) < 2e-2, found
    s, ref = runs["bf16"].summary, runs["one"].summary
    assert (s["amp"], s["dtype"], s["steps"]) == ("bf16", "float32", 3) and "--amp bf16" in runs["bf16"].stdout
    gaps = [abs(a - b) for a, b in zip(s["losses"], ref["losses"][:3], strict=True)]
    assert 2e-6 < max(gaps) < 2e-2, gaps


def test_compile_computes_the_eager_training(runs):
    """--compile (every block through torch.compile, inductor on the CPU), in float64: the same losses and the same
    state after 3 steps (weights and AdamW's moments) as the eager reference, within sqrt(eps) (measured: 1.5e-14;
    inductor fuses and reorders, so not bit for bit)."""
    run = runs["compiled"]
    assert run.summary["compile"] is True and "--compile" in run.stdout
    worst, shared = compare(run, runs["one"])
    assert shared == [0, 3] and worst <= TOL, f"compiled vs eager: {worst:.2e}"


def test_bf16_with_fsdp_computes_with_bfloat16_weights_and_steps_float32_shards():
    """--amp bf16 --parallel fsdp: FSDP2's MixedPrecisionPolicy, not autocast alone. Every linear layer computes
    with bfloat16 weights (what the all-gather hands over: half the bytes), while the shards the optimizer steps stay
    float32 and their gradients are reduced in float32 (reduce_dtype: the buffer FSDP2 packs them into for the
    reduce-scatter, fsdp.chunk_cat's output); without --amp (the control) the layers compute with float32 weights.
    (One rank, in this process: the casts are the policy's, whatever W.)"""
    def packed_for_the_reduce_scatter(func, args, kwargs) -> set[torch.dtype]:
        return {kwargs["out"].dtype} if str(func).startswith("fsdp.chunk_cat") else set()

    gpt = load_stage(STAGE)
    seen = {}
    with group_of_one():
        grid = gpt.Grid({"dp": 1, "tp": 1}, torch.device("cpu"), 60)
        for amp in ("bf16", None):
            torch.manual_seed(0)
            model = gpt.parallelize(gpt.GPT(gpt.Config(65, 32, 2, 2, 32)),
                                    grid, SimpleNamespace(tp=1, ac="none", compile=False, parallel="fsdp", amp=amp))
            computed: set[torch.dtype] = set()
            for layer in [m for m in model.modules() if isinstance(m, torch.nn.Linear)]:
                layer.register_forward_pre_hook(lambda mod, _, into=computed: into.add(mod.weight.dtype))
            idx = torch.randint(0, 65, (2, 32), generator=torch.Generator().manual_seed(0))
            with Recording(packed_for_the_reduce_scatter) as reduced:
                model(idx).float().logsumexp(-1).mean().backward()
            seen[amp] = (computed, reduced.seen, {p.dtype for p in model.parameters()},
                         {p.grad.dtype for p in model.parameters()})
    assert seen["bf16"] == ({torch.bfloat16}, {torch.float32}, {torch.float32}, {torch.float32}), seen
    assert seen[None] == ({torch.float32}, {torch.float32}, {torch.float32}, {torch.float32}), seen


@pytest.mark.parametrize("stage", ["10_pipeline_parallel", STAGE, "12_context_parallel", "13_pipeline_4d",
                                   "14_experts"])
def test_the_oldest_torch_it_accepts_is_accepted(stage, monkeypatch, capsys):
    """The control of test_faults' refusal of the torch before the one NEEDS_TORCH names for 10-14 (2.5.1; 2.6.0 for
    14): their top-of-file check, then check_args. The minimum itself gets past both, so a check that refused every
    version fails here. (Stage 10's case lives here too: test_faults.py, which holds the refusals, is edited by
    others; it belongs beside them.)"""
    from torch.torch_version import TorchVersion

    from harness import load_copy
    major, minor = load_stage("01_single_gpu").NEEDS_TORCH[stage]
    assert (major, minor) == ((2, 7) if stage == "14_experts" else (2, 6))
    for version, accepted in ((f"{major}.{minor}.0", True), (f"{major}.{minor - 1}.1", False)):
        monkeypatch.setattr(torch, "__version__", TorchVersion(version))
        try:
            load_copy(ROOT / stage / "train.py").parse_args(["--device", "cpu"])
            code = None
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err.strip()
        assert (code is None and not err) if accepted else \
            (code == 2 and "\n" not in err and f"{major}.{minor}" in err), (version, code, err)


def test_the_learning_rate_warms_up_then_decays_along_a_cosine():
    """The schedule: --lr x (step + 1) / --warmup-steps while warming up, --lr at the warm-up's end, down to --lr / 10
    at --decay-steps along half a cosine (halfway: the mean of the two), and --lr / 10 after it."""
    lr = load_stage(STAGE).learning_rate
    args = SimpleNamespace(lr=0.01, warmup_steps=4, decay_steps=24)
    rates = [lr(step, args) for step in range(30)]
    assert rates[:4] == pytest.approx([0.0025, 0.005, 0.0075, 0.01])
    assert rates[4] == pytest.approx(0.01) and rates[14] == pytest.approx(0.0055)
    assert rates[24:] == pytest.approx([0.001] * 6)
    assert all(a > b for a, b in zip(rates[4:24], rates[5:25], strict=True))


def test_clipping_scales_the_whole_gradient_to_the_bound():
    """clip_gradients on a plain model: the norm it returns is the whole gradient's before clipping; after, the
    gradient has norm --clip and the same direction; below the bound, or with --clip 0, it is left as it was."""
    gpt = load_stage(STAGE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = torch.cat([g.flatten() for g in before]).norm().item()
    assert gpt.clip_gradients(model, 0).item() == pytest.approx(norm) and \
        all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    assert gpt.clip_gradients(model, 2 * norm).item() == pytest.approx(norm) and \
        all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    assert gpt.clip_gradients(model, norm / 4).item() == pytest.approx(norm)
    for p, g in zip(model.parameters(), before, strict=True):
        assert torch.allclose(p.grad, g / 4, rtol=1e-5), (p.grad, g)


def test_weight_decay_falls_on_the_matrices_only():
    """AdamW's two groups: decay 0.1 on the linear layers' weights (the head's too), none on the embeddings, biases
    and norms; every parameter in exactly one group."""
    gpt = load_stage(STAGE)
    corpus = gpt.load_corpus(DATA)
    args = gpt.parse_args([*TINY])
    with mock.patch.object(gpt, "parallelize", lambda model, grid, args: model):  # one process, nothing split
        _, model, optimizer = gpt.load_train_objs(args, corpus, torch.device("cpu"), grid=None)
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    names = {n: decay[id(p)] for n, p in model.named_parameters()}
    assert len(decay) == len(names) == sum(len(g["params"]) for g in optimizer.param_groups)
    decayed = sorted(n for n, d in names.items() if d)
    assert all(d in (0.0, 0.1) for d in names.values()) and decayed == sorted(
        n for n in names if n.endswith("weight") and ".norm" not in n and not n.startswith(("tokens", "positions",
                                                                                               "norm"))), decayed
    assert "head.weight" in decayed and "blocks.0.attn.q.weight" in decayed and "tokens.weight" not in decayed


def test_the_baselines_are_the_corpus_counts():
    """Checked by hand on a tiny text: uniform ln V; unigram and bigram from add-one counts of the training part."""
    gpt = load_stage(STAGE)
    corpus = gpt.Corpus("ab", torch.tensor([0, 0, 1, 0, 0, 1, 0, 0, 1]), torch.tensor([0, 1]))
    b = gpt.baselines(corpus)
    assert b["uniform"] == pytest.approx(math.log(2))
    assert b["unigram"] == pytest.approx(-math.log(4 / 11))  # 'b' seen 3 times in 9, plus one each: 4 / 11
    assert b["bigram"] == pytest.approx(-math.log(4 / 8))  # after 'a': 'a' 3 times and 'b' 3 times; plus one each


def test_the_corpus_is_the_one_its_provenance_note_names():
    """11_gpt/data/input.txt is tiny Shakespeare as pytorch/examples and char-rnn carry it: size and sha256, as
    data/README.md states them (the stage downloads nothing)."""
    text = DATA.read_bytes()
    digest = hashlib.sha256(text).hexdigest()
    assert (len(text), digest) == (1_115_394, "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed")
    note = (DATA.parent / "README.md").read_text()
    assert f"{len(text):,} bytes" in note and digest in note


QUICK = "python benchmarks/gpt_scaling.py --quick --out runs/gpt_scaling_quick"  # the README's quick run


@pytest.mark.readme_run(QUICK)
def test_the_scaling_benchmark_writes_its_table_and_figure(readme_runs):
    """The README's quick run of benchmarks/gpt_scaling.py (W = 1 and 2, a tiny model): its CSV, PNG and table."""
    run = readme_run(readme_runs, QUICK)
    rows = read_csv(run.out / "gpt_scaling.csv")
    assert [(r["setting"], r["processes"], r["dp"], r["tp"]) for r in rows] == \
        [("1 process, 1 thread", "1", "1", "1"), ("DDP, W = 2", "2", "2", "1")], rows
    assert int(rows[1]["global_batch"]) == 2 * int(rows[0]["global_batch"])
    base = float(rows[0]["tokens_per_s"])
    for r in rows:  # the speed is the median of the rounds' speeds it prints, and the efficiency is of those speeds
        assert float(r["tokens_per_s"]) == pytest.approx(statistics.median(map(float, r["rounds"].split())), abs=0.5), r
        assert int(r["tokens_per_step"]) == int(r["global_batch"]) * 64, r  # --quick's context
        # DDP keeps every parameter whole with its gradient and AdamW's two moments: 4 float32 numbers each
        assert float(r["model_state_mib_per_rank"]) == pytest.approx(int(r["parameters"]) * 16 / 2**20, rel=1e-5), r
        assert float(r["efficiency"]) == pytest.approx(float(r["tokens_per_s"]) / (int(r["cores"]) * base), rel=1e-4), r
    for r in rows:  # the MFU is of the table's own tokens/s, over the peak the run measured
        mfu = float(r["tokens_per_s"]) * float(r["flops_per_token"]) / (float(r["peak_gflops"]) * 1e9)
        assert float(r["mfu"]) == pytest.approx(mfu, rel=1e-4) and 0 < mfu < 1, r
    assert (run.out / "gpt_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"^DDP, W = 2 +2 +2 +2 x 1 +32 ", run.stdout, re.M), run.stdout
