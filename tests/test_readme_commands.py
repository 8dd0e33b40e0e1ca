"""Every command the READMEs show runs as written, and every code excerpt is the code: the docs cannot drift.

How blocks are tagged and run, and the markers that say how: tests/readme_blocks.py. A ```python block is
checked against the train.py beside its README, line by line. A README's bash blocks run in order, in one
copy of the repository, as a reader runs them (a later block may use what an earlier one made), two READMEs at
a time (readme_blocks.AT_ONCE). They run in the background from the start of the session, after the top README's
tour (conftest: the tour's runs are the equivalence tests' `runs`); the tests here check what they did.

Each block runs with OMP_NUM_THREADS=1 (see run_block), and its `torchrun --standalone --nproc_per_node=N script`
and `python script.py` commands run forked from the session's import of torch (readme_blocks.launch_shims), but for
the GPT stages' READMEs (readme_blocks.THROUGH_LAUNCHERS), which run through torchrun and python themselves, and
for the first launch of each script through each launcher, which does too; the tour runs stages 01-10 through
torchrun itself. The README's set-up line (`python3 -m venv .venv &&
.venv/bin/pip install -r requirements.txt`) is not run again here: the test command starts with
it, and .ci/run runs that in a fresh clone (test_the_set_up_line_is_the_test_commands_own checks they are the
same). The copy's `.venv` is the environment these tests run in (~40 s saved: installing torch).
"""
from __future__ import annotations

import json
import re

import pytest

from forkrun import real_once_name
from harness import ROOT
from page_blocks import Block as PageBlock
from page_blocks import code_mismatch
from readme_blocks import BLOCKS, COMMANDS, LIMITS, REAL_LAUNCHES, THROUGH_LAUNCHERS, TOURS, shimmed, why_skipped

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
    "is a full profiling run (a minute or more): the quick run below it and tests/test_ddp_by_hand.py run the script",
    "is a full measuring run (minutes): the quick run below it and tests/test_zero_by_hand.py run the script",
    "is a full measuring run (minutes): the quick run below it and tests/test_experts.py run the script",
    # A test module's own run, which the suite makes itself; the block shows how its printed rows were made.
    "runs a test module, which the suite runs itself",
    # Throughput of this machine, minutes of it: a figure of the machine, dated, never compared.
    "measures this machine's speed (a minute or more), which no test compares",
    # Another project's code, which nothing here downloads (benchmarks/vs_nanogpt.py): where it is, the test runs.
    "needs nanoGPT's code beside the repository: tests/test_benchmarks.py runs the script's quick run where it is",
}
def test_every_code_block_says_whether_it_is_commands_or_output():
    untagged = [b.id for b in BLOCKS if b.lang not in ("bash", "text", "python", "diff")]
    assert not untagged, (f"tag these blocks ```bash (commands, run by this test), ```text (output), ```python "
                          f"(an excerpt of the train.py beside the README) or ```diff (the stage's lesson against "
                          f"the one it extends, written by tests/lesson_diffs.py and checked by test_repo): {untagged}")
    assert len(COMMANDS) >= 15, "the READMEs lost their commands?"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_code_excerpts_are_the_code(block):
    """A ```python block quotes the train.py beside its README, or in a GPT stage the files beside it, line by line
    (comments and `...` elisions aside). One tagged `<!-- excerpt: PATH -->` is whole consecutive lines of PATH, as
    on a page of your_model/ (page_blocks.code_mismatch): zero_by_hand/README.md quotes its scripts so."""
    if "excerpt" in block.marker:
        tagged = PageBlock(str(block.doc.relative_to(ROOT)), block.line, block.lang, block.body, "excerpt",
                           block.marker["excerpt"])
        assert not (why := code_mismatch(tagged)), f"{why}: paste the lines again"
        return
    script = block.doc.parent / "train.py"
    assert script.exists(), f"{block.id}: a ```python block must quote {script.relative_to(ROOT)}"
    code = "".join(path.read_text() for path in block.doc.parent.glob("*.py"))
    drifted = [line for line in block.body.splitlines()
               if (quoted := line.split("#")[0].split("...")[0].strip()) and quoted not in code]
    assert not drifted, f"{block.id}: not in {block.doc.parent.relative_to(ROOT)}'s .py files: {drifted}"


