"""Each stage shows its train.py as a diff from the stage it extends, on a page of its own beside its README (DIFF.md),
so a reader sees what changed without running `diff` while the README teaches (a GPT stage, a folder of files: the
files it changes, each as a diff); ddp_by_hand's README and zero_by_hand's DIFF.md show their scripts so (FILE_DIFFS).
test_repo.py, test_ddp_by_hand.py and test_zero_by_hand.py check that every such block is the diff of today's files;
`python tests/lesson_diffs.py` writes them anew after a change.
"""
from __future__ import annotations

import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The stage each one extends: 08 builds on 06 (torchrun, snapshots), not on 07's split over two devices; 10 on 05
# (torchrun, the layout), taking 07's idea, the split between layers, across processes (without 06's snapshots).
# 11_gpt has none: it rewrites the model and the data, and a diff of the whole lesson would teach nothing. 12 adds
# context parallelism to 11's GPT, 13 pipelining to 12's, 14 experts to 13's.
EXTENDS = {"02_dataparallel": "01_single_gpu", "03_ddp_spawn": "02_dataparallel", "04_ddp_torchrun": "03_ddp_spawn",
           "05_multinode": "04_ddp_torchrun", "06_checkpoint": "05_multinode", "07_model_parallel": "06_checkpoint",
           "08_fsdp": "06_checkpoint", "09_tensor_parallel": "08_fsdp", "10_pipeline_parallel": "05_multinode",
           "12_context_parallel": "11_gpt", "13_pipeline_4d": "12_context_parallel",
           "14_experts": "13_pipeline_4d"}
START, END = "<!-- diff from the stage it extends: written by tests/lesson_diffs.py -->", "<!-- /diff -->"
# An empty block (a new README's placeholder) matches too, its group 1 None, as _file_diff_pattern's does.
BLOCK = re.compile(re.escape(START) + r"\n(?:(.*?)\n)??" + re.escape(END), re.S)
# Other pages' diffs of two files, each block after the line `<!-- diff OLD NEW -->`: {page: [(OLD, NEW), ...]}
FILE_DIFFS = {"ddp_by_hand/README.md": [("04_ddp_torchrun/train.py", "ddp_by_hand/naive.py"),
                                        ("ddp_by_hand/naive.py", "ddp_by_hand/bucketed.py")],
              # zero_by_hand's README shows its scripts' new code; zero3.py, a rewrite of zero2.py, is not diffed.
              "zero_by_hand/DIFF.md": [("ddp_by_hand/bucketed.py", "zero_by_hand/zero1.py"),
                                       ("zero_by_hand/zero1.py", "zero_by_hand/zero2.py")]}

BOUNDARY = "# ═══ The lesson ends here"


def lesson(stage: str) -> str:
    """The lesson of a stage's train.py ("08_fsdp") or of another script ("ddp_by_hand/naive.py")."""
    path = ROOT / stage if stage.endswith(".py") else ROOT / stage / "train.py"
    return path.read_text().split(BOUNDARY)[0].rstrip() + "\n"


def own_checks(stage: str) -> list[str]:
    """What the stage adds below the boundary, after the machinery every stage shares ("# ─── This stage's own")."""
    text = (ROOT / stage / "train.py").read_text().split(BOUNDARY)[1]
    own = text.split("\n# ─── This stage's own", 1)[1] if "\n# ─── This stage's own" in text else ""
    return re.findall(r"^(?:def|class) (\w+)", own, re.M)


def code(path: Path) -> list[str]:
    """A file's lines after its module docstring (the README teaches what the docstring says)."""
    text = path.read_text()
    tree = ast.parse(text)
    docstring = tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
    return text.splitlines()[tree.body[0].end_lineno if docstring else 0:]


def changed_lines(lines: list[str]) -> tuple[int, int]:
    """(lines added, lines removed) of a unified diff, its file headers aside."""
    return (sum(line.startswith("+") and not line.startswith("+++") for line in lines),
            sum(line.startswith("-") and not line.startswith("---") for line in lines))


def folder_diff(stage: str, before: str) -> str:
    """A GPT stage's section: the folder against the one it extends, file by file. A file the stage adds is linked
    (read whole), a file it copies unchanged named (test_repo checks it is a copy), the others diffed."""
    names = sorted(p.name for p in (ROOT / stage).glob("*.py"))
    new = [n for n in names if not (ROOT / before / n).exists()]
    same = [n for n in names if n not in new and (ROOT / before / n).read_bytes() == (ROOT / stage / n).read_bytes()]
    changed = [n for n in names if n not in new and n not in same]
    lines = [line for n in changed for line in changes(ROOT / before / n, ROOT / stage / n, f"{before}/{n}",
                                                        f"{stage}/{n}")]
    added, removed = changed_lines(lines)
    return (f"`{stage}/` against `{before}/`, the stage it extends. New, to read whole: "
            + ", ".join(f"[`{n}`]({n})" for n in new) + ". Copied unchanged: " + ", ".join(f"`{n}`" for n in same)
            + f". Changed ({added} lines added, {removed} removed; each file's docstring aside, which this README "
            f"says at length; each change headed by its lines in the two files and the definition it is in): "
            + ", ".join(f"`{n}`" for n in changed) + ":\n\n```diff\n" + "\n".join(lines) + "\n```")


