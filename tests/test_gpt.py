"""Stage 11: a GPT on Shakespeare computes the same training however it is split, resumes exactly, and refuses bad
input in one line.

Seven launches of a tiny model (2 blocks, 2 heads, width 32, context 32) in float64, global batch 4, serve every
assert; the single-process run is the reference:

    one       python, batch 4, 12 steps, a checkpoint every 3 (its trajectory: the state at 0, 3, 6, 9, 12)
    half      python, batch 4, 6 steps;  resumed: the same command, --max-steps 12, from half's checkpoint
    ddp       torchrun, 2 processes of batch 1 x --accumulate 2 (DDP, no_sync), 12 steps, a checkpoint every 3
    fsdp      torchrun, 2 processes of batch 1 x --accumulate 2, --parallel fsdp, 6 steps
    tp        torchrun, --parallel fsdp --tp 2 (dp 1 x tp 2) of batch 4, resumed from fsdp's checkpoint to 12 steps
    broken    a copy of the stage with the causal mask dropped on rank 1, DDP 2 x 2, 3 steps: the negative control

States are compared whole (weights and both AdamW moments) at every step where both runs recorded one, within
sqrt(eps) of float64 (1.5e-8; correct runs differ by ~1e-14); the resumed single process bit for bit. Bad input is
checked in this process, through main() up to where it would join a group. The scaling benchmark's check reads the
run of its quick command in 11_gpt/README.md (the readme_run marker), which the README test runs anyway.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import torch

from conftest import readme_run
from harness import ROOT, Run, Step, check, clean_env, launch, load_stage, mutate, tolerance

STAGE = "11_gpt"
TOL = tolerance("float64")
DATA = ROOT / STAGE / "data" / "input.txt"
TINY = ("--layers", "2", "--heads", "2", "--width", "32", "--context", "32", "--dtype", "float64", "--device", "cpu",
        "--eval-every", "3", "--save-every", "3", "--sample", "40", "--lr", "0.01")
CAUSAL = "y = F.scaled_dot_product_attention(q, k, v, is_causal=True)"


def step(launcher: str, *args: str, nproc: int = 1) -> Step:
    return Step(STAGE, launcher, (*TINY, *args), nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
    """The seven runs, two at a time (independent ones side by side; a resumed run after the one it resumes)."""
    tmp = tmp_path_factory.mktemp("gpt")
    broken = mutate(STAGE, CAUSAL, CAUSAL.replace("is_causal=True", 'is_causal=os.environ.get("RANK") != "1"'),
                    tmp / "broken_stage")
    chains = {
        "one": [step("python", "--batch-size", "4", "--max-steps", "12", "--snapshot", str(tmp / "ck_one"))],
        "half": [step("python", "--batch-size", "4", "--max-steps", "6", "--snapshot", str(tmp / "ck_half")),
                 step("python", "--batch-size", "4", "--max-steps", "12", "--snapshot", str(tmp / "ck_half"))],
        "ddp": [step("torchrun", "--batch-size", "1", "--accumulate", "2", "--max-steps", "12", "--snapshot",
                     str(tmp / "ck_ddp"), nproc=2)],
        "fsdp": [step("torchrun", "--batch-size", "1", "--accumulate", "2", "--parallel", "fsdp", "--max-steps", "6",
                      "--snapshot", str(tmp / "ck_fsdp"), nproc=2),
                 step("torchrun", "--batch-size", "4", "--parallel", "fsdp", "--tp", "2", "--max-steps", "12",
                      "--snapshot", str(tmp / "ck_fsdp"), nproc=2)],
        "broken": [step("torchrun", "--batch-size", "2", "--max-steps", "3", "--data", str(DATA), nproc=2)],
    }
    names = {"half": ["half", "resumed"], "fsdp": ["fsdp", "tp"]}

    def run_chain(chain: str) -> list[Run]:
        done = []
        for i, s in enumerate(chains[chain]):
            name = names.get(chain, [chain])[i]
            script = broken if chain == "broken" else None
            done.append(check(launch(s, out=tmp / name, script=script, timeout=180)))
        return done

    with ThreadPoolExecutor(max_workers=2) as pool:
        finished = dict(zip(chains, pool.map(run_chain, chains), strict=True))
    return {name: run for chain, done in finished.items() for name, run in zip(names.get(chain, [chain]), done,
                                                                                 strict=True)}


def gap(a: dict, b: dict) -> float:
    """Largest |difference| between two recorded states: the weights and AdamW's two moments, by name."""
    keys = ("params", "exp_avg", "exp_avg_sq")  # no moments yet at step 0
    assert a["step"] == b["step"] and all(a[key].keys() == b[key].keys() for key in keys)
    return max((a[key][n] - b[key][n]).abs().max().item() for key in keys for n in a[key])


