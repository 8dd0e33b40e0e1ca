"""collectives/: the hand-written ring and parameter-server all-reduces give dist.all_reduce's answer.

One launch of collectives/check.py per world size runs every case (algorithms x dtypes x awkward
sizes) on every rank and writes one JSON file per rank; the tests read those files. A mutated copy
of allreduce.py shows the check is sharp: each planted bug is caught, on the sizes it breaks.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import readme_run
from harness import ROOT, Run, check, launch_commands, load_copy, time_limit

CHECK = ROOT / "collectives" / "check.py"
ALGORITHMS = {"ring_simple", "ring", "ring_pieces", "ps"}


# The README's check (3 ranks): its reports are read rather than the same command launched again.
README_WORLD = 3
README_CHECK = f"python3 collectives/check.py --world-size {README_WORLD} --out runs/collectives_check"


def reports_in(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def run_check(out: Path, script: Path = CHECK, world: int = 2) -> tuple[Run, list[dict]]:
    """Launch check.py with `world` ranks; return the run and every rank's report."""
    cmd = [sys.executable, str(script), "--world-size", str(world), "--out", str(out)]
    run = launch_commands([cmd], out, timeout=time_limit(programs=1 + world))  # itself and its ranks
    return run, reports_in(out)


@pytest.fixture(scope="module")
def checked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """checked(W): check.py's run with W ranks, launched once per module and shared (W = 3: the README's)."""
    done: dict[int, tuple[Run, list[dict]]] = {}

    def get(world: int) -> tuple[Run, list[dict]]:
        if world not in done:
            if world == README_WORLD:
                run = readme_run(request.getfixturevalue("readme_runs"), README_CHECK)
                done[world] = run, reports_in(run.out)
            else:
                done[world] = run_check(tmp_path_factory.mktemp(f"check{world}"), world=world)
        return done[world]
    return get


@pytest.mark.parametrize("world", [1, 2, pytest.param(README_WORLD, marks=pytest.mark.readme_run(README_CHECK)), 4])
def test_ring_and_ps_equal_dist_all_reduce(checked, world):
    run, reports = checked(world)
    check(run)
    assert [r["rank"] for r in reports] == list(range(world)), "every rank writes its report"
    for report in reports:
        cases = report["cases"]
        bad = [c for c in cases if not (c["matches_all_reduce"] and c["matches_expected"])]
        assert not bad, f"rank {report['rank']}: {bad[:5]}"
        # Ints compared exactly and floats to rounding, by check.py; here: only that the cases are there.
        assert {c["algorithm"] for c in cases} == ALGORITHMS
        assert {"int64", "float32"} <= {c["dtype"] for c in cases}
        for algorithm in ("ring", "ps", "ring_simple"):
            sizes = {c["numel"] for c in cases if c["algorithm"] == algorithm and c["dtype"] == "int64"}
            assert {0, 1, 7, 13, 97, 1009, 65537} <= sizes, "empty, one element and primes"
            assert 12 * world in sizes, "a multiple of W"
            assert any(n // world > (1 << 20) // 8 for n in sizes), "int64 chunks longer than one 1 MiB piece"
        assert any(c["shape"] == [7, 13] for c in cases), "a 2-D tensor"
    assert f"world size {world}: " in run.stdout and "FAILED" not in run.stdout


# Three planted bugs, one per algorithm family; each must be caught where it does damage.
MUTATIONS = [
    # chunk_bounds forgets the remainder: correct only when W divides the size (why the cases have primes).
    ("end = start + base + (1 if i < extra else 0)", "end = start + base"),
    # The fast ring stops one step early: the last all-gather step never happens.
    ("    steps = 2 * (world - 1)\n", "    steps = 2 * (world - 1) - 1\n"),
    # The parameter server overwrites instead of adding.
    ("flat.add_(buf)", "flat.copy_(buf)"),
]


def test_the_check_catches_a_broken_ring_and_a_broken_ps(tmp_path):
    copy = tmp_path / "collectives"
    for folder in ("collectives", "tools"):  # check.py imports tools/ from its folder's parent
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    source = (copy / "allreduce.py").read_text()
    for old, new in MUTATIONS:
        assert source.count(old) == 1, f"allreduce.py changed: expected one {old!r}"
        source = source.replace(old, new)
    (copy / "allreduce.py").write_text(source)

    world = 3
    run, reports = run_check(tmp_path / "out", copy / "check.py", world=world)
    assert run.returncode == 1 and "FAILED" in run.stdout, run.describe()
    assert len(reports) == world
    for report in reports:
        failed = {(c["algorithm"], c["dtype"], c["numel"]) for c in report["cases"]
                  if not (c["matches_all_reduce"] and c["matches_expected"])}
        for c in report["cases"]:
            key, n = (c["algorithm"], c["dtype"], c["numel"]), c["numel"]
            if c["algorithm"] == "ring_simple":  # only the chunk_bounds bug: wrong exactly when W does not divide n
                assert (key in failed) == (n % world != 0), key
            elif c["algorithm"] in ("ring", "ring_pieces"):  # plus the missing step: wrong whenever there is data
                assert (key in failed) == (n > 0), key
            else:  # ps: every non-empty tensor ends up as the last rank's, not the sum
                assert (key in failed) == (n > 0), key


def load_allreduce():
    spec = importlib.util.spec_from_file_location("collectives_allreduce", ROOT / "collectives" / "allreduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chunk_bounds_cover_any_size_in_near_equal_parts():
    chunk_bounds = load_allreduce().chunk_bounds
    for parts in range(1, 9):
        for numel in range(0, 40):
            bounds = chunk_bounds(numel, parts)
            assert len(bounds) == parts
            assert bounds[0][0] == 0 and bounds[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False)), "contiguous, no gap"
            lengths = [b - a for a, b in bounds]
            assert min(lengths) >= 0 and max(lengths) - min(lengths) <= 1


def test_bad_flag_is_one_line_and_exit_2():
    run = launch_commands([[sys.executable, str(CHECK), "--world-size", "0"]], timeout=time_limit())
    assert run.returncode == 2 and run.stdout == "", run.describe()
    assert run.stderr.strip().count("\n") == 0 and "--world-size" in run.stderr


def test_a_point_asked_for_twice_is_refused():
    """--sizes, --world-sizes and --algorithms take each value once: a repeated one was measured twice and the table
    showed the last of them twice (4K,4K: two rows of the CSV, one of the table)."""
    import argparse
    bench = load_copy(ROOT / "collectives" / "benchmark.py")
    for parse, text in ((bench.size_list, "4K,4K"), (bench.int_list, "2,2"), (bench.name_list, "ring,ring")):
        with pytest.raises(argparse.ArgumentTypeError, match="distinct"):
            parse(text)
    assert (bench.size_list("4K,1M"), bench.int_list("2,4"), bench.name_list("ring")) == ([4096, 2**20], [2, 4],
                                                                                        ["ring"])
