"""The settings sweep: every script at settings the tour never picks, as a learner types them.

The tour runs every stage at W = 2 with a global batch of 64, which divides the 4,096 samples. A learner brings
W = 1, 3 or 4 processes, batches that leave a short last step (24, 25 or 33 per process), float32 or float64,
other seeds and learning rates, micro-batch counts above and below the pipeline's stages, tensor-parallel degrees
that tile the processes differently, and a checkpoint resumed on another number of processes. Each run must end in
one of three honest ways, never in a traceback, a hang or a silently different training:

- **replay**: it computes stage 01's training, checked as the tour checks it (every epoch replays with stage 01's
  code within sqrt(eps)). Where the ranks cannot share the data evenly (W = 3), DistributedSampler repeats a few
  samples: the run must say so before its first epoch, in one line naming how many, and the replay follows
  exactly that order (the summary's `epoch_samples`, `tour.epoch_order`), so a run that repeats other samples, or
  says nothing, fails;
- **own**: a recipe whose training is not stage 01's by design (bf16 autocast, a model with BatchNorm, uneven
  ranks, your own model): it must still end cleanly at these settings, say in its first lines what differs, and
  learn;
- **refuse**: one line on stderr naming the flag (the same on every rank), before training, and the whole job ends
  (REFUSED: W = 4 with three pipeline stages).

Which settings: in CI a covering table over one script for each way of reading the data and taking a step
(CI_SCRIPTS: 14 of the 24), each once at settings chosen so that every pair of values of (W, batch per process,
dtype, seed and learning rate) appears somewhere in the table (a greedy pairwise cover, `covering()`), plus the rows
that only some scripts have (pipeline and tensor-parallel layouts, resuming on another W), stage 03 replayed at
W = 3 (the cover gives it float32 at lr 0.1, which need only learn) and the refused one: 19 rows, 20 launches, 74 s
alone on a 2-core machine without AVX-512 (2026-11-28; the launches forked from the suite's server,
tests/forkrun.py). A control replays one W = 3 row as if nothing were padded: it must fail.
`pytest tests/test_settings.py --sweep=full` runs the full grid instead: every script at every combination its
layout allows, every layout, resuming both ways (1,143 launches: 2 to 3 hours on 2 cores, at ~16 CPU-s a launch).

The GPT stages (11-14) keep another promise, and have their own rows (GptRow, test_gpt_setting): at any layout a run
computes the one-process training of its stage, with the same seed, global batch and schedule (stage 14 also the same
micro-batches: its balancing loss is of each micro-batch's load), within sqrt(eps) of float64 step by step (the states,
every step's loss and gradient norm: test_gpt.gaps), and scores the held-out text, samples and saves as one process
does; or it refuses in one line naming the flag, exit 2 (checked in this process through main(), as test_gpt.refusal
does: no launch). Tiny runs (2 blocks, width 32, context 24, 3 steps) on harness.small_corpus. In CI, six layouts the
GPT tests never launch, all at a global batch of 12 so that they share two one-process references (stage 11's GPT, stage
14's experts): 8 launches, 38 s (the module 103 s, 2026-11-30, 2 cores shared). DDP over 3 ranks with --ac full; dp 2 x
tp 2 --sp --ac selective; HSDP (replicate 2 x shard 2); stage 12's cp 2 x tp 2 --sp --ac full; 13's dp 2 x pp 2 (1F1B)
--ac selective; 14's dp 2 x tp 2 --sp --ep 2 --ac full; all but the first over 3 micro-batches. And ten refusals (tp or
cp not dividing W or the heads, R not dividing dp, --replicate with DDP, an unknown --ac, 1F1B with fewer micro-batches
than stages, fewer blocks than stages, ep not dividing the dp ranks or the experts). `--sweep=full`: every GPT stage x
its layouts (gpt_layouts: DDP, FSDP2, HSDP with shard 1 too, tp with and without --sp, cp 2-4 ring, all-gather and
contiguous, pp 2-3 GPipe and 1F1B, interleaved 1F1B, interleaved zero-bubble and ZB-V, ep 2 and 4, beside tp and pp) at
W = 1, 3, 4 x --ac none, full, selective x 1 or 3 micro-batches (less what the stages refuse), the two seeds and rates
taking turns, and a row of stage 14 that trains otherwise by design (--balance rank: said before training, and its
states differ): 384 launched rows and 14 references, 398 launches. Every row has run and passed (2026-11-30, in parts:
the last 241 in 18 minutes on 2 cores, e.g. `-k "gpt_setting and W4 and selective and not 11_gpt"`, 63 passed in 349 s),
so the whole grid about half an hour.
"""
from __future__ import annotations

import itertools
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import pytest

from harness import (
    ROOT,
    TORCHRUN,
    Run,
    Step,
    check,
    launch,
    launch_commands,
    replay_error,
    small_corpus,
    time_limit,
    tolerance,
)
from test_gpt import gaps, refusal

