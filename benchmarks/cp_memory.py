"""Context parallelism's attention memory, measured: the peak each rank's causal attention (forward + backward) adds,
against the context length, for cp = 1 (fused SDPA) and cp = 2, 4 (12_context_parallel/train.py's ring and
all-gather attention, zigzag split), on gloo.

    python benchmarks/cp_memory.py                          # contexts 1024 to 8192 tokens, 1-2 minutes on 2 cores
    python benchmarks/cp_memory.py --tokens 512,1024 --out runs/cp_memory_quick

It starts 4 processes (fork, gloo, one intra-op thread each); a cp = 2 run uses ranks 0 and 1 while 2 and 3 wait,
cp = 1 rank 0 alone. Each rank builds its inputs first: q, k, v and the output's gradient, float32, of shape
[1, --heads, T_local, --head-size], its zigzag share of a T-token sequence (T_local = T / cp). Then, per
configuration, twice (the second is kept, the first having loaded whatever a first call loads):
- free what can be freed (gc, malloc_trim) and reset the kernel's peak resident set of the process (write "5" to
  /proc/self/clear_refs, Linux >= 4.0: VmHWM becomes the current VmRSS), and read VmRSS;
- run the attention's forward and backward: cp = 1 F.scaled_dot_product_attention(q, k, v, is_causal=True), as
  the stage does without --cp (a fused kernel: no scores matrix); cp > 1 ring_attention or allgather_attention;
- read VmHWM: the peak minus the VmRSS before is what the attention took beyond its inputs (the output and the
  gradients of q, k, v, alive at the end, included).
The table shows the largest over the ranks (the rank that would run out first) beside the size a materialised
scores matrix would have, heads x T_local x T x 4 bytes, for orientation. MiB = 2**20 bytes. What each one holds:
- cp = 1, is_causal=True: no mask and no scores matrix (the kernel works in tiles): linear in T;
- ring: for each zigzag chunk pair it computes, a block of scores [heads, T/2cp, T/2cp] and what is made from it
  (probabilities, their gradient, ...), a few such blocks at once: quadratic in T/cp, 1/(4 cp) of the scores each;
- all-gather: the whole sequence's k and v (and their gradients), linear in T, and the causal masks of its two
  zigzag chunks (chunk c's queries against the keys up to its end, [T/2cp, (c + 1) T/2cp] booleans, made once per
  shape and kept), which F.scaled_dot_product_attention turns into float ones (0 or -inf) for its fused kernel and
  keeps for the backward: (2 cp + 1) (T/2cp)^2 x (1 + 4) bytes, quadratic.
The masks the stage keeps (causal_mask, made once per shape) are dropped before each call, so that both calls make
them: the peak is what a training step holds, the kept masks included.

glibc's mmap threshold is fixed at 128 KiB (mallopt) before the processes start: every tensor above it gets pages of
its own, given back to the kernel when it is freed, so the resident set follows the live tensors. glibc's default
raises the threshold (up to 32 MiB) as big blocks are freed and then serves blocks below it from its heap, where freed
pages stay resident between live ones: the peak then measures glibc's heap layout as well (here up to 2.5 times as
much for the ring, whose blocks are many and of a few MiB).
With --out DIR: DIR/cp_memory.csv (one row per configuration and rank, bytes) and DIR/cp_memory.png (log-log).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, summary, write_csv  # noqa: E402
from tour import load_stage  # noqa: E402

WORLD, CPS = 4, (1, 2, 4)
METHODS = {1: ("sdpa",), 2: ("ring", "all-gather"), 4: ("ring", "all-gather")}  # what each cp runs
FUNCTIONS = {"ring": "ring_attention", "all-gather": "allgather_attention"}  # the stage's, for cp > 1
MULTIPLE = 2 * max(CPS)  # zigzag cuts a sequence into 2 cp equal chunks
MMAP_THRESHOLD = 128 * 1024  # bytes
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
COLUMNS = ["cp", "method", "tokens", "t_local", "heads", "head_size", "rank", "rss_before_bytes", "peak_bytes",
           "first_call_peak_bytes", "scores_bytes", "kv_bytes", "mask_bytes", "seconds"]
MIB = 2**20
RSS_PER_PROCESS = 300 * MIB  # torch + gloo + Python per rank (~240 MiB measured here), for the memory check


# --- the measurement --------------------------------------------------------------------------------

def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """VmHWM := VmRSS (man 5 proc, /proc/pid/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_reset_error() -> str | None:
    """Why this machine cannot measure a peak resident set here, or None."""
    try:
        reset_peak()
        status_kb("VmHWM")
        status_kb("VmRSS")
    except (OSError, RuntimeError) as e:
        return (f"cannot reset the peak resident set size ({e}): this benchmark needs Linux >= 4.0 with "
                f"/proc/self/clear_refs writable and VmHWM in /proc/self/status")
    return None


def libc() -> ctypes.CDLL | None:
    with contextlib.suppress(OSError):
        return ctypes.CDLL("libc.so.6")
    return None


def release() -> None:
    """Free what is garbage, and give the heap's free pages back to the kernel."""
    gc.collect()
    if (c := libc()) is not None:
        with contextlib.suppress(AttributeError):
            c.malloc_trim(0)


def inputs(cp: int, rank: int, tokens: int, args: argparse.Namespace, ring: ModuleType) -> list[torch.Tensor]:
    """q, k, v (leaves that want gradients) and the output's gradient: this rank's zigzag share of one sequence."""
    g = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
    shape = (1, args.heads, tokens, args.head_size)
    whole = [torch.randn(shape, generator=g) for _ in range(4)]
    q, k, v, dout = whole if cp == 1 else (ring.split_sequence(x, cp, rank, True, dim=2) for x in whole)
    return [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout]


def measure(ring: ModuleType, method: str, cp: int, tokens: int, group, rank: int,
            args: argparse.Namespace) -> dict:
    """This rank's extra peak resident bytes over one forward + backward, first and second call."""
    q, k, v, dout = inputs(cp, rank, tokens, args, ring)
    peaks, before, seconds = [], 0, 0.0
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        if group is not None:
            dist.barrier(group)  # all start together: nobody's peak includes waiting for a late neighbour's data
        ring.causal_mask.cache_clear()  # kept between steps: counted in the call, as a step holds them
        release()
        reset_peak()
        before = status_kb("VmRSS") * 1024
        start = time.perf_counter()
        if method == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = getattr(ring, FUNCTIONS[method])(q, k, v, group, True, True)
        out.backward(dout)
        peaks.append(status_kb("VmHWM") * 1024 - before)
        seconds = time.perf_counter() - start
        del out
    t_local = tokens // cp
    return {"cp": cp, "method": method, "tokens": tokens, "t_local": t_local, "heads": args.heads,
            "head_size": args.head_size, "rank": rank, "rss_before_bytes": before, "peak_bytes": peaks[1],
            "first_call_peak_bytes": peaks[0], "scores_bytes": args.heads * t_local * tokens * 4,
            "kv_bytes": 2 * args.heads * tokens * args.head_size * 4,
            "mask_bytes": mask_bytes(tokens, cp) if method == "all-gather" else 0, "seconds": seconds}


def mask_bytes(tokens: int, cp: int) -> int:
    """The all-gather's masks of a zigzag rank, boolean and SDPA's float copies: chunks r and 2 cp - 1 - r see
    r + 1 and 2 cp - r chunks of keys, 2 cp + 1 chunk pairs of (T/2cp)^2 in all, 1 + 4 bytes each."""
    return (2 * cp + 1) * (tokens // (2 * cp)) ** 2 * 5


def worker(rank: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, WORLD, args.port, args.timeout):
        ring = load_stage("12_context_parallel")
        groups = {cp: dist.new_group(list(range(cp))) for cp in CPS if cp > 1}  # every rank takes part in making each
        rows = []
        for cp in CPS:
            for method in METHODS[cp]:
                for tokens in args.tokens:
                    mine = measure(ring, method, cp, tokens, groups.get(cp), rank, args) if rank < cp else None
                    every = [None] * WORLD
                    dist.all_gather_object(every, mine)  # the ranks beyond cp wait here
                    rows += every[:cp]
                    if rank == 0:
                        peak = max(r["peak_bytes"] for r in every[:cp])
                        print(f"  cp={cp} {method:<10} {tokens:>6} tokens: {peak / MIB:8.1f} MiB/rank "
                              f"({max(r['seconds'] for r in every[:cp]):.2f} s)", flush=True)
        if rank == 0:
            results.put(rows)
    exit_worker()


# --- the report -------------------------------------------------------------------------------------

def summarise(rows: list[dict]) -> list[dict]:
    """One line per (cp, method, tokens): the largest peak over the ranks."""
    out = []
    for key in dict.fromkeys((r["cp"], r["method"], r["tokens"]) for r in rows):
        ranks = [r for r in rows if (r["cp"], r["method"], r["tokens"]) == key]
        top = max(ranks, key=lambda r: r["peak_bytes"])
        out.append({**top, "min_peak_bytes": min(r["peak_bytes"] for r in ranks)})
    return out


def print_table(lines: list[dict], args: argparse.Namespace) -> None:
    header = ["cp", "method", "tokens", "T/rank", "peak MiB", "min rank", "scores MiB", "peak/scores", "k,v MiB",
              "masks MiB"]
    table = [[str(r["cp"]), r["method"], str(r["tokens"]), str(r["t_local"]), f"{r['peak_bytes'] / MIB:.1f}",
              f"{r['min_peak_bytes'] / MIB:.1f}", f"{r['scores_bytes'] / MIB:.1f}",
              f"{r['peak_bytes'] / r['scores_bytes']:.2f}", f"{r['kv_bytes'] / MIB:.1f}",
              f"{r['mask_bytes'] / MIB:.1f}" if r["mask_bytes"] else "-"] for r in lines]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) if i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                             strict=True))))
    print(f"peak MiB: the most one rank's forward + backward added to its resident memory (second call; min rank: "
          f"the least over the ranks). scores MiB: heads x T/rank x tokens x 4 bytes, what a materialised scores "
          f"matrix would take; k,v MiB: the whole sequence's keys and values ({args.heads} heads x tokens x "
          f"{args.head_size} x 4 bytes x 2), what the all-gather gathers; masks MiB: the all-gather's boolean masks "
          f"of a rank's two chunks and SDPA's float copies, (2 cp + 1) x (tokens / 2 cp)^2 x (1 + 4) bytes.")