def states(run: Run) -> dict[int, dict]:
    return {s["step"]: s for s in run.trajectory}


def compare(run: Run, reference: Run) -> tuple[float, list[int]]:
    """(the largest gap over the steps both recorded, those steps); the per-step losses must agree too."""
    ours, theirs = states(run), states(reference)
    shared = sorted(ours.keys() & theirs.keys())
    losses = run.summary["losses"]
    assert losses == pytest.approx(reference.summary["losses"][:len(losses)], abs=TOL, rel=0), "losses differ"
    return max(gap(ours[s], theirs[s]) for s in shared), shared


def test_the_reference_learns_and_reports(runs):
    s = runs["one"].summary
    assert (s["world_size"], s["dp"], s["tp"], s["parallel"], s["global_batch"]) == (1, 1, 1, "ddp", 4)
    assert s["steps"] == 12 and len(s["losses"]) == 12 and [c[0] for c in s["curve"]] == [3, 6, 9, 12]
    assert s["losses"][-1] < s["losses"][0] - 0.2, s["losses"]  # 12 steps at lr 0.01: from ln 65 = 4.17 down
    # The held-out loss counts every held-out character but the first, once (111,540 held out); the baselines
    # are the corpus's: ln 65 for the uniform one, and bigram < unigram < uniform.
    b = s["baselines"]
    assert s["eval_count"] == 111_539 and b["uniform"] == pytest.approx(math.log(65))
    assert b["bigram"] < b["unigram"] < b["uniform"]
    assert len(s["sample"]) == 40 and "sample (40 characters" in runs["one"].stdout
    assert s["tokens_per_s"] > 0 and s["mfu"] is None and s["memory"]["peak"][0] > 0
    assert [t["step"] for t in runs["one"].trajectory] == [0, 3, 6, 9, 12]
    model = load_stage(STAGE).GPT(load_stage(STAGE).Config(**s["model"]))
    model.load_state_dict(runs["one"].model)  # the plain GPT: no "module." prefix, every shape whole


def test_a_resumed_run_is_the_uninterrupted_one_bit_for_bit(runs):
    resumed, one = runs["resumed"], runs["one"]
    assert "at step 6" in resumed.stdout and resumed.summary["resumed_at"] == 6
    assert resumed.summary["losses"] == one.summary["losses"]
    assert [t["step"] for t in resumed.trajectory] == [6, 9, 12]
    for s, state in states(resumed).items():
        assert gap(state, states(one)[s]) == 0.0, s
    assert all(torch.equal(resumed.model[k], one.model[k]) for k in one.model)


def test_ddp_over_two_processes_with_accumulation_is_one_process(runs):
    """2 processes x batch 1 x 2 micro-batches (no_sync on the first) = 1 process of batch 4."""
    s = runs["ddp"].summary
    assert (s["world_size"], s["dp"], s["accumulate"], s["global_batch"]) == (2, 2, 2, 4)
    worst, shared = compare(runs["ddp"], runs["one"])
    assert shared == [0, 3, 6, 9, 12] and worst <= TOL, f"DDP vs one process: {worst:.2e}"
    assert s["eval_loss"] == pytest.approx(runs["one"].summary["eval_loss"], abs=TOL, rel=0)


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
    assert s["replica_max_abs_diff"] == 0.0 and s["sample"] == runs["one"].summary["sample"]