N_TRAIN = 4096
EPOCHS = 2  # the replay checks every epoch; two are enough to see a wrong order, batch or divisor
WORLDS = (1, 3, 4)  # the tour's is 2
BATCHES = (24, 25, 33)  # per process: none gives a global batch that divides 4,096 at W = 1, 3 or 4
DTYPES = ("float64", "float32")
SEED_LR = ((7, 0.02), (3, 0.1), (0, 0.05))
FACTORS = {"world": WORLDS, "batch": BATCHES, "dtype": DTYPES, "seed_lr": SEED_LR}
PREFERRED = (3, 1, 4)  # once every pair is covered: W = 3 pads the data, W = 4 costs a process more
POOL = 2  # launches at once: most runs keep a core busy per process only part of the time


@dataclass(frozen=True)
class Setting:
    script: str  # a folder with train.py ("04_ddp_torchrun", "recipes/compile") or a file ("ddp_by_hand/naive.py")
    world: int
    batch: int  # per process; the script's --batch-size is this times the processes that share a batch (tp, pp)
    dtype: str
    seed: int
    lr: float
    expect: str = "replay"  # "replay", "own" or "refuse"
    extra: tuple[str, ...] = ()
    variant: int = 0  # which of the script's layouts (pipeline and tensor-parallel degrees): see layout()
    resume_from: int | None = None  # a first run at this W writes a checkpoint; this run resumes it at `world`
    says: str | None = None  # "own": what its first lines say of how its training differs; "refuse": its error

    @property
    def id(self) -> str:
        resume = f"-resumed-from-W{self.resume_from}" if self.resume_from else ""
        flags = " ".join((*layout(self.script, self.world, self.variant)[0], *self.extra))
        return (f"{self.script.removesuffix('.py').replace('/', '.')}-W{self.world}{resume}-b{self.batch}-"
                f"{self.dtype}-s{self.seed}-lr{self.lr:g}{(' ' + flags) if flags else ''}")


# --- what each script is, and how it is launched at W processes ----------------------------------------------------

SINGLE = ("01_single_gpu", "02_dataparallel")  # one process
LAUNCHED = ("04_ddp_torchrun", "06_checkpoint", "07_model_parallel", "08_fsdp", "09_tensor_parallel",
            "10_pipeline_parallel", "10_pipeline_parallel/by_hand.py", "ddp_by_hand/naive.py",
            "ddp_by_hand/bucketed.py", "recipes/comm_hooks", "recipes/compile", "recipes/ddp_options",
            "recipes/grad_accumulation", "recipes/mixed_precision", "recipes/sync_batchnorm", "recipes/uneven_inputs",
            "your_model/fsdp.py",  # (your_model/ddp.py's sampler and note are fsdp.py's, line for line)
            "zero_by_hand/zero1.py", "zero_by_hand/zero2.py", "zero_by_hand/zero3.py")
SCRIPTS = (*SINGLE, "03_ddp_spawn", "05_multinode", *LAUNCHED)  # LAUNCHED: by torchrun
# Training that is not stage 01's by design, and what the run's first lines say about it (your_model's scripts train
# another model on other data, as a learner's own script would: they say nothing of stage 01, and must learn).
OWN = {"recipes/mixed_precision": "autocast bfloat16", "recipes/sync_batchnorm": "with a BatchNorm",
       "recipes/uneven_inputs": "samples per rank", "your_model/ddp.py": None, "your_model/fsdp.py": None}
# A setting nothing honest can run: W = 4 with three pipeline stages (pp must divide W). Refused in one line.
REFUSED = Setting("10_pipeline_parallel", 4, 24, "float64", 7, 0.02, expect="refuse", extra=("--pp", "3"),
                  says="10_pipeline_parallel/train.py: error: argument --pp: 3 must divide the world size 4")
# Flags a script needs at a setting, and how many processes share one batch (tp or pp ranks see the same samples).
RESUMABLE = {"06_checkpoint": "s.pt", "08_fsdp": "ck"}  # --snapshot: a file, a directory


def layout(script: str, world: int, variant: int = 0) -> tuple[tuple[str, ...], int]:
    """(extra flags, processes sharing a batch) for `script` at `world`; `variant` picks among the layouts."""
    if script == "09_tensor_parallel":  # tp divides W and the 4 classes: W = 4 as dp 1 x tp 4, or dp 2 x tp 2
        degrees = [d for d in (4, 2, 1) if world % d == 0]
        tp = degrees[variant % len(degrees)]
        return ("--tp", str(tp)), tp
    if script.startswith("10_pipeline_parallel"):  # pp: a divisor of W, at most the 3 layers
        most = max(d for d in (1, 2, 3) if world % d == 0)
        pp, schedule, microbatches = ((most, "1f1b", 2 * most + 1),  # odd, above the stages
                                      (most, "gpipe", max(most - 1, 1)),  # below the stages (GPipe allows it)
                                      (1, "1f1b", 3))[variant % 3]  # no pipeline: dp alone
        return ("--pp", str(pp), "--microbatches", str(microbatches), "--schedule", schedule), pp
    if script == "recipes/grad_accumulation":
        return ("--accumulate", "3"), 1  # with batch 24 to 33 and W = 3 or 4: a short last step, every epoch
    if script == "recipes/sync_batchnorm":  # SyncBatchNorm needs GPUs (refused on the CPU in one line)
        return ("--batchnorm", "local"), 1
    if script == "recipes/ddp_options":
        return ("--static-graph", "--gradient-as-bucket-view"), 1
    return (), 1


