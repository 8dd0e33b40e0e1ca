"""Every Markdown file renders as written: code fences closed, tables whole, links that lead somewhere.

What GitHub's renderer does silently and a reader meets as a broken page:
- a fence closed on the same line as text (`exit 0```) does not close: the rest of the page becomes code;
- a blank line inside a table ends it: the rows after it render as literal pipes;
- an unescaped `|` inside a cell (even inside backticks) cuts the cell in two, so the row has one cell too many;
- a relative link to a file that moved, or to a heading that was renamed, goes nowhere.
The last test plants each of these in a copy of a real page and sees it reported.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from harness import ROOT

DOCS = sorted(ROOT / name for name in subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True,
                                                        text=True, check=True).stdout.split())
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
LONGEST_README = 450  # lines: past that, a README holds two things (its teaching, and a reference)
SEPARATOR = re.compile(r"^\s*\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")


def prose(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, line) outside code fences."""
    outside, inside = [], False
    for number, line in enumerate(lines, 1):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            outside.append((number, line))
    return outside


def cells(row: str) -> int:
    """A table row's cells as GitHub counts them: split at every `|` not escaped, code spans included."""
    inner = row.strip()
    inner = inner[1:] if inner.startswith("|") else inner
    inner = inner[:-1] if inner.endswith("|") and not inner.endswith("\\|") else inner
    return len(re.split(r"(?<!\\)\|", inner))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose(text.splitlines()):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    found |= set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", text))
    return found


def problems(text: str, path: Path) -> list[str]:
    lines = text.splitlines()
    found = []
    opened = [number for number, line in enumerate(lines, 1) if FENCE.match(line)]
    if len(opened) % 2:
        found.append(f"line {opened[-1]}: a code fence opened and never closed")
    for number, line in prose(lines):
        if "```" in line and not line.lstrip().startswith("`") and re.search(r"\S```\s*$", line):
            found.append(f"line {number}: a fence glued to text does not close a code block: put ``` on its own line")
    # Tables: runs of consecutive lines starting with `|`, outside code.
    outside = prose(lines)
    runs: list[list[tuple[int, str]]] = []
    for i, (number, line) in enumerate(outside):
        if line.lstrip().startswith("|"):
            if runs and i > 0 and outside[i - 1][0] == number - 1 and outside[i - 1][1].lstrip().startswith("|"):
                runs[-1].append((number, line))
            else:
                runs.append([(number, line)])
    for run in runs:
        if len(run) < 2 or not SEPARATOR.match(run[1][1]):
            found.append(f"line {run[0][0]}: table rows without a header and a |---| line (a blank line inside a "
                         "table ends it: these render as literal pipes)")
            continue
        width = cells(run[0][1])
        found += [f"line {number}: {cells(row)} cells where the header has {width} (escape a | inside a cell as \\|)"
                  for number, row in run[2:] if cells(row) != width]
    # Headings: one title each; a second "## The change, as a diff" reads as a page put together twice, and its
    # anchor is not the one links name.
    seen: dict[str, int] = {}
    for number, line in outside:
        if m := re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line):
            title = f"{m.group(1)} {m.group(2)}"
            if title in seen:
                found.append(f"line {number}: the heading {title!r} again (first at line {seen[title]}): merge or "
                             f"rename")
            seen.setdefault(title, number)
    if path.name == "README.md" and len(lines) > LONGEST_README:
        found.append(f"{len(lines)} lines, above {LONGEST_README}: a README teaches one thing; move the measured "
                     f"detail or the reference to a page of its own")
    # Links: relative files exist, anchors name a heading of the page they point to.
    for number, line in outside:
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            page = (path.parent / file).resolve() if file else path
            if not page.exists():
                found.append(f"line {number}: link to {file}, which does not exist")
            elif anchor and page.suffix == ".md":
                if anchor not in anchors(page.read_text() if page != path else text):
                    found.append(f"line {number}: link to #{anchor}, no such heading in {page.relative_to(ROOT)}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_markdown_renders_as_written(doc: Path):
    found = problems(doc.read_text(), doc)
    assert not found, f"{doc.relative_to(ROOT)}:\n  " + "\n  ".join(found)


def test_the_check_sees_what_broke_pages_before():
    """The three bugs a reader found (2026-11-25), a renamed heading, a heading twice and a README past
    LONGEST_README lines, each planted in a page that passes."""
    doc = ROOT / "README.md"
    text = doc.read_text()
    table = next(line for line in text.splitlines() if line.startswith("| ") and "01_single_gpu" in line)
    fence_end = next(i for i, line in enumerate(text.splitlines()) if line.strip() == "```")
    lines = text.splitlines()
    glued = "\n".join(lines[:fence_end - 1] + [lines[fence_end - 1] + "```"] + lines[fence_end + 1:])
    heading = next(line for line in lines if line.startswith("## "))
    link = f"[see](#{slug(heading[3:])})"
    plants = {
        "blank line in a table": text.replace(table, "\n" + table, 1),
        "unescaped pipe in a cell": text.replace(table, table.rstrip("|").rstrip() + " a|b |", 1),
        "fence glued to text": glued,
        "link to a renamed heading": text.replace(heading, heading + " renamed", 1) + f"\n{link}\n",
        "link to a missing file": text + "\n[gone](no_such_folder/README.md)\n",
        "heading twice": text + f"\n{heading}\n",
        "README too long": text + "\nmore\n" * LONGEST_README,
    }
    assert not problems(text + f"\n{link}\n", doc), "the unplanted page (with the link) should pass"
    for what, planted in plants.items():
        assert problems(planted, doc), f"the check missed a {what}"