def test_a_causal_mask_dropped_on_one_rank_is_caught(runs):
    """Negative control: rank 1 lets each position see the characters after it. Its loss is another's, so the
    averaged gradient is not the reference's: off by far more than the tolerance from the first step (measured: the
    first loss by 7.8e-4, the state after 3 steps by 5.8e-2; a correct DDP run by ~1e-15 and ~1e-14)."""
    worst = gap(states(runs["broken"])[3], states(runs["one"])[3])
    first = abs(runs["broken"].summary["losses"][0] - runs["one"].summary["losses"][0])
    assert worst > 1e-3 and first > 1e3 * TOL, (worst, first)


class Accepted(Exception):
    """Raised where main() would join a process group: it got past every check of its arguments and files."""


def refusal(args: list[str], env: dict[str, str] | None = None) -> tuple[object, str]:
    """(exit code, stderr) of the stage's main(args) in this process, stopped before it would join a group."""
    module, err = load_stage(STAGE), io.StringIO()
    with mock.patch.dict(os.environ, {**clean_env(), **(env or {})}, clear=True), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()), mock.patch.object(module, "ddp_setup", side_effect=Accepted):
        try:
            module.main(args)
        except SystemExit as e:
            return e.code, err.getvalue()
        except Accepted:
            pass
    return "accepted", err.getvalue()


def test_bad_input_is_one_line_and_exit_2(runs, tmp_path):
    """A tp that does not divide the heads, a context longer than the text or than the checkpoint's model, an
    unreadable corpus; and, as a control, the same settings made right are accepted."""
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
    ]
    for args, env, message in cases:
        code, err = refusal(args, env)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{STAGE}/train.py: error: ") \
            and message in lines[0], (args, code, err)
    # The controls: a tp that divides 4 heads, a context the text holds, the checkpoint's own model.
    assert refusal(["--parallel", "fsdp", "--tp", "4"], {"WORLD_SIZE": "4"})[0] == "accepted"
    assert refusal(["--data", str(short), "--context", "4"])[0] == "accepted"
    assert refusal([*TINY, "--batch-size", "4", "--snapshot", ck])[0] == "accepted"


def test_the_data_order_is_one_order_for_every_layout():
    """Step s's global batch depends on --seed and s alone, and rank r of W takes rows r, r+W, ...: W ranks of batch
    b see exactly the windows of one process of batch W*b (and --accumulate K cuts each rank's rows in K)."""
    gpt = load_stage(STAGE)
    tokens = torch.arange(1000)
    x, y = gpt.batch_of_windows(tokens, 16, 8, seed=3, step=5)
    assert torch.equal(y, x + 1) and x.shape == (8, 16)
    assert torch.equal(gpt.batch_of_windows(tokens, 16, 8, seed=3, step=5)[0], x)
    assert not torch.equal(gpt.batch_of_windows(tokens, 16, 8, seed=3, step=6)[0], x)
    rows = torch.cat([x[r::2] for r in range(2)])
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, x.tolist()))


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
    with open(run.out / "gpt_scaling.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["setting"], r["processes"], r["dp"], r["tp"]) for r in rows] == \
        [("1 process, 1 thread", "1", "1", "1"), ("DDP, W = 2", "2", "2", "1")], rows
    assert all(float(r["tokens_per_s"]) > 0 and float(r["model_state_mib_per_rank"]) > 0 for r in rows), rows
    assert float(rows[0]["efficiency"]) == 1.0 and int(rows[1]["global_batch"]) == 2 * int(rows[0]["global_batch"])
    assert (run.out / "gpt_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"^DDP, W = 2 +2 +2 +2 x 1 +32 ", run.stdout, re.M), run.stdout