def test_only_allowed_reasons_leave_a_command_out():
    reasons = {b.id: b.marker["not-run"] for b in COMMANDS if "not-run" in b.marker}
    assert set(reasons.values()) <= NOT_RUN, reasons


def test_the_set_up_line_is_the_test_commands_own():
    """Why the set-up block may be left out: the test command (which .ci/run runs on a fresh clone) begins with it."""
    (set_up,) = [b for b in COMMANDS if b.marker.get("not-run") == "is the set-up the test command starts with"]
    (test_command,) = [b for b in COMMANDS if b.marker.get("not-run") == "is the test command itself"]
    assert set_up.doc == test_command.doc == ROOT / "README.md"
    assert test_command.commands()[0].startswith(set_up.commands()[0] + " && "), (set_up.body, test_command.body)


def test_a_script_that_launches_jobs_says_how_many_programs_its_block_starts():
    """A block's time limit counts the programs it starts (readme_blocks.launches): a script that runs jobs of its own
    (tour.run_job, subprocess.Popen) would count as one, so its blocks say how many in their marker. The tour's runs
    are counted from its plan; mp.spawn's ranks start at once, as torchrun's workers do, and count with their script."""
    launching = re.compile(r"\b(?:run_job|subprocess\.(?:Popen|run))\(")
    unsaid = [(b.id, script) for b in COMMANDS if not why_skipped(b) and "launches" not in b.marker
              for script in re.findall(r"(?<![\w/.-])([\w/.-]+\.py)\b", b.body)
              if script != "tour.py" and (ROOT / script).is_file() and launching.search((ROOT / script).read_text())]
    assert not unsaid, f"say how many programs these blocks start in all (<!-- launches: N (why) -->): {unsaid}"


@pytest.mark.parametrize("block", COMMANDS, ids=[b.id for b in COMMANDS])
def test_readme_command_runs_as_written(block, request):
    if why := why_skipped(block):
        pytest.skip(why)
    run = request.getfixturevalue("tour").run if block in TOURS else request.getfixturevalue("readme_runs")[block.id]
    if isinstance(run, BaseException):
        raise run
    where = f"{block.id}\n{run.describe()}"
    assert run.returncode is not None, f"killed at its time limit ({LIMITS.get(block.id)}): {where}"
    assert run.returncode == 0, where
    assert not run.survivors, f"processes left running: {where}"
    if "expect" in block.marker:
        assert block.marker["expect"] in run.stdout, where
    # Run in the order shown, every command trains: none resumes a snapshot that is already finished.
    assert "nothing to train" not in run.stdout, where


def test_each_script_a_readme_launches_runs_once_through_its_real_launcher(readme_runs):
    """The shims fork a README's `torchrun --standalone` and `python script.py` commands, but the first launch of each
    script through each launcher in the session, which runs through torchrun or Python itself (forkrun.REAL_ONCE;
    tested in test_forkrun); the tour runs stages 01-10's train.py through both itself, and the GPT stages' READMEs
    run whole through them (THROUGH_LAUNCHERS). So every script a README launches starts once as a reader starts it,
    and its block's test says whether it succeeded; the other commands differ in their flags."""
    (folder,) = REAL_LAUNCHES
    claims = {path.name: json.loads(path.read_text()) for path in folder.iterdir()}
    seen = {(pair, block.id) for block in COMMANDS if block.id in readme_runs and block.doc not in THROUGH_LAUNCHERS
            for command in block.commands() if (pair := shimmed(command))}
    unclaimed = sorted((pair, where) for pair, where in seen if real_once_name(*pair) not in claims)
    assert not unclaimed, f"launched by a README, never through its real launcher: {unclaimed}"