HUNK = re.compile(r"@@ -(\d+)(,\d+)? \+(\d+)(,\d+)? @@")
DEFINITION = re.compile(r"\s*((?:async def|def|class) \w+)")


def changes(old: Path, new: Path, old_name: str, new_name: str) -> list[str]:
    """The changed lines of two files, docstring aside, without context: each hunk's header gives the lines' numbers
    in the files themselves and, as git's does, the nearest definition above (`@@ -40,2 +40,3 @@ def forward`)."""
    before, after = code(old), code(new)
    skipped = [len(path.read_text().splitlines()) - len(lines) for path, lines in ((old, before), (new, after))]
    out = []
    for line in difflib.unified_diff(before, after, old_name, new_name, n=0, lineterm=""):
        if m := HUNK.fullmatch(line):
            above = [d[1] for a in after[:max(int(m[3]) - 1, 0) + (m[4] == ",0")] if (d := DEFINITION.match(a))]
            line = (f"@@ -{int(m[1]) + skipped[0]}{m[2] or ''} +{int(m[3]) + skipped[1]}{m[4] or ''} @@"
                    + (f" {above[-1]}" if above else ""))
        out.append(line)
    return out


def diff(stage: str) -> str:
    """The README's section: `diff -u` of the two lessons (the files above the boundary), one line of context."""
    before = EXTENDS[stage]
    if (ROOT / stage / "model.py").exists():  # a GPT stage: a folder of files
        return folder_diff(stage, before)
    lines = list(difflib.unified_diff(lesson(before).splitlines(), lesson(stage).splitlines(),
                                      f"{before}/train.py", f"{stage}/train.py", n=1, lineterm=""))
    added, removed = changed_lines(lines)
    checks = ", ".join(f"`{name}`" for name in own_checks(stage))
    below = f"; below it, this stage's own checks: {checks}" if checks else ""
    return (f"The lesson of `{stage}/train.py` against `{before}/train.py`, the stage it extends ({added} lines\n"
            f"added, {removed} removed). Both files end with the same machinery after the line `The lesson ends\n"
            f"here`{below}.\n\n```diff\n" + "\n".join(lines) + "\n```")


def file_diff(old: str, new: str) -> str:
    """The lessons of two scripts as a diff, one line of context."""
    return "\n".join(difflib.unified_diff(lesson(old).splitlines(), lesson(new).splitlines(), old, new, n=1,
                                         lineterm=""))


def _file_diff_pattern(old: str, new: str) -> re.Pattern:
    """The marker line, then the ```diff block after it (its text: group 1)."""
    # An empty block (a new README's placeholder) matches too: `(.*?)\n` alone would run on to the next fence.
    return re.compile(re.escape(f"<!-- diff {old} {new} -->") + r"\n```diff\n(?:(.*?)\n)??```", re.S)


def file_diff_block(readme: str, old: str, new: str) -> re.Match | None:
    """The diff of `old` and `new` that `readme` shows (its text: group 1), None if it shows none."""
    return _file_diff_pattern(old, new).search((ROOT / readme).read_text())


def write_file_diffs(readme: str) -> bool:
    """Put today's FILE_DIFFS in `readme`, where its markers are; True if it changed."""
    path = ROOT / readme
    text = new = path.read_text()
    for old, name in FILE_DIFFS[readme]:
        block = f"<!-- diff {old} {name} -->\n```diff\n{file_diff(old, name)}\n```"
        new = _file_diff_pattern(old, name).sub(lambda _, b=block: b, new)
    path.write_text(new)
    return new != text


DIFF_PAGE = "DIFF.md"  # beside a stage's README: its lesson against the one it extends


def diff_page(stage: str) -> str:
    """The whole page: a title, where it comes from, and the diff between the markers."""
    before = EXTENDS[stage]
    return (f"# {stage}: the change, as a diff\n\nWhat [{stage}](README.md) changes in "
            f"[{before}](../{before}/README.md), line by line. Written by `python tests/lesson_diffs.py`; "
            f"`tests/test_repo.py` checks that it is today's.\n\n{START}\n{diff(stage)}\n{END}\n")


def write(stage: str) -> bool:
    """Put today's diff on the stage's DIFF.md; True if it changed."""
    path = ROOT / stage / DIFF_PAGE
    text = path.read_text() if path.exists() else ""
    path.write_text(diff_page(stage))
    return diff_page(stage) != text


if __name__ == "__main__":
    changed = [stage for stage in EXTENDS if write(stage)]
    changed += [readme for readme in FILE_DIFFS if write_file_diffs(readme)]
    print(f"rewrote the diff in {', '.join(changed) or 'no README'}")
    sys.exit(0)