ALSO_ALONE = ("03_ddp_spawn", "04_ddp_torchrun", "08_fsdp")  # a group of one, as `--world-size 1` or plain python


def allowed(script: str, world: int) -> bool:
    return world == 1 if script in SINGLE else world > 1 or script in ALSO_ALONE


def commands(s: Setting, out: Path, world: int | None = None, epochs: int = EPOCHS) -> tuple[list[list[str]], dict]:
    """The command(s) of one run of `s` at `world` processes (default: s.world), and its environment."""
    world = world or s.world
    extra, share = layout(s.script, world, s.variant)
    path = ROOT / s.script if s.script.endswith(".py") else ROOT / s.script / "train.py"
    args = ["--device", "cpu", "--epochs", str(epochs), "--batch-size", str(s.batch * share), "--dtype", s.dtype,
            "--seed", str(s.seed), "--lr", f"{s.lr:g}", *extra, *s.extra]
    if s.script.startswith("your_model"):  # your own script: its own flags, no seed or dtype, --out always
        args = ["--device", "cpu", "--epochs", str(epochs), "--batch-size", str(s.batch), "--lr", f"{s.lr:g}"]
    if s.script in RESUMABLE:
        args += ["--snapshot", str(out.parent / f"{out.name}-snapshot" / RESUMABLE[s.script])]
    args += ["--out", str(out)]
    one_thread = {"OMP_NUM_THREADS": "1"}
    if s.script in SINGLE or (s.script == "04_ddp_torchrun" and world == 1 and not s.resume_from):
        return [[sys.executable, str(path), *args]], one_thread
    if s.script == "03_ddp_spawn":
        return [[sys.executable, str(path), "--world-size", str(world), *args]], one_thread
    if s.script == "05_multinode":  # one "node" per process, all on this machine (as the tour runs it)
        return Step("05_multinode", "torchrun", tuple(args), nproc=1, nnodes=world).commands(), one_thread
    return [[*TORCHRUN, "--standalone", f"--nproc_per_node={world}", str(path), *args]], {}




# --- the table -------------------------------------------------------------------------------------------------------

def pairs(combo: dict) -> set:
    return {((a, combo[a]), (b, combo[b])) for a, b in itertools.combinations(FACTORS, 2)}


# In CI, one script for each way of reading the data and taking a step: the others share one of these line for line
# (02 is 01 with DataParallel; 05 and 07 are 04 and 06 on other devices or nodes; bucketed.py is naive.py's loop;
# comm_hooks, compile, ddp_options and mixed_precision are 04 with an option that leaves the sampler and the step's
# arithmetic alone; zero3.py takes zero1.py's and zero2.py's sharded AdamW step and adds its own gathers). The full
# grid runs every script.
CI_SCRIPTS = ("01_single_gpu", "03_ddp_spawn", "04_ddp_torchrun", "06_checkpoint", "08_fsdp", "09_tensor_parallel",
              "10_pipeline_parallel", "10_pipeline_parallel/by_hand.py", "ddp_by_hand/naive.py",
              "recipes/grad_accumulation", "recipes/sync_batchnorm", "recipes/uneven_inputs", "your_model/fsdp.py",
              "zero_by_hand/zero3.py")


def covering(scripts: tuple[str, ...] = CI_SCRIPTS) -> list[Setting]:
    """Each script once, at the combination (among those its layout allows) that covers the most pairs of factor
    values not covered yet: a greedy pairwise cover, the same on every run (the scores are exact fractions: a float
    sum over a set would depend on the set's order, which changes with Python's hash seed, and so would the table)."""
    uncovered = {pair for combo in grid() for pair in pairs(combo)}
    used: dict = {}  # how often each value was taken: once every pair is covered, the least used come next
    rows = []
    for i, script in enumerate(scripts):
        def chances(pair, later=scripts[i:]) -> int:  # the scripts still to come that can run the pair's W
            world = dict(pair).get("world")
            return sum(world is None or allowed(script, world) for script in later)

        def score(c: dict, uncovered=frozenset(uncovered)) -> tuple[Fraction, int, int]:  # the scarcest pairs first,
            new = pairs(c) & uncovered  # then W = 3 (the case the tour never meets, and cheaper than 4), then the
            return (sum(Fraction(1, chances(pair)) for pair in new), -PREFERRED.index(c["world"]),  # least used
                    -sum(used.get(v, 0) for v in c.items()))
        options = [c for c in grid() if allowed(script, c["world"])]
        best = max(options, key=score)
        uncovered -= pairs(best)  # max() keeps the first of equals: the same table on every run
        used.update({v: used.get(v, 0) + 1 for v in best.items()})
        rows.append(setting(script, best))
    assert not uncovered, f"pairs the table leaves out: {sorted(uncovered)}"
    return rows


