"""The tagged blocks of a page of your_model/ (index.md, hugging_face.md), and how a test checks them against the code:
tests/test_your_model.py and tests/test_hugging_face.py read their pages with it.

A block is tagged by a comment on the line before it:

    <!-- file: PATH -->           ```python: the file PATH, whole
    <!-- excerpt: PATH -->        ```python: whole consecutive lines of PATH
    <!-- diff: A B -->            ```diff: `diff -u A B` without the timestamps (difflib's unified diff)
    <!-- run -->                  ```bash: the page's test runs it and keeps what it printed
    <!-- not-run: REASON -->      ```bash: not run, for the reason given
    <!-- output -->               ```text: what the run block just before printed, exactly
    <!-- output: approx -->       the same, with the numbers of a training run within rounding of another CPU
    <!-- output-part: SCRIPT -->  ```text: consecutive lines of what the run block of SCRIPT printed
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path

from harness import ROOT, Limit, time_limit
from readme_blocks import FENCE  # the READMEs' fences and tags, read the same way

NUMBER = re.compile(r"-?\d+\.\d+%?")


@dataclass(frozen=True)
class Block:
    page: str  # the page's file name
    line: int
    lang: str
    body: str
    kind: str  # the tag's key: file, excerpt, diff, run, not-run, output, output-part ("" if none)
    arg: str  # what follows its colon

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        kind, _, arg = (m.group("marker") or "").partition(":")
        found.append(Block(page.name, text[:m.start("lang")].count("\n") + 1, m.group("lang").strip(),
                           m.group("body"), kind.strip(), arg.strip()))
    return found


def untagged(blocks: list[Block]) -> list[str]:
    """The ids of blocks whose tag does not fit their language (or that have none)."""
    allowed = {"python": {"file", "excerpt"}, "diff": {"diff"}, "bash": {"run", "not-run"},
               "text": {"output", "output-part"}}
    return [b.id for b in blocks if b.kind not in allowed.get(b.lang, ())]


def code_mismatch(block: Block) -> str | None:
    """Why a python block is not the file (or the excerpt of it) that it names, or None."""
    code = (ROOT / block.arg).read_text()
    if block.kind == "file":
        return None if block.body == code else f"{block.id} is not {block.arg}: paste the file again"
    return None if ("\n" + block.body) in ("\n" + code) else f"{block.id} is not an excerpt of {block.arg}"


def diff_mismatch(block: Block) -> str | None:
    """Why a diff block is not the diff of the two files it names, or None."""
    a, b = block.arg.split()
    old, new = ((ROOT / path).read_text().splitlines(keepends=True) for path in (a, b))
    diff = "".join(difflib.unified_diff(old, new, a, b))
    return None if block.body == diff else f"{block.id}: the diff changed; the page should show:\n{diff}"


def shown_outputs(blocks: list[Block]) -> list[tuple[Block, Block]]:
    """(run block, output block) for every output block: it shows what the run block just before it printed."""
    pairs, run = [], None
    for block in blocks:
        if block.kind == "run":
            run = block
        elif block.kind == "output":
            assert run is not None, f"{block.id}: an output block with no run block before it"
            pairs.append((run, block))
    return pairs


def output_mismatch(shown: Block, printed: str) -> str | None:
    """Why `printed` is not what the output block `shown` shows, or None (with both, to read)."""
    why = difference(shown.body, printed, approx=shown.arg == "approx")
    return why and f"{shown.id}: {why}\n--- shown ---\n{shown.body}--- printed ---\n{printed}"


def difference(shown: str, printed: str, approx: bool) -> str | None:
    """Where `printed` differs from `shown`, or None. approx: decimals within another CPU's rounding after a few
    epochs of float32 training (a loss within 3%, a percentage within 0.5 points); the rest exactly."""
    if not approx:
        return None if shown == printed else "differs"
    a_lines, b_lines = shown.splitlines(), printed.splitlines()
    if len(a_lines) != len(b_lines):
        return f"{len(a_lines)} lines shown, {len(b_lines)} printed"
    for a, b in zip(a_lines, b_lines, strict=True):
        if NUMBER.sub("#", a) != NUMBER.sub("#", b):
            return f"{a!r} != {b!r}"
        for x, y in zip(NUMBER.findall(a), NUMBER.findall(b), strict=True):
            close = abs(float(x.rstrip("%")) - float(y.rstrip("%"))) <= (
                0.5 if x.endswith("%") else 0.03 * abs(float(x)) + 1e-3)
            if not close:
                return f"{x} shown, {y} printed: {b!r}"
    return None


def block_limit(block) -> Limit:
    """A run block's time limit (harness.time_limit): each line of the page's run blocks is one command, a `python`
    (one process) or a `torchrun` (its agent and its ranks)."""
    programs = 0
    for line in block.body.strip().splitlines():
        ranks = re.search(r"--nproc_per_node=(\d+)", line)
        assert line.split()[0] in ("python", "torchrun"), f"{block.id}: count the processes of {line!r}"
        programs += 1 + int(ranks.group(1)) if line.startswith("torchrun") else 1
    return time_limit(programs=programs)