def plot(lines: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6.2))
    colors = {"sdpa": "C0", "ring": "C1", "all-gather": "C2"}
    markers = {1: "o", 2: "s", 4: "^"}
    names = {"sdpa": "F.scaled_dot_product_attention, is_causal (fused)", "ring": "ring attention",
             "all-gather": "all-gather attention"}
    for cp in CPS:
        for method in METHODS[cp]:
            pts = sorted((r["tokens"], r["peak_bytes"] / MIB) for r in lines if (r["cp"], r["method"]) == (cp, method))
            ax.plot(*zip(*pts, strict=True), marker=markers[cp], linestyle="--" if cp == 4 else "-",
                    color=colors[method], label=f"cp={cp}, {names[method]}")
    for cp in CPS:  # for orientation: a line of its own per cp, named at its right end
        pts = sorted({(r["tokens"], r["scores_bytes"] / MIB) for r in lines if r["cp"] == cp})
        ax.plot(*zip(*pts, strict=True), linestyle=":", color="grey", linewidth=1.2,
                label="a scores matrix's size, heads x T/cp x T x 4 B (not measured)" if cp == 1 else None)
        ax.annotate(f"scores, cp={cp}", pts[-1], xytext=(6, 0), textcoords="offset points", va="center",
                    fontsize=8, color="grey")
    tokens = sorted({r["tokens"] for r in lines})
    values = [r["peak_bytes"] / MIB for r in lines] + [r["scores_bytes"] / MIB for r in lines]
    low, high = min(values), max(values)
    ticks = [4.0**i for i in range(-3, 12) if low / 3 <= 4.0**i <= high * 3]
    ax.set(xscale="log", yscale="log", xlabel="context T (tokens)", ylabel="MiB per rank (the largest over the ranks)",
           xlim=(tokens[0] / 1.15, tokens[-1] * 1.6),
           title=f"causal attention, forward + backward: the peak resident memory it adds per rank\n"
                 f"[1, {args.heads} heads, T/cp, {args.head_size}] float32, zigzag split, gloo, torch "
                 f"{torch.__version__}")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command --------------------------------------------------------------------------------------