def grid() -> list[dict]:
    return [dict(zip(FACTORS, values, strict=True)) for values in itertools.product(*FACTORS.values())]


def setting(script: str, combo: dict, **more) -> Setting:
    seed, lr = combo["seed_lr"]
    return Setting(script, combo["world"], combo["batch"], combo["dtype"], seed, lr,
                   expect="own" if script in OWN else "replay", says=OWN.get(script), **more)


def layouts() -> list[Setting]:
    """Rows only some scripts have: another pipeline and tensor-parallel layout, and resuming on another W. (More
    pipeline layouts, by hand and the library's, at batches with a short last step: tests/test_pipeline.py's grid;
    FSDP's checkpoints resharded onto other W: tests/test_fsdp.py. The full grid has every layout.)"""
    rows = []
    for script, variants in (("10_pipeline_parallel", (1,)), ("09_tensor_parallel", (1,))):
        for variant in variants:
            combo = {"world": (3, 4)[variant % 2], "batch": BATCHES[variant], "dtype": "float64",
                     "seed_lr": SEED_LR[variant]}
            rows.append(setting(script, combo, variant=variant))
    # A snapshot of W = 3 (batch 32 each: 96 a step) resumed by W = 4 (24 each: the same 96).
    rows.append(Setting("06_checkpoint", 4, 24, "float64", 5, 0.05, resume_from=3))
    # mp.spawn (03) replayed at W = 3 too: the cover's row for it is float32 at lr 0.1, which need only learn.
    rows.append(Setting("03_ddp_spawn", 3, 33, "float64", 0, 0.05))
    return [*rows, REFUSED]


def full() -> list[Setting]:
    rows = [setting(script, combo) for script in SCRIPTS for combo in grid() if allowed(script, combo["world"])]
    for script in ("09_tensor_parallel", "10_pipeline_parallel", "10_pipeline_parallel/by_hand.py"):
        rows += [setting(script, combo, variant=v) for v in (1, 2) for combo in grid()
                 if allowed(script, combo["world"])]
    rows += [setting("your_model/ddp.py", combo) for combo in grid() if combo["world"] > 1]
    # Resuming on another W, both ways, for the snapshot (06) and the sharded checkpoint (08).
    return rows + [REFUSED, Setting("06_checkpoint", 4, 24, "float64", 5, 0.05, resume_from=3),
                   Setting("06_checkpoint", 3, 32, "float64", 5, 0.05, resume_from=4),
                   Setting("08_fsdp", 4, 24, "float64", 5, 0.05, resume_from=3),
                   Setting("08_fsdp", 3, 32, "float64", 5, 0.05, resume_from=4)]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "setting" in metafunc.fixturenames:
        rows = full() if metafunc.config.getoption("--sweep") == "full" else [*covering(), *layouts()]
        metafunc.parametrize("setting", rows, ids=[r.id for r in rows])
    if "gpt_row" in metafunc.fixturenames:
        chosen = gpt_rows(metafunc.config)
        metafunc.parametrize("gpt_row", chosen, ids=[r.id for r in chosen])


# --- running them, POOL at a time ------------------------------------------------------------------------------------

@dataclass
class Outcome:
    run: Run
    first: Run | None = None  # the run that wrote the checkpoint a resumed setting starts from
    notes: list[str] = field(default_factory=list)


def run_setting(s: Setting, tmp: Path) -> Outcome:
    out = tmp / re.sub(r"[^\w.=-]", "_", s.id)
    first = None
    if s.resume_from:  # the same global batch on another W: the checkpoint's settings still match
        batch = s.batch * s.world // s.resume_from
        writer = Setting(s.script, s.resume_from, batch, s.dtype, s.seed, s.lr)
        cmds, env = commands(writer, out, epochs=1)  # the same --snapshot path as the resumed run's
        first = check(launch_commands(cmds, None, env, timeout=time_limit(programs=writer.world + len(cmds))))
    cmds, env = commands(s, out, epochs=EPOCHS + 1 if s.resume_from else EPOCHS)
    # Its ranks, and a launcher per command (torchrun's agent, 03's spawning parent: at most one each)
    return Outcome(launch_commands(cmds, out, env, timeout=time_limit(programs=s.world + len(cmds))), first)


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    chosen = [item.callspec.params["setting"] for item in request.session.items
              if item.module is request.module and "setting" in getattr(getattr(item, "callspec", None), "params", {})]
    tmp = tmp_path_factory.mktemp("settings")

    def one(s: Setting) -> Outcome | BaseException:
        try:
            return run_setting(s, tmp)
        except BaseException as e:  # noqa: BLE001 (pytest.fail's exception too: reported by the test that reads it)
            return e
    with ThreadPoolExecutor(max_workers=POOL) as pool:
        return dict(zip([s.id for s in chosen], pool.map(one, chosen), strict=True))


