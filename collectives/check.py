"""Check the hand-written all-reduces against dist.all_reduce (gloo), case by case.

    python collectives/check.py --world-size 3
    python collectives/check.py --world-size 4 --out runs/check4     # also write one JSON file per rank
    torchrun --standalone --nproc_per_node=3 collectives/check.py   # one rank per torchrun process instead

Starts W processes (mp.spawn, gloo on the CPU), or under torchrun is one of its processes. Every rank
runs every case: each algorithm of allreduce.py on awkward sizes (empty, 1 element, fewer elements
than ranks, primes, a multiple of W, pieces of uneven length) and several dtypes, and compares its
result with dist.all_reduce of the same input and with the sum computed locally from every rank's
input (each rank can regenerate them all, they come from seeded generators). Integers must match
exactly; floats to rounding (the algorithms add in different orders). Prints one line per mismatch,
then a verdict; exits 1 if anything differs.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from allreduce import ps_all_reduce, ring_all_reduce, ring_all_reduce_simple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, positive  # noqa: E402

ALGORITHMS = {
    "ring_simple": ring_all_reduce_simple,
    "ring": ring_all_reduce,
    # The fast ring with 64-byte pieces: tensors of a few hundred elements already stream through
    # the ring in many pieces, the last one shorter, the chunks' piece counts unequal.
    "ring_pieces": lambda t: ring_all_reduce(t, piece_bytes=64),
    "ps": ps_all_reduce,
}
DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "float64": torch.float64}
# (rtol, atol) for floats: W values of magnitude ~10 added in another order differ by a few ulps.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


def sizes(world: int) -> list[int]:
    """Element counts: empty, fewer than W, primes (never a multiple of W), a multiple of W, one large."""
    return sorted({0, 1, 2, 3, 5, 7, 13, 97, 1009, 12 * world, 65537, 1_000_003})


def make_input(seed: int, case: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input for case `case`: any rank can regenerate any other rank's."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + case * 1009 + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g, dtype=torch.float64) * 10).to(dtype)
    return torch.randint(-2**20, 2**20, (numel,), generator=g, dtype=torch.int64).to(dtype)


def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)  # integer sums are exact, whatever the order
    rtol, atol = TOLERANCE[a.dtype]
    return torch.allclose(a, b, rtol=rtol, atol=atol)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.numel() == 0:
        return 0.0 if a.shape == b.shape else math.inf
    return (a.double() - b.double()).abs().max().item()


def run_cases(rank: int, world: int, seed: int) -> list[dict]:
    results, case = [], 0
    shapes = [(n,) for n in sizes(world)] + [(7, 13)]  # a 2-D tensor must come back 2-D
    for dtype_name, dtype in DTYPES.items():
        for shape in shapes:
            case += 1
            numel = math.prod(shape)
            mine = make_input(seed, case, rank, numel, dtype).view(shape)
            # The exact sum, computed here from every rank's input (in float64 / int64, then cast).
            wide = torch.float64 if dtype.is_floating_point else torch.int64
            expected = sum(make_input(seed, case, r, numel, dtype).to(wide) for r in range(world))
            expected = expected.to(dtype).view(shape)
            reference = mine.clone()
            dist.all_reduce(reference)  # what torch's own all-reduce (gloo) says
            for name, algorithm in ALGORITHMS.items():
                if name == "ring_pieces" and numel > 1009:  # thousands of 64-byte messages: slow, no news
                    continue
                result = mine.clone()
                algorithm(result)
                results.append({
                    "algorithm": name, "dtype": dtype_name, "numel": numel, "shape": list(shape),
                    "matches_all_reduce": agree(result, reference), "matches_expected": agree(result, expected),
                    "max_abs_diff_all_reduce": max_diff(result, reference),
                })
    return results


def check_rank(rank: int, world: int, args: argparse.Namespace) -> int:
    """Every case on this rank, in a process group that exists already; returns the mismatches over all ranks."""
    results = run_cases(rank, world, args.seed)
    bad = [r for r in results if not (r["matches_all_reduce"] and r["matches_expected"])]
    for r in bad:
        print(f"rank {rank}: MISMATCH {r['algorithm']} {r['dtype']} numel={r['numel']} "
              f"(max |diff| vs all_reduce {r['max_abs_diff_all_reduce']:.3g})", flush=True)
    if args.out is not None:
        report = {"world_size": world, "rank": rank, "torch": torch.__version__, "cases": results}
        (args.out / f"rank{rank}.json").write_text(json.dumps(report, indent=1) + "\n")
    failures = torch.tensor([len(bad)])
    dist.all_reduce(failures)  # the total over all ranks
    if rank == 0:
        n = len(results)
        print(f"world size {world}: {n - len(bad)}/{n} cases per rank agree with dist.all_reduce "
              f"({', '.join(ALGORITHMS)}; {', '.join(DTYPES)}; sizes {sizes(world)})" +
              ("" if failures.item() == 0 else f"\nFAILED: {failures.item()} mismatches over {world} ranks"),
              flush=True)
    return failures.item()


def worker(rank: int, world: int, args: argparse.Namespace, verdict: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        failures = check_rank(rank, world, args)
        if rank == 0:
            verdict.put(failures)
    exit_worker()


def under_torchrun(args: argparse.Namespace) -> None:
    """Started by torchrun (tests/sync_sends.py runs the check so): this process is one rank; exit 1 on any mismatch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    failures = check_rank(dist.get_rank(), dist.get_world_size(), args)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(1 if failures else 0)  # as exit_worker: past interpreter teardown, which can abort gloo's threads


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="collectives/check.py", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=positive(int), default=4,
                   help="processes to start (default 4); under torchrun, its --nproc_per_node instead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write rank<r>.json (every case's result) here")
    p.add_argument("--timeout", type=positive(float), default=60.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    args = p.parse_args(argv)
    if args.out is not None:
        p.check_out_writable(args.out)  # fail now, not after measuring
    if "RANK" in os.environ:  # torchrun started this process: its world size, not --world-size
        under_torchrun(args)
    args.port = free_port()
    verdict = mp.get_context("spawn").SimpleQueue()  # rank 0 puts the number of mismatches here
    mp.spawn(worker, args=(args.world_size, args, verdict), nprocs=args.world_size)  # worker(rank, ...)
    return 1 if verdict.empty() or verdict.get() else 0


if __name__ == "__main__":
    sys.exit(main())