def needed_bytes(tokens: int, heads: int, head_size: int) -> int:
    """A generous bound on the memory of the hungriest configuration, its ranks together (float32)."""
    need = 0
    for cp in CPS[1:]:
        block = heads * (tokens // (2 * cp)) ** 2 * 4  # the ring's scores of one zigzag chunk pair
        mask = mask_bytes(tokens, cp)  # all-gather: the boolean masks and SDPA's float copies of them
        need = max(need, cp * max(8 * block, mask + 8 * heads * tokens * head_size * 4))  # measured: 6-7.5 blocks
    return need + WORLD * RSS_PER_PROCESS


def available_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = ArgumentParser(prog="benchmarks/cp_memory.py", description=summary(__doc__))
    p.add_argument("--tokens", type=list_of(int), default=[1024, 2048, 4096, 8192],
                   help=f"context lengths, comma-separated (each a multiple of {MULTIPLE}: 2 cp zigzag chunks)")
    p.add_argument("--heads", type=positive(int), default=4, help="attention heads")
    p.add_argument("--head-size", type=positive(int), default=32, help="features per head")
    p.add_argument("--timeout", type=positive(float), default=300.0, help="seconds a collective may wait")
    p.add_argument("--out", type=Path, help="write cp_memory.csv and cp_memory.png there")
    args = p.parse_args(argv)
    if bad := [t for t in args.tokens if t % MULTIPLE]:
        p.error(f"argument --tokens: each must be a multiple of {MULTIPLE} (zigzag cuts a sequence into 2 cp equal "
                f"chunks, cp up to {max(CPS)}), got {bad[0]}")
    need = needed_bytes(max(args.tokens), args.heads, args.head_size)
    if (free := available_bytes()) is not None and need > 0.8 * free:
        p.error(f"argument --tokens: {max(args.tokens)} tokens ({args.heads} heads of {args.head_size}) need "
                f"~{need / 2**30:.1f} GiB, more than 80% of the {free / 2**30:.1f} GiB available; use fewer tokens "
                f"or heads")
    if args.out is not None:
        p.check_out_writable(args.out)  # fail now, not after measuring
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (why := peak_reset_error()) is not None:
        print(f"benchmarks/cp_memory.py: error: {why}", file=sys.stderr)
        return 2
    args.tokens = sorted(args.tokens)
    args.port = free_port()
    if (c := libc()) is not None:  # inherited by the forked workers
        with contextlib.suppress(AttributeError):
            c.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    print(f"attention memory per rank: [1, {args.heads} heads, T/cp, {args.head_size}] float32, causal, zigzag; "
          f"T = {', '.join(map(str, args.tokens))}; cp = {', '.join(map(str, CPS))}; {WORLD} processes on "
          f"{os.cpu_count()} cores, gloo", flush=True)
    start = time.monotonic()
    results = mp.get_context("fork").SimpleQueue()
    # fork: the workers start with torch already imported (spawn would import it again, ~3 s each)
    try:
        mp.start_processes(worker, args=(args, results), nprocs=WORLD, start_method="fork")
    except mp.ProcessExitedException as e:  # killed (out of memory?): the others are stopped
        print(f"benchmarks/cp_memory.py: error: a worker died: {e}", file=sys.stderr)
        return 1
    rows = results.get()
    print(f"({time.monotonic() - start:.0f} s)\n")
    lines = summarise(rows)
    print_table(lines, args)
    if args.out is not None:
        write_csv(args.out / "cp_memory.csv", rows, COLUMNS)
        plot(lines, args, args.out / "cp_memory.png")
        print(f"\nwrote {args.out / 'cp_memory.csv'} and {args.out / 'cp_memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
