"""The READMEs' output blocks are what their commands print today: a ```text block that shows a command's output is
compared, line by line, with the output of the suite's own run of that command.

test_readme_commands.py runs every README command block (in the background, once per session: conftest.readme_run,
and the tour's block as conftest.tour); the tests here read those runs, launching nothing. For each ```text block
named in SHOWN, every line it shows must be printed by the command block named beside it, in the order shown (a
README may leave lines out: a line `...`, or "the epoch lines left out"), with:

- the words, the punctuation and the deterministic numbers as shown: losses, accuracies, step and sample counts,
  bytes, replay errors. A decimal may differ by one unit in its last shown digit (float32 rounds differently on
  another CPU; in float64 they agree to the digit, but for a rounding error itself: below ROUNDING, any), an integer
  not at all; a bfloat16 run's decimals by 1% (BF16), and a float32 run's too, its steps carrying a CPU vendor's
  rounding forward (F32, F32_GPT); a count that a threshold decides (CLIPPED), and a chaotic run's figures (CHAOTIC),
  are the machine's;
- the numbers that measure the machine masked, each only where it stands: durations (`0.05s`, `8.4 s`,
  `2.28 ms/step`), throughput (`21,687 tokens/s`), the tour table's two time columns, process ids, the host name
  in the node lines, a float32 GPT step's gradient norm (GPT_MACHINE);
- `...` inside a line stands for text cut out of it (a long line, a path); launchers' log lines (`W1123 01:01:27...`,
  torchrun's OMP_NUM_THREADS banner) are not compared: they depend on the environment the command ran in.

Skipped blocks, each with its reason (SKIPPED): diagrams and listings that explain rather than show a run; outputs
of commands given in the prose, not of a block that runs here (the 800-step GPT run, `tour.py --dtype float32
--epochs 20`, a session with a killed worker, Slurm's transcript); outputs of blocks that do not run here (GPUs,
container builds: those blocks carry their own not-run reason); a failure whose messages race between ranks. A test
checks that every ```text block is either compared or skipped with a reason, so a new output block has to be placed
in one list.

The tour's block is compared only where the tour runs its Slurm row (Slurm installed, as .ci/run installs it):
without Slurm the tour prints one row fewer, as it should. The READMEs show what the commands print on a CPU, and their
blocks run with the GPUs hidden (readme_blocks.HIDE_GPUS), on any machine.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import pytest

from conftest import readme_run
from harness import ROOT, slurm_missing
from readme_blocks import BLOCKS, TOURS, Block, block_showing, why_skipped

# A number as the scripts print it: 1,234 | 0.0483 | 97.10 | 5.8e-16 | -0.0001 | +0.0001
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
# Numbers that measure the machine, not the computation: matched where they stand, compared as "some number".
MACHINE = [
    r"\d+(?:\.\d+)?(?=\s?m?s\b)",  # a duration: 0.05s, 9.58s (compiling), 8.4 s, 2.28 ms/step, [0.6 s]
    r"[\d,]+(?:\.\d+)?(?= (?:tokens|samples)/s\b)",  # a throughput
    r"(?<=\bpid )\d+",  # a process id
]
HOST = r"(?<=\bnode \d \()[^)]+(?=\) \| local rank)"  # the machine's name in the node lines
LOG_LINE = re.compile(r"^\[?[WEI]\d{4} \d\d:\d\d:\d\d")  # glog's prefix: torch's and torchrun's log lines


@dataclass(frozen=True)
class Shown:
    doc: str  # the README, from the repository's root
    first: str  # how the ```text block's first line starts: which block of the README
    command: str  # the start of a command of the bash block whose output it is, in the same README
    machine: tuple[str, ...] = ()  # more numbers that measure the machine in this block (regexes)
    any_order: bool = False  # lines printed by several processes at once: their order is a race
    rel: float = 0.0  # a decimal may also differ by this fraction of itself (bfloat16 runs: see BF16)

    @property
    def id(self) -> str:
        return f"{self.doc}: {self.first}"


# bfloat16 keeps 8 bits of mantissa (rounding 0.4%), and how a CPU's kernels round its products differs between
# machines: the mixed-precision recipe's README shows a held-out loss of 0.0836 and 0.0781 and an accuracy of 96.40%;
# here it prints 0.0837, 0.0785 and 96.50%, with today's code and with the code of the day the README was written.
BF16 = 0.01
TOUR_TIMES = (r"\d+\.\d+(?=\s+\d+\.\d+$)", r"\d+\.\d+$")  # the table's last two columns: train s, wall s

# What a GPT run's summary lines measure of the machine: tokens/s, the MFU and the peak it is of, the peak memory;
# and one step's gradient norm, which after tens of float32 steps follows the CPU's rounding (below).
GPT_MACHINE = (r"(?<=^tokens/s )[\d,]+", r"(?<=MFU )[\d.]+(?=%)", r"[\d.]+(?= GFLOP/s)", r"[\d,]+(?= MiB \|)",
               r"(?<=grad norm )[\d.]+")
# A float32 GPT trained for tens of steps carries each CPU's rounding forward, the more the longer it trains: 12's cp
# run, 50 steps then, printed a held-out 3.1744 on the 2-core EPYC that wrote its README, 3.1645 on another EPYC (with
# AVX-512) and 3.0678 on a 2-core Xeon (3.4%), same code and torch (2026-11-26, 2026-11-29). At 20 steps, the length
# of the GPT stages' shown runs (12 since then), 13's and 14's printed on that Xeon are within 0.11% of the EPYC's.
F32_GPT = 0.01
# A float32 MLP run's decimals likewise, on another CPU vendor's kernels: stage 01's default run prints a held-out loss
# of 0.0726 and 97.10% on the 2-core EPYCs that wrote the READMEs, 0.0724 and 97.20% on a 2-core Xeon (AVX-512 kernels
# in MKL and ATen), same code and torch (2026-11-29): 0.3% and one sample in 1,001.
F32 = 0.01
# How many bfloat16 steps' gradient norms pass a threshold: a step near it goes either way with the CPU's rounding (the
# mixed-precision recipe's 160 steps at 0.5: 33 on the EPYC, 34 on the Xeon).
CLIPPED = (r"(?<=clipped: )\d+(?= of)",)
# The sync-BatchNorm recipe's 2-rank run, statistics of 4 samples each, is chaotic: its first epoch's loss and held-out
# accuracy, 0.9757 and 74.13% on the EPYC that wrote the README, came out 0.9777-0.9826 and 71.43-77.62% on a Xeon
# under MKL's and ATen's several code paths (2026-11-29), while its 1-rank twin printed the README's figures to the
# digit. Its lines are compared, its figures not.
CHAOTIC = (r"(?<=train loss )[\d.]+", r"(?<=held-out: loss )[\d.]+", r"(?<=accuracy )[\d.]+(?=%)")
SHOWN = [
    Shown("01_single_gpu/README.md", "[01_single_gpu] device cpu",
          "python 01_single_gpu/train.py --device cpu --epochs 5", rel=F32),
    Shown("02_dataparallel/README.md", "[02_dataparallel] device cpu", "python 02_dataparallel/train.py --device cpu",
          rel=F32),
    Shown("03_ddp_spawn/README.md", "[03_ddp_spawn] world size 2", "python 03_ddp_spawn/train.py --world-size 2",
          rel=F32),
    Shown("04_ddp_torchrun/README.md", "W1123",
          "torchrun --standalone --nproc_per_node=2 04_ddp_torchrun/train.py --batch-size 32", rel=F32),
    Shown("05_multinode/README.md", "[05_multinode] world size 2",
          "OMP_NUM_THREADS=1 torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=127.0.0.1 "
          "--master_port=29500 05_multinode/train.py --device cpu --batch-size 32", rel=F32),
    Shown("05_multinode/README.md", "[W1123 01:36:40",
          'ip netns exec host0 env OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=eth1 "$(which python)" -m '
          "torch.distributed.run --nnodes=2 --nproc_per_node=1 --rdzv_backend=c10d --rdzv_endpoint=10.123.0.1:29500 "
          "--rdzv_id=demo --rdzv_conf=is_host=1 --local_addr=10.123.0.1 05_multinode/train.py --device cpu "
          "--batch-size 32", rel=F32),
    Shown("07_model_parallel/README.md", "[07_model_parallel] world size 2 | backend gloo | device cpu | batch",
          "torchrun --standalone --nproc_per_node=2 07_model_parallel/train.py --device cpu", rel=F32),
    Shown("07_model_parallel/README.md", "[07_model_parallel] world size 2 | backend gloo | device cpu (no GPU",
          "torchrun --standalone --nproc_per_node=2 07_model_parallel/train.py --snapshot runs/06_to_07.pt", rel=F32),
    Shown("08_fsdp/README.md", "held-out: loss",
          "torchrun --standalone --nproc_per_node=2 08_fsdp/train.py --epochs 5 --snapshot runs/08_reshard "
          "--out runs/08", rel=F32),
    Shown("09_tensor_parallel/README.md", "[09_tensor_parallel] world size 4",
          "torchrun --standalone --nproc_per_node=4 09_tensor_parallel/train.py --epochs 2 --tp 2 --batch-size 32",
          rel=F32),
    Shown("10_pipeline_parallel/README.md", "[10_pipeline_parallel] world size 2",
          "torchrun --standalone --nproc_per_node=2 10_pipeline_parallel/train.py --batch-size 64 --epochs 5 "
          "--out runs/10", rel=F32),
    Shown("README.md", "tour: stages", ".venv/bin/python tour.py --out runs/tour", machine=TOUR_TIMES),
    Shown("benchmarks/README.md", "dp_vs_ddp: needs 2 or more GPUs", "python3 benchmarks/dp_vs_ddp.py"),
    Shown("ddp_by_hand/README.md", "[ddp_by_hand/naive]",
          "torchrun --standalone --nproc_per_node=2 ddp_by_hand/naive.py --batch-size 32 --dtype float64 --epochs 5 "
          "--out runs/hand_naive"),
    Shown("ddp_by_hand/README.md", "[ddp_by_hand/bucketed]",
          "python ddp_by_hand/compare_runs.py runs/hand_naive runs/hand_bucketed --ddp runs/04_2x32"),
    Shown("ddp_by_hand/README.md", "max |difference| from DDP's", "python ddp_by_hand/vs_ddp.py"),
    Shown("zero_by_hand/README.md", "[zero_by_hand/zero1]",
          "torchrun --standalone --nproc_per_node=2 zero_by_hand/zero1.py --batch-size 32 --dtype float64 --epochs 5 "
          "--out runs/zero1"),
    Shown("zero_by_hand/README.md", "[zero_by_hand/zero3]",
          "torchrun --standalone --nproc_per_node=2 zero_by_hand/zero3.py --batch-size 32 --dtype float64 --epochs 5 "
          "--out runs/zero3"),
    Shown("zero_by_hand/README.md", "max |difference| of the weights", "python zero_by_hand/vs_library.py"),
    Shown("debugging/README.md", "trained 8 steps | mean loss 1.34", "python debugging/bugs.py --bug none", rel=F32),
    Shown("debugging/README.md", "trained 8 steps | mean loss 1.35", "python debugging/bugs.py --bug dropout", rel=F32),
    Shown("debugging/README.md", "[rank 0] watchdog: no progress for 3s in step 8",
          "python debugging/bugs.py --bug only_rank0"),
    Shown("debugging/README.md", "Collective sequence number", "python debugging/bugs.py --bug mismatch"),
    Shown("debugging/README.md", "job failed: process", "TORCH_DISTRIBUTED_DEBUG=DETAIL python debugging/bugs.py"),
    Shown("debugging/README.md", "replica check: step 3", "python debugging/bugs.py --bug drift", rel=F32),
    Shown("debugging/README.md", "[rank ...] RuntimeError: Expected to have finished",
          "TORCH_DISTRIBUTED_DEBUG=INFO python debugging/bugs.py --bug unused"),
    Shown("debugging/README.md", "[rank0]:[W", "python debugging/bugs.py --time-find-unused", rel=F32),
    Shown("debugging/README.md", "[rank ...] Parameters which did not receive grad for rank ...: head",
          "TORCH_DISTRIBUTED_DEBUG=INFO python debugging/bugs.py --bug replaced", rel=F32),
    Shown("debugging/README.md", "[rank ...] RuntimeError: Expected to mark", "python debugging/bugs.py --bug twice"),
    Shown("debugging/README.md", "trained 8 steps | mean loss nan", "python debugging/bugs.py --bug nan 2>&1"),
    Shown("debugging/README.md", "finite check: step", "python debugging/bugs.py --bug nan --finite-check", rel=F32),
    Shown("debugging/README.md", "[rank 1] OutOfMemoryError",
          "torchrun --standalone --nproc_per_node=2 debugging/bugs.py"),
    Shown("debugging/README.md", "replica check: 8 steps", "python debugging/bugs.py --bug sendrecv"),
    Shown("debugging/README.md", "trained 72 steps", "python debugging/bugs.py --bug set_epoch", rel=F32),
    Shown("recipes/comm_hooks/README.md", "--hook allreduce",
          "torchrun --standalone --nproc_per_node=2 recipes/comm_hooks/train.py --epochs 1", rel=F32),
    Shown("recipes/comm_hooks/README.md", "fp16 | epoch replay",
          "python 01_single_gpu/train.py --dtype float64 --batch-size 64 --epochs 5 --out runs/01"),
    Shown("recipes/compile/README.md", "[recipes/compile] world size 2",
          "torchrun --standalone --nproc_per_node=2 recipes/compile/train.py --epochs 3 --out runs/compile", rel=F32),
    Shown("recipes/compile/README.md", "%submod_0",
          "TORCH_LOGS=ddp_graphs torchrun --standalone --nproc_per_node=2 recipes/compile/train.py --epochs 1 "
          "--bucket-cap-mb 0.01 2>&1 | grep -E \"^\\[rank0\\].*call_module\\[target=submod|^compiled\" | "
          "sed 's/.*\\[__ddp_graphs\\] *//'", rel=F32),
    Shown("recipes/ddp_options/README.md", "gradients 19,984 B",
          "torchrun --standalone --nproc_per_node=2 recipes/ddp_options/train.py --epochs 1"),
    Shown("recipes/grad_accumulation/README.md", "[recipes/grad_accumulation] world size 2",
          "torchrun --standalone --nproc_per_node=2 recipes/grad_accumulation/train.py --batch-size 16 --accumulate 2 "
          "--epochs 3 --dtype float64 --out runs/accumulate"),
    Shown("recipes/mixed_precision/README.md", "[recipes/mixed_precision] world size 2",
          "torchrun --standalone --nproc_per_node=2 recipes/mixed_precision/train.py --epochs 5 --out runs/bf16",
          rel=BF16),
    Shown("recipes/mixed_precision/README.md", "epoch 5/5 | train loss 0.0685",
          "torchrun --standalone --nproc_per_node=2 recipes/mixed_precision/train.py --epochs 5 --clip-grad-norm 0.5",
          rel=BF16, machine=CLIPPED),
    Shown("recipes/sync_batchnorm/README.md", "recipes/sync_batchnorm/train.py: error",
          'python recipes/sync_batchnorm/train.py --device cpu 2>&1 || echo "exit status $?"'),
    Shown("recipes/sync_batchnorm/README.md", "[recipes/sync_batchnorm] world size 2",
          "python recipes/sync_batchnorm/train.py --batchnorm local --device cpu --batch-size 8 --epochs 2",
          machine=CHAOTIC),
    Shown("recipes/sync_batchnorm/README.md", "[recipes/sync_batchnorm] world size 1",
          "python recipes/sync_batchnorm/train.py --batchnorm local --device cpu --batch-size 8 --epochs 2", rel=F32),
    Shown("11_gpt/README.md", "[11_gpt] world size 4 = dp 2 x tp 2",
          "torchrun --standalone --nproc_per_node=4 11_gpt/train.py --parallel fsdp --tp 2 --max-steps 2"),
    Shown("12_context_parallel/README.md", "[12_context_parallel] world size 2 = dp 1 x cp 2",
          "torchrun --standalone --nproc_per_node=2 12_context_parallel/train.py --cp 2",
          machine=GPT_MACHINE, rel=F32_GPT),
    Shown("13_pipeline_4d/README.md", "[13_pipeline_4d] world size 4 = dp 1 x pp 2",
          "torchrun --standalone --nproc_per_node=4 13_pipeline_4d/train.py --pp 2 --cp 2",
          machine=GPT_MACHINE, rel=F32_GPT),
    Shown("14_experts/README.md", "[14_experts] world size 4 = dp 4 x cp 1 x tp 1, ep 4",
          "torchrun --standalone --nproc_per_node=4 14_experts/train.py --ep 4 --batch-size 4 --accumulate 2",
          machine=GPT_MACHINE, rel=F32_GPT),
    Shown("recipes/uneven_inputs/README.md", "[recipes/uneven_inputs] world size 2",
          "torchrun --standalone --nproc_per_node=2 recipes/uneven_inputs/train.py --epochs 5 --out runs/uneven",
          rel=F32),
    Shown("recipes/uneven_inputs/README.md", "rank 1: [100.1",
          "torchrun --standalone --nproc_per_node=2 runs/mispair.py", any_order=True, rel=F32),
]

SKIPPED = {  # (README, how the block's first line starts): why it is not compared
    ("at_scale/README.md", "Intel(R) Xeon(R) Processor, 2 cores"): "this machine's committed measurements and the "
        "planner's predictions from them, compared exactly by tests/test_at_scale_machine.py (the block is the "
        "command's output)",
    **{("at_scale/README.md", first): "the planner's output, compared exactly (no launch: formulas) by "
       "tests/test_at_scale_plan.py test_readme_shows_what_the_planner_prints"
       for first in ("llama3-8b: ", "llama3-70b: 70,553,706,496 parameters, context 8,192 | 64 x",
                     "llama3-70b: 70,553,706,496 parameters, context 8,192 | 8 x", "llama3-405b: ")},
    ("zero_by_hand/README.md", "rank 0 of W, float32, AdamW"):
        "the full measuring run's table (not run here: minutes); tests/test_zero_by_hand.py checks the quick run's CSV",
    ("03_ddp_spawn/README.md", "note: 4096 samples do not split evenly over 3 ranks"):
        "the line a run at W = 3 prints (tests/test_settings.py checks it); the README's blocks run W = 2 and 4",
    ("05_multinode/README.md", "LOCAL_RANK 0"): "a diagram of two nodes' ranks",
    ("05_multinode/README.md", "[.../gloo/transport/tcp/debug_logger.cc"):
        "the error of a misconfigured run the prose describes (GLOO_SOCKET_IFNAME unset), not a block's output",
    ("06_checkpoint/README.md", "### killed rank 1"):
        "a run in which the test process killed a worker (test_checkpoint makes it); the README's command kills none",
    ("07_model_parallel/README.md", "process (local rank 0)"): "a diagram of the model split over GPUs",
    ("08_fsdp/README.md", "forward    all-gather body"): "a diagram of one FSDP2 step",
    ("08_fsdp/README.md", "runs/08_reshard/epoch_0005/"): "a listing of a checkpoint's files, explained line by line",
    ("09_tensor_parallel/README.md", "tp 0      tp 1"): "a diagram of the dp x tp grid",
    ("09_tensor_parallel/README.md", "x [B, 8]"): "a diagram of the split layers",
    ("11_gpt/README.md", "[11_gpt] world size 2 = dp 2 x tp 1"):
        "the default 800-step run (2 minutes, given in the prose); the README's block runs 20 and 10 steps",
    ("11_gpt/README.md", "11_gpt/train.py: error: argument --tp"):
        "the refusals, not a block's output: tests/test_gpt.py compares them line by line with main()'s in-process",
    ("12_context_parallel/README.md", "positions         0 1"): "a diagram of the two splits",
    ("benchmarks/README.md", "causal attention, forward + backward"):
        "the output of benchmarks/cp_balance.py at its defaults (given in the prose; about a minute), not of a block",
    ("README.md", "01_single_gpu/ … 14_experts/"): "the repository's layout",
    ("benchmarks/README.md", "tour: stages 01-09, world size 2, batch 32 per process = 64 global, float32; CPU (gloo)"):
        "the output of `python tour.py --dtype float32 --epochs 20` (and 60, given in the prose), not of the block "
        "above it",
    ("benchmarks/README.md", "tour: stages 01-10, world size 2, batch 24 per process = 48 global, float32, lr 0.01"):
        "the output of a 45-epoch float32 tour at batch 24 (given in the prose, ~10 minutes), not of a block",
    ("docker/README.md", "$ podman run --rm -v ./loader.py"):
        "a session with a container's shared memory (podman, typed in the prose), not a block's output",
    ("docker/README.md", "node 0 (node0)"): "the compose job's output: tests/test_containers.py runs it and checks it",
    ("recipes/README.md", "diff -u 04_ddp_torchrun/train.py"): "a command to type, shown as text",
    ("recipes/compile/README.md", "$ TORCHINDUCTOR_CACHE_DIR"):
        "timings gathered over 3 runs of several commands each, summarised by hand",
    ("recipes/uneven_inputs/README.md", "with Join([self.model]"): "an excerpt of the recipe's code",
    ("recipes/uneven_inputs/README.md", "terminate called after throwing"):
        "a job that fails on a collective mismatch: which rank fails first, and what each prints, is a race "
        "(the block's expect marker checks the exit)",
    ("slurm/README.md", "$ slurm/local_cluster.sh start"):
        "a transcript of a session (job ids, wall times, squeue's states over time); tests/test_slurm.py runs it",
}


def text_blocks() -> list[Block]:
    return [b for b in BLOCKS if b.lang == "text"]


def which(doc: str, first: str) -> list[Block]:
    """The ```text blocks of `doc` whose first line starts with `first` (ignoring leading spaces)."""
    return [b for b in text_blocks() if str(b.doc.relative_to(ROOT)) == doc
            and b.body.lstrip().startswith(first)]


def pattern(line: str, machine: tuple[str, ...]) -> tuple[re.Pattern, list[str]]:
    """A regex a printed line must match to be `line`, and the numbers `line` shows, in order (each a group).

    Numbers that measure the machine become "a number", the host name "a name", `...` "anything"; the other numbers
    are captured, to be compared with a tolerance; runs of spaces match any run of spaces (tables realign)."""
    masks = [(m.start(), m.end(), r"[\d.,]+") for rx in (*MACHINE, *machine) for m in re.finditer(rx, line)]
    masks += [(m.start(), m.end(), r"[^)]+") for m in re.finditer(HOST, line)]
    masks += [(m.start(), m.end(), r".*?") for m in re.finditer(r"\.\.\.|…", line)]
    masks = sorted(masks)
    regex, shown, at = [], [], 0
    for start, end, wildcard in masks + [(len(line), len(line), "")]:
        if start < at:  # inside an earlier mask
            continue
        for i, part in enumerate(re.split(f"({NUMBER})", line[at:start])):
            if i % 2:
                regex.append(f"({NUMBER})")
                shown.append(part)
            else:
                regex.append(r"\s+".join(re.escape(w) for w in re.split(r"\s+", part)))
        regex.append(wildcard)
        at = end
    return re.compile("".join(regex)), shown


# A float64 difference of two computations that agree to rounding (a replay error, a max |difference|) is a few ulps:
# which few depends on the CPU's kernels, float64 or not (ddp_by_hand's replay prints 5.8e-16 on the 2-core EPYC that
# wrote its README and 4.6e-16 on a 2-core Xeon, same code and torch, 2026-11-29). Below ROUNDING both say "equal to
# rounding": 450 float64 ulps of 1, and still 10^5 times under the tolerance the tour holds them to (sqrt(eps)).
ROUNDING = 1e-13


def close(shown: str, printed: str, rel: float = 0.0) -> bool:
    """A deterministic number as shown and as printed: an integer exactly, a decimal within one unit of its last
    shown digit (of the mantissa, for 5.8e-16), or within `rel` of itself; two rounding errors (both below
    ROUNDING) alike."""
    a, b = shown.replace(",", ""), printed.replace(",", "")
    mantissa, _, exponent = a.lower().partition("e")
    if "." not in mantissa:
        return a == b
    if exponent and abs(float(a)) < ROUNDING and abs(float(b)) < ROUNDING:
        return True
    unit = 10.0 ** (-len(mantissa.split(".")[1]) + (int(exponent) if exponent else 0))
    return abs(float(a) - float(b)) <= max(1.01 * unit, rel * abs(float(a)))


def compared(line: str) -> bool:
    """Whether a shown line is compared: not an elision, not a launcher's log line."""
    stripped = line.strip()
    return bool(stripped) and stripped not in ("...", "…") and not LOG_LINE.match(stripped)


def drift(entry: Shown, shown: str, printed: str) -> list[str]:
    """Why `printed` does not show what the README shows: one message per shown line it lacks (empty: it shows it)."""
    lines = [" ".join(line.split()) for line in printed.splitlines()]
    problems, at = [], 0
    for line in (s for s in shown.splitlines() if compared(s)):
        regex, numbers = pattern(" ".join(line.split()), entry.machine)
        start = 0 if entry.any_order else at
        hits = [(i, m) for i, text in enumerate(lines[start:], start) if (m := regex.fullmatch(text))]
        good = [i for i, m in hits if all(close(a, b, entry.rel) for a, b in zip(numbers, m.groups(), strict=True))]
        if good:
            at = good[0] + 1
        elif hits:
            problems.append(f"shown:   {line}\n  printed: {lines[hits[0][0]]}")
        else:
            problems.append(f"shown:   {line}\n  printed: no line of that shape (after line {at})")
    return problems


def command_block(entry: Shown) -> Block:
    """The bash block of entry.doc with a command that starts with entry.command."""
    found = [b for b in BLOCKS if b.lang == "bash" and str(b.doc.relative_to(ROOT)) == entry.doc and any(
        " ".join(c.split()).startswith(" ".join(entry.command.split())) for c in b.commands())]
    assert len(found) == 1, f"{entry.id}: expected one bash block with {entry.command!r}, found {[b.id for b in found]}"
    return found[0]


def named_by(block: Block) -> str:
    """A command of `block` that names it alone (what the readme_run marker and conftest.readme_run take)."""
    for command in block.commands():
        try:
            if block_showing(command) == block:
                return command
        except AssertionError:  # shown in another block too
            continue
    raise AssertionError(f"{block.id}: every command of it is shown elsewhere too")


def runs_needed(entry: Shown) -> list[str]:
    """The README blocks this entry reads the runs of (by a command of each): its own, and every block before it in
    its README that runs here (a block may use what an earlier one made, as a reader's would)."""
    block = command_block(entry)
    if block in TOURS:
        return []  # the tour runs once per session (conftest.tour)
    earlier = [b for b in BLOCKS if b.doc == block.doc and b.lang == "bash" and b.line <= block.line
               and not why_skipped(b) and b not in TOURS]
    return [named_by(b) for b in earlier]


def output_of(entry: Shown, request: pytest.FixtureRequest) -> str:
    block = command_block(entry)
    if (why := why_skipped(block)) is not None:  # as root, with Slurm: not on every machine
        pytest.skip(f"{block.id} does not run here: {why}")
    if block in TOURS:
        if (why := slurm_missing()) is not None:  # before asking for the tour: it need not run for nothing
            pytest.skip(f"without Slurm the tour prints no Slurm row, as it should ({why})")
        return request.getfixturevalue("tour").run.stdout
    return readme_run(request.getfixturevalue("readme_runs"), named_by(block)).stdout


def text_id(entry: Shown) -> str:
    """The test's id: the ```text block's place (README:line), or the entry's own id if it names no block."""
    found = which(entry.doc, entry.first)
    return found[0].id if len(found) == 1 else entry.id


@pytest.mark.parametrize("entry", [pytest.param(e, id=text_id(e), marks=pytest.mark.readme_run(*runs_needed(e)))
                                   for e in SHOWN])
def test_the_output_a_readme_shows_is_what_its_command_prints(entry, request):
    (text,) = which(entry.doc, entry.first)
    problems = drift(entry, text.body, output_of(entry, request))
    assert not problems, f"{text.id} drifted from what its command prints now:\n" + "\n".join(problems)


def test_every_output_block_is_compared_or_skipped_with_a_reason():
    """A new ```text block must be placed: in SHOWN (with the command that prints it) or in SKIPPED (with why)."""
    named = {b.id for e in SHOWN for b in which(e.doc, e.first)}
    assert all(len(which(e.doc, e.first)) == 1 for e in SHOWN), [e.id for e in SHOWN if len(which(e.doc, e.first)) != 1]
    skipped = {b.id for (doc, first) in SKIPPED for b in which(doc, first)}
    assert all(which(doc, first) for doc, first in SKIPPED), [k for k in SKIPPED if not which(*k)]
    for e in SHOWN:  # each compared block shows a block the suite runs, and comes after it in its README
        block = command_block(e)
        (text,) = which(e.doc, e.first)
        assert block.doc == text.doc and block.line < text.line and "not-run" not in block.marker, (e.id, block.id)
    left = [b.id for b in text_blocks() if b.id not in named | skipped]
    assert not left, f"output blocks neither compared nor skipped with a reason: {left}"
    assert not named & skipped, named & skipped


def test_the_comparison_catches_what_it_must():
    """drift(), pattern() and close() themselves, on two real blocks and copies of them with one thing changed (no
    launch): each block as printed passes, and so does a number that measures the machine (a duration, a
    throughput) changed; a deterministic number past its tolerance, a word, a missing line, two lines in another
    order each fail. A comparator that matched anything would pass every entry above and fail here."""
    def entry_and_text(doc: str, first: str) -> tuple[Shown, str]:
        (entry,) = [e for e in SHOWN if (e.doc, e.first) == (doc, first)]
        (text,) = which(doc, first)
        return entry, "\n".join(line for line in text.body.splitlines() if compared(line))  # as a full run prints

    one, printed = entry_and_text("01_single_gpu/README.md", "[01_single_gpu] device cpu")
    assert "train loss 0.0483 | 0.05s" in printed and "accuracy 97.10%" in printed, printed
    passes = {"as printed": printed, "the last digit one unit off": printed.replace("0.0483", "0.0484"),
              "a duration": printed.replace("0.0483 | 0.05s", "0.0483 | 9.99s"),
              "another CPU's rounding (F32)": printed.replace("0.0483", "0.0486").replace("97.10%", "97.20%")}
    fails = {"a loss 2% off (F32: 1%)": printed.replace("0.0483", "0.0493"),
             "an accuracy 1.1 points off": printed.replace("97.10%", "98.20%"),
             "a word": printed.replace("held-out", "held-in"),
             "a line missing": "\n".join(line for line in printed.splitlines() if not line.startswith("epoch 19/")),
             "two lines swapped": printed.replace("epoch 19/20", "SWAP").replace("epoch 20/20", "epoch 19/20")
                                         .replace("SWAP", "epoch 20/20")}
    shown = "\n".join(which(one.doc, one.first)[0].body.splitlines())
    assert {k: drift(one, shown, v) for k, v in passes.items()} == {k: [] for k in passes}
    assert all(drift(one, shown, v) for v in fails.values()), {k: drift(one, shown, v) for k, v in fails.items()}
    # A float32 GPT run: its losses within F32_GPT of themselves, its tokens/s and gradient norms masked.
    gpt, printed = entry_and_text("12_context_parallel/README.md", "[12_context_parallel] world size 2 = dp 1 x cp 2")
    shown = which(gpt.doc, gpt.first)[0].body
    assert "train loss 3.7598" in printed and "| 4,925 tokens/s" in printed, printed
    assert not drift(gpt, shown, printed.replace("3.7598", "3.7900").replace("4,925 tokens/s", "1 tokens/s"))
    assert drift(gpt, shown, printed.replace("3.7598", "3.8500"))
    # close(): the unit of the last shown digit, of the mantissa for a power of ten; an integer exactly; two rounding
    # errors alike, but not a rounding error and a real difference.
    assert [close("5.8e-16", "5.9e-16"), close("5.8e-16", "4.6e-16"), close("5.8e-16", "2.0e-13"),
            close("3.2e-12", "3.4e-12"), close("1,234", "1,235"), close("0.5985", "0.5986"),
            close("0.5985", "0.5987")] == [True, True, False, False, False, True, False]
