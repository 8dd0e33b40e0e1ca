"""Every command the READMEs show runs as written, and every code excerpt is the code: the docs cannot drift.

How blocks are tagged and run, and the markers that say how: tests/readme_blocks.py. A ```python block is
checked against the train.py beside its README, line by line. A README's bash blocks run in order, in one
copy of the repository, as a reader runs them (a later block may use what an earlier one made); three
READMEs run at a time, each in a copy of its own: much of their time is spent starting Python and importing
torch on one core, or waiting (for a Slurm job, a rendezvous). The top README's tour is the exception: it runs
once per session for the whole suite (conftest.tour; its runs are the equivalence tests' `runs`), and its
test here checks that run.

Each block runs with OMP_NUM_THREADS=1 (see run_block). The README's set-up line (`python3 -m venv .venv &&
.venv/bin/pip install -r requirements.txt`) is not run again here: the test command starts with it, and .ci/run
runs that in a fresh clone (test_the_set_up_line_is_the_test_commands_own checks they are the same). The copy's
`.venv` is the environment these tests run in (~40 s saved: installing torch).
"""
from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import ROOT, Run, selected, slurm_missing
from readme_blocks import BLOCKS, COMMANDS, TOURS, Block, repo_copy, run_block

NOT_RUN = {  # the only reasons a command may be left out
    "needs GPUs", "needs several hosts",
    "is the test command itself",  # .ci/run runs it
    "is the set-up the test command starts with",  # .ci/run runs that too, in a fresh clone
    "starts an interactive server",  # jupyter lab: never exits on its own
    # Two minutes each; tests/test_containers.py makes the same image from the same files and runs the compose job.
    "builds a container image: tests/test_containers.py builds it and runs compose.yaml (podman)",
    # A benchmark at full size runs for a minute or more and measures nothing on a busy CI machine; its README
    # also shows a quick run of the same script, which runs here, and tests/test_benchmarks.py checks its output.
    "is a full benchmark run (a minute or more): the quick run below it and tests/test_benchmarks.py run the script",
}
def test_every_code_block_says_whether_it_is_commands_or_output():
    untagged = [b.id for b in BLOCKS if b.lang not in ("bash", "text", "python")]
    assert not untagged, (f"tag these blocks ```bash (commands, run by this test), ```text (output) or ```python "
                          f"(an excerpt of the train.py beside the README): {untagged}")
    assert len(COMMANDS) >= 15, "the READMEs lost their commands?"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_code_excerpts_are_the_code(block):
    """A ```python block quotes the train.py beside its README, line by line (comments and `...` elisions aside)."""
    script = block.doc.parent / "train.py"
    assert script.exists(), f"{block.id}: a ```python block must quote {script.relative_to(ROOT)}"
    code = script.read_text()
    drifted = [line for line in block.body.splitlines()
               if (quoted := line.split("#")[0].split("...")[0].strip()) and quoted not in code]
    assert not drifted, f"{block.id}: not in {script.relative_to(ROOT)}: {drifted}"


def test_only_allowed_reasons_leave_a_command_out():
    reasons = {b.id: b.marker["not-run"] for b in COMMANDS if "not-run" in b.marker}
    assert set(reasons.values()) <= NOT_RUN, reasons


def test_the_set_up_line_is_the_test_commands_own():
    """Why the set-up block may be left out: the test command (which .ci/run runs on a fresh clone) begins with it."""
    (set_up,) = [b for b in COMMANDS if b.marker.get("not-run") == "is the set-up the test command starts with"]
    (test_command,) = [b for b in COMMANDS if b.marker.get("not-run") == "is the test command itself"]
    assert set_up.doc == test_command.doc == ROOT / "README.md"
    assert test_command.commands()[0].startswith(set_up.commands()[0] + " && "), (set_up.body, test_command.body)


def why_skipped(block: Block) -> str | None:
    if "not-run" in block.marker:
        return block.marker["not-run"]
    run_as = block.marker.get("run", "")
    if "as root" in run_as and os.geteuid() != 0:
        return "needs root (network namespaces)"
    if "with slurm" in run_as:
        return slurm_missing()
    return None


# Started first, so that the shorter READMEs fill in beside them (measured here, each alone: the benchmarks' 70 s,
# the hooks recipe's 45 s, stage 03's and 08's 30 s, Slurm's mostly waiting; the others 25 s or less. Three at a
# time on 2 cores, each takes about twice as long). The top README's tour runs once per session (conftest.tour).
LONGEST = [ROOT / "benchmarks" / "README.md", ROOT / "recipes" / "comm_hooks" / "README.md",
           ROOT / "03_ddp_spawn" / "README.md", ROOT / "08_fsdp" / "README.md", ROOT / "slurm" / "README.md"]


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory) -> dict[str, Run | BaseException]:
    """Every selected block's run: each README's blocks in order in one copy, three READMEs at a time."""
    chosen = selected(request, "test_readme_command_runs_as_written", "block")
    docs: dict[Path, list[Block]] = {}
    for block in chosen:
        if not why_skipped(block) and block not in TOURS:
            docs.setdefault(block.doc, []).append(block)
    tmp = tmp_path_factory.mktemp("readme")

    def one_doc(blocks: list[Block]) -> dict[str, Run | BaseException]:
        copy = repo_copy(Path(tempfile.mkdtemp(dir=tmp)))
        done: dict[str, Run | BaseException] = {}
        for block in blocks:
            try:
                done[block.id] = run_block(block, copy)
            except BaseException as e:  # a bug here: reported by the block's own test
                done[block.id] = e
        return done

    order = sorted(docs, key=lambda doc: LONGEST.index(doc) if doc in LONGEST else len(LONGEST))
    with ThreadPoolExecutor(max_workers=3) as pool:
        return {k: v for done in pool.map(one_doc, [docs[d] for d in order]) for k, v in done.items()}


@pytest.mark.parametrize("block", COMMANDS, ids=[b.id for b in COMMANDS])
def test_readme_command_runs_as_written(block, outcomes, request):
    if why := why_skipped(block):
        pytest.skip(why)
    run = request.getfixturevalue("tour").run if block in TOURS else outcomes[block.id]
    if isinstance(run, BaseException):
        raise run
    where = f"{block.id}\n{run.describe()}"
    assert run.returncode is not None, f"killed at its time limit: {where}"
    assert run.returncode == 0, where
    assert not run.survivors, f"processes left running: {where}"
    if "expect" in block.marker:
        assert block.marker["expect"] in run.stdout, where