# float32's epoch replay is within sqrt(eps) only while no ReLU unit flips within the epoch: a flip is a jump
# (benchmarks/README.md, "A ReLU flip is a jump"), and rounding flips none in an epoch at lr 0.01 and 0.05 (one
# epoch's rounding <= 1.6e-6 over 60 epochs, benchmarks/rounding.csv). At lr 0.1 one does: stage 10 at W = 4 (dp 2 x
# pp 2), batch 48 per pipeline, seed 3, float32, replays its second epoch 1.2e-2 away (any micro-batch count but 1),
# where float64 at the same setting replays to 4.4e-16 (measured 2026-11-25). Such rows must run and learn; float64
# rows carry the proof.
REPLAYED_FLOAT32_LR = 0.05


def assert_learns(run: Run) -> None:
    accuracy = re.search(r"held-out[^\n]*?accuracy (\d+\.\d+)%", run.stdout)
    assert accuracy and float(accuracy.group(1)) > 80, f"it should learn:\n{run.stdout[-2000:]}"


PADDING = re.compile(r"note: (\d+) samples do not split evenly over (\d+) ranks: DistributedSampler repeats the "
                     r"first (\d+) of each epoch's order")


def test_setting(setting: Setting, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[setting.id]
    if isinstance(outcome, BaseException):
        raise outcome
    if setting.expect == "refuse":  # every rank says the same one line, before any training, and the job ends
        run = outcome.run
        assert run.returncode not in (0, None) and not run.survivors, run.describe()
        errors = {line for line in run.stderr.splitlines() if ": error: " in line}
        assert len(errors) == 1 and next(iter(errors)).startswith(setting.says), run.describe()
        assert "epoch 1" not in run.stdout and not (run.out / "summary.json").exists(), run.describe()
        return
    run = check(outcome.run)
    before_training = run.stdout.split("epoch 1")[0]
    # Where the ranks that share the data (dp) cannot split it evenly, the run says so before training, once.
    dp = setting.world // layout(setting.script, setting.world, setting.variant)[1]
    said = PADDING.findall(before_training)
    if setting.script == "recipes/uneven_inputs":
        assert not said, "the uneven-inputs recipe's sampler repeats nothing"
    elif setting.world > 1 and N_TRAIN % dp:
        assert said == [(str(N_TRAIN), str(dp), str(dp - N_TRAIN % dp))], \
            f"expected one note, before training, that {dp} ranks pad the data:\n{run.stdout[:3000]}"
    else:
        assert not said and "do not split evenly" not in run.stdout, run.stdout[:3000]
    if setting.expect == "own":
        assert setting.says is None or setting.says in before_training, \
            f"the run should say '{setting.says}' before training"
        assert_learns(run)
        return
    s = run.summary
    padded = N_TRAIN + (dp - N_TRAIN % dp if N_TRAIN % dp else 0)
    assert s.get("epoch_samples", N_TRAIN) == padded, s.get("epoch_samples")  # (absent: not padded, as before)
    flags = layout(setting.script, setting.world, setting.variant)[0]
    accumulate = int(flags[flags.index("--accumulate") + 1]) if "--accumulate" in flags else 1
    assert s["global_batch"] == setting.world * setting.batch * accumulate and s["dtype"] == setting.dtype
    assert (s["seed"], s["lr"]) == (setting.seed, setting.lr)
    trajectory = run.trajectory
    start = 1 if setting.resume_from else 0  # a resumed run records from the checkpoint's epoch
    end = EPOCHS + 1 if setting.resume_from else EPOCHS
    assert [t["epoch"] for t in trajectory] == list(range(start, end + 1)), \
        "one state at the start (or at the resumed epoch) and after every epoch"
    if s["dtype"] == "float32" and s["lr"] > REPLAYED_FLOAT32_LR:
        assert_learns(run)
        return
    replay = replay_error(s, trajectory)
    assert replay <= tolerance(s["dtype"]), \
        f"epoch replay {replay:.2e} > {tolerance(s['dtype']):.1e} ({s['dtype']}): not stage 01's training"


def test_a_replay_that_ignores_the_padding_fails(outcomes: dict[str, Outcome]) -> None:
    """The control of the padded replay: a W = 3 float64 row's own run, replayed as if its ranks had shared stage
    01's order of 4,096 samples without repeating any (its summary without `epoch_samples`), is far from it. So the
    rows above pass because the replay follows the order the run said it used, not because any order would do."""
    rows = [s for s in full() if s.id in outcomes and s.expect == "replay" and s.world == 3 and
            s.dtype == "float64" and not s.resume_from and isinstance(outcomes[s.id], Outcome)]
    padded = [(s.id, outcomes[s.id]) for s in rows if outcomes[s.id].run.returncode == 0 and
              "epoch_samples" in outcomes[s.id].run.summary]
    if not padded:
        pytest.skip("no W = 3 float64 replay ran in this session (run the module whole)")
    key, outcome = padded[0]
    summary = {k: v for k, v in outcome.run.summary.items() if k != "epoch_samples"}
    honest, ignored = replay_error(outcome.run.summary, outcome.run.trajectory), \
        replay_error(summary, outcome.run.trajectory)
    assert honest <= tolerance("float64") < 1e3 * tolerance("float64") < ignored, (key, honest, ignored)


# --- the GPT stages (11-14): every layout a learner types, against one process of the same stage -------------------
# Their contract (tests/test_gpt.py, test_sequence_parallel.py): at any layout a run computes the one-process training
# of its stage (the same seed, global batch and schedule) within sqrt(eps) of float64, step by step (the states,
# every step's loss and gradient norm), and scores and samples as one process does; or it refuses in one line, exit 2,
# naming the flag. Tiny runs as those tests launch them, on harness.small_corpus (2,400 held out: at context 24 the
# last held-out window is short, the padded tail every layout must score as one process does).
GPT_TINY = ("--heads", "2", "--width", "32", "--context", "24", "--dtype", "float64", "--device", "cpu",
            "--eval-every", "3", "--save-every", "3", "--sample", "20", "--warmup-steps", "2", "--clip", "1.0",
            "--max-steps", "3")
TOL_GPT = tolerance("float64")  # the GPT tests': correct layouts differ by ~1e-14
GPT_SEED_LR = ((7, 0.02), (3, 0.05))  # the GPT tests': seed 0, lr 0.01
# The stages whose one-process training is stage 11's (the same GPT, drawn alike): their rows share its references.
SAME_GPT = ("11_gpt", "12_context_parallel", "13_pipeline_4d")


@dataclass(frozen=True)
class GptRow:
    stage: str
    world: int
    flags: tuple[str, ...] = ()  # the layout and options (--parallel, --tp, --sp, --ac, ...), as a learner types them
    batch: int = 12  # --batch-size: windows per micro-batch per dp rank
    accumulate: int = 1
    seed: int = 7
    lr: float = 0.02
    layers: int = 2
    expect: str = "same"  # "same" (one process's training), "own" (says before training how it differs) or "refuse"
    says: str | None = None  # "own": what its first lines say; "refuse": its error, from "argument --flag:" on

    def option(self, flag: str, default: str = "1") -> str:
        return self.flags[self.flags.index(flag) + 1] if flag in self.flags else default

    def value(self, flag: str) -> int:
        return int(self.option(flag))

    @property
    def dp(self) -> int:  # the grid is pp x dp x cp x tp
        return self.world // (self.value("--pp") * self.value("--cp") * self.value("--tp"))

    @property
    def global_batch(self) -> int:
        return self.dp * self.accumulate * self.batch

    @property
    def reference(self) -> GptRow:
        """The one-process run it must equal, made of what determines the training: rows that agree share it. The
        micro-batches count for stage 14 only: its balancing loss is of each micro-batch's load, not linear in it
        (one process of batch 12 trains otherwise than 3 micro-batches of 4: 0.06 apart after 3 steps)."""
        accumulate = 1 if self.stage in SAME_GPT else self.accumulate
        return GptRow("11_gpt" if self.stage in SAME_GPT else self.stage, 1, (), self.global_batch // accumulate,
                      accumulate, self.seed, self.lr, self.layers)

    def args(self) -> tuple[str, ...]:
        return (*GPT_TINY, "--layers", str(self.layers), "--seed", str(self.seed), "--lr", f"{self.lr:g}",
                "--batch-size", str(self.batch), *(("--accumulate", str(self.accumulate)) * (self.accumulate > 1)),
                *self.flags)

    @property
    def id(self) -> str:
        flags = " ".join(self.flags)
        return (f"{self.stage}-W{self.world}-b{self.batch}x{self.accumulate}-s{self.seed}-lr{self.lr:g}"
                f"{f'-layers{self.layers}' if self.layers != 2 else ''}{(' ' + flags) if flags else ''}")


FSDP = ("--parallel", "fsdp")
# Settings nothing honest can run, each refused in one line before any group is joined (checked in this process,
# through main() as test_gpt.refusal does: no launch). The GPT tests refuse others (--tp 4 with 2 heads, --sp
# without --tp, a context --sp's tp does not divide, ...).
GPT_REFUSED = (
    GptRow("11_gpt", 3, (*FSDP, "--tp", "2"), expect="refuse",
           says="argument --tp: 2 does not divide the world size 3"),
    GptRow("11_gpt", 3, (*FSDP, "--tp", "3"), expect="refuse", says="argument --tp: 3 does not divide --heads 2"),
    GptRow("11_gpt", 4, (*FSDP, "--replicate", "3"), expect="refuse",
           says="argument --replicate: 3 does not divide dp 4"),
    GptRow("11_gpt", 4, ("--replicate", "2"), expect="refuse",
           says="argument --replicate: HSDP keeps replicas of FSDP2's shards"),
    GptRow("11_gpt", 4, ("--ac", "some"), expect="refuse", says="argument --ac: invalid choice: 'some'"),
    GptRow("12_context_parallel", 3, (*FSDP, "--cp", "2"), expect="refuse",
           says="argument --cp: 2 x --tp 1 does not divide the world size 3"),
    GptRow("13_pipeline_4d", 4, (*FSDP, "--pp", "2"), expect="refuse",  # 1F1B with one micro-batch
           says="argument --accumulate: 1F1B needs at least one micro-batch per stage, 2, not 1"),
    GptRow("13_pipeline_4d", 3, (*FSDP, "--pp", "3"), accumulate=3, expect="refuse",
           says="argument --pp: 3 stages need at least 3 blocks"),
    GptRow("14_experts", 3, (*FSDP, "--ep", "2"), expect="refuse",
           says="argument --ep: 2 does not divide the 3 dp x cp processes"),
    GptRow("14_experts", 4, (*FSDP, "--tp", "2", "--sp", "--ep", "3"), expect="refuse",
           says="argument --ep: 3 does not divide --experts 4"),
)


def gpt_covering() -> list[GptRow]:
    """CI's GPT rows: six layouts the GPT tests never launch, all at global batch 12 (seed 7, lr 0.02), so that they
    share two one-process references (stage 11's GPT, stage 14's experts): 8 launches in all. Each meets W = 3 or 4,
    an --ac mode or an odd accumulation (3) the tests do not pick, beside the flag its stage adds."""
    return [
        GptRow("11_gpt", 3, ("--ac", "full"), batch=4),  # DDP over 3 ranks, every block recomputed
        GptRow("11_gpt", 4, (*FSDP, "--tp", "2", "--sp", "--ac", "selective"), batch=2, accumulate=3),
        GptRow("11_gpt", 4, (*FSDP, "--replicate", "2"), batch=1, accumulate=3),  # HSDP 2 x 2, accumulating
        GptRow("12_context_parallel", 4, (*FSDP, "--cp", "2", "--tp", "2", "--sp", "--ac", "full"), batch=4,
               accumulate=3),
        GptRow("13_pipeline_4d", 4, (*FSDP, "--pp", "2", "--ac", "selective"), batch=2, accumulate=3),  # dp 2 x pp 2
        GptRow("14_experts", 4, (*FSDP, "--tp", "2", "--sp", "--ep", "2", "--ac", "full"), batch=2, accumulate=3),
        *GPT_REFUSED]


def gpt_layouts(stage: str, world: int) -> list[tuple[tuple[str, ...], int]]:
    """(flags, --layers) of every layout of `stage` at `world` processes the full grid runs (each also at every --ac
    and accumulation): dp alone (DDP, FSDP2, HSDP), tp with and without --sp, and the flag each later stage adds."""
    found: list[tuple[tuple[str, ...], int]] = [((), 2), (FSDP, 2)]
    found += [((*FSDP, "--replicate", str(r)), 2) for r in (2, 3, 4) if world % r == 0]  # HSDP, shard 1 too
    if world % 2 == 0:
        found += [((*FSDP, "--tp", "2"), 2), ((*FSDP, "--tp", "2", "--sp"), 2)]
        if world == 4:
            found.append(((*FSDP, "--tp", "2", "--sp", "--replicate", "2"), 2))  # dp 2 = replicate 2 x shard 1
    if stage == "12_context_parallel":
        found += [((*FSDP, "--cp", str(world)), 2), ((*FSDP, "--cp", str(world), "--cp-impl", "allgather"), 2),
                  ((*FSDP, "--cp", str(world), "--no-zigzag"), 2)] if world > 1 else []  # context 24: 2 x cp divides
        found += [((*FSDP, "--cp", "2", "--tp", "2", "--sp"), 2)] if world == 4 else []
    if stage == "13_pipeline_4d" and world > 1:
        pp = 2 if world % 2 == 0 else 3
        found += [((*FSDP, "--pp", str(pp), "--pp-schedule", schedule), pp) for schedule in ("gpipe", "1f1b")]
        if world == 4:
            found += [((*FSDP, "--pp", "2", "--tp", "2", "--sp"), 2)]
            found += [((*FSDP, "--pp", "2", "--stages-per-rank", "2", "--pp-schedule", schedule), 4)
                      for schedule in ("interleaved1f1b", "interleavedzb", "zbv")]  # (dualpipev: 4 micro-batches)
    if stage == "14_experts":
        found += [((*FSDP, "--ep", str(ep)), 2) for ep in (2, 4) if world % ep == 0]
        found += [((*FSDP, "--tp", "2", "--sp", "--ep", "2"), 2), ((*FSDP, "--pp", "2", "--ep", "2"), 2)] \
            if world == 4 else []
    return found


def gpt_full() -> list[GptRow]:
    """Every GPT stage x its layouts at W = 1, 3, 4 x --ac none, full, selective x accumulating 1 or 3 micro-batches,
    at a global batch of 12 (36 where 3 micro-batches on dp 3 ranks need it), the two seeds and rates taking turns,
    the refusals, and a row of stage 14 that trains otherwise by design (--balance rank: said before training)."""
    rows = []
    for stage in (*SAME_GPT, "14_experts"):
        for world in (1, 3, 4):
            for n, (flags, layers) in enumerate(gpt_layouts(stage, world)):
                for i, (ac, accumulate) in enumerate(itertools.product(("none", "full", "selective"), (1, 3))):
                    pp = int(flags[flags.index("--pp") + 1]) if "--pp" in flags else 1
                    schedule = flags[flags.index("--pp-schedule") + 1] if "--pp-schedule" in flags else "1f1b"
                    if pp > 1 and ((schedule == "1f1b" and accumulate < pp) or  # refused (GPT_REFUSED has it)
                                   (schedule in ("interleavedzb", "zbv") and ac == "selective")):  # refused
                        continue  # (a zero-bubble schedule's two backwards over a selective checkpoint)
                    row = GptRow(stage, world, (*flags, *(("--ac", ac) * (ac != "none"))), 1, accumulate,
                                 *GPT_SEED_LR[(n + i) % 2], layers=layers)  # each layout at both
                    total = 12 if 12 % (row.dp * accumulate) == 0 else 36
                    row = GptRow(**{**row.__dict__, "batch": total // (row.dp * accumulate)})
                    rows += [row] if row != row.reference else []  # (not a reference against itself)
    return [*rows, *GPT_REFUSED,
            GptRow("14_experts", 4, (*FSDP, "--ep", "2", "--balance", "rank"), batch=3, expect="own",
                   says="each rank counts the experts' load over its own tokens (--balance rank)")]


def gpt_rows(config: pytest.Config) -> list[GptRow]:
    return gpt_full() if config.getoption("--sweep") == "full" else gpt_covering()


@pytest.fixture(scope="module")
def gpt_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The launched GPT rows chosen in this session, by id, and the one-process references they need, by key (each
    once), POOL at a time: a Run, or the exception its launch raised (reported by the row that reads it)."""
    chosen = [item.callspec.params["gpt_row"] for item in request.session.items
              if item.module is request.module and "gpt_row" in getattr(getattr(item, "callspec", None), "params", {})]
    launched = [r for r in chosen if r.expect != "refuse"]
    jobs = {r.id: r for r in launched} | {r.reference.id: r.reference for r in launched}  # each reference once
    tmp = tmp_path_factory.mktemp("gpt_settings")
    data = small_corpus(tmp)

    def one(name: str, row: GptRow) -> Run | BaseException:
        step = Step(row.stage, "python" if row.world == 1 else "torchrun", (*row.args(), "--data", str(data)),
                    nproc=row.world)
        try:
            return launch(step, out=tmp / re.sub(r"[^\w.=-]", "_", name))
        except BaseException as e:  # noqa: BLE001 (pytest.fail's exception too: reported by the test that reads it)
            return e
    with ThreadPoolExecutor(max_workers=POOL) as pool:
        return dict(zip(jobs, pool.map(one, jobs, jobs.values()), strict=True))


def test_gpt_setting(gpt_row: GptRow, gpt_runs: dict) -> None:
    row = gpt_row
    if row.expect == "refuse":  # before any group is joined: one line naming the flag, exit 2, nothing trained
        code, err = refusal(list(row.args()), {"WORLD_SIZE": str(row.world)}, row.stage)
        assert code == 2 and err.strip().splitlines() == [err.strip()] and \
            err.startswith(f"{row.stage}/train.py: error: {row.says}"), (code, err)
        return
    run, one = gpt_runs[row.id], gpt_runs[row.reference.id]
    for done in (run, one):
        if isinstance(done, BaseException):
            raise done
        check(done)
    s, flags = run.summary, row.flags
    assert (s["world_size"], s["dp"], s["global_batch"], s["accumulate"], s["seed"], s["lr"]) == \
        (row.world, row.dp, row.global_batch, row.accumulate, row.seed, row.lr), s
    assert (s["tp"], s["sp"], s["ac"], s["parallel"]) == \
        (row.value("--tp"), "--sp" in flags, row.option("--ac", "none"),
         "fsdp" if "fsdp" in flags else "ddp"), s
    if "--replicate" in flags:  # HSDP: said in its first line
        assert f"(replicate {row.value('--replicate')} x shard {row.dp // row.value('--replicate')})" in run.stdout
    found, shared = gaps(run, one)
    if row.expect == "own":  # trains otherwise by design: says so before training, and does
        before_training = re.split(r"^step ", run.stdout, maxsplit=1, flags=re.M)[0]
        assert row.says in before_training, f"the run should say '{row.says}' before training"
        assert found["state"] > TOL_GPT, f"said it trains otherwise, but its states are one process's: {found}"
        return
    assert shared == [0, 3] and max(found.values()) <= TOL_GPT, f"{row.id} vs one process: {found}"
    # scored and sampled as one process (the held-out's short last window padded), and the saved model the same
    assert (s["eval_count"], s["sample"]) == (one.summary["eval_count"], one.summary["sample"]), s["sample"]
    assert abs(s["eval_loss"] - one.summary["eval_loss"]) <= TOL_GPT, (s["eval_loss"], one.summary["eval_loss"])
    assert run.model.keys() == one.model.keys()
    assert max((run.model[k] - one.model[k]).abs().max().item() for k in one.model) <= TOL_GPT
    if "experts" in s:  # every expert's load, and the balancing loss step by step, as one process's
        mine, theirs = s["experts"], one.summary["experts"]
        assert (mine["ep"], mine["load"]) == (row.value("--ep"), theirs["load"]), (mine["load"], theirs["load"])
        assert max(abs(a - b) for a, b in zip(mine["aux_losses"], theirs["aux_losses"], strict=True)) <= TOL_GPT
