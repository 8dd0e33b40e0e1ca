"""Time dist.all_reduce (gloo) against the hand-written ring and parameter server, 4 KB to 64 MB.

    python collectives/benchmark.py                                  # W = 2 and 4, 4 KB .. 64 MB
    python collectives/benchmark.py --world-sizes 2 --sizes 16M,64M --out runs/coll

For each world size W it starts W processes (mp.spawn, gloo, one intra-op thread each) and, for
each tensor size and algorithm, times the all-reduce of a float32 tensor: warm-up calls first, then
the median over repeats of the slowest rank's time (the collective is done when the last rank has
the result). It reports

    algbw = bytes / time                  what the caller sees: the tensor's size over the time taken
    busbw = algbw * 2 (W - 1) / W         the bytes each rank had to move, over the time taken

busbw (the convention of nccl-tests) makes world sizes comparable: an all-reduce cannot do with less
than 2 (W-1)/W * N bytes sent by each rank (every rank must send away its W-1 shares of its tensor to
be reduced, and receive W-1 shares of the result), so busbw is the bandwidth each rank's link really
sustained, for an optimal algorithm. As the reference for what the hardware can move, the table also
shows the bandwidth of a plain copy (tensor.copy_) of the same size in one process.

Writes DIR/collectives.csv and DIR/collectives.png (--out, default runs/collectives).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from allreduce import PIECE_BYTES, ps_all_reduce, ring_all_reduce, ring_all_reduce_simple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, exit_worker, free_port, gloo_group, list_of, positive, write_csv  # noqa: E402

ALGORITHMS = ("all_reduce", "ring", "ps", "ring_simple")
COLUMNS = ["world_size", "oversubscribed", "algorithm", "bytes", "repeats", "median_ms", "algbw_GBps",
           "busbw_GBps", "copy_GBps", "time_vs_all_reduce", "busiest_rank_sent_bytes", "rank0_sent_bytes"]


def algorithm(name: str, piece_bytes: int):
    return {"all_reduce": dist.all_reduce, "ring": lambda t: ring_all_reduce(t, piece_bytes),
            "ps": ps_all_reduce, "ring_simple": ring_all_reduce_simple}[name]


def time_calls(calls: dict, reset, repeats: int, warmup: int, budget: float,
               max_over_ranks: bool) -> dict[str, list[float]]:
    """{name: [seconds of each timed round]} for each call in `calls`, after warm-up rounds.

    The calls take turns (round after round, each call once per round), so a machine that gets
    slower or faster during the measurement (other work, clock changes) affects them all alike,
    and their ratio stays fair. Fewer rounds if a round is slow: at least 5, within `budget` seconds.
    """
    times: dict[str, list[float]] = {name: [] for name in calls}
    planned, i = warmup + repeats, 0
    while i < planned:
        round_seconds = 0.0
        for name, fn in calls.items():
            reset()  # untimed: every call starts from the same input
            if max_over_ranks:
                dist.barrier()  # all ranks start together
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            if max_over_ranks:  # untimed: the call is done when the slowest rank is done
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            round_seconds += elapsed.item()
            if i >= warmup:
                times[name].append(elapsed.item())
        if i == warmup - 1:  # the last warm-up round sets the number of timed rounds (all ranks agree)
            planned = warmup + min(repeats, max(5, int(budget / max(round_seconds, 1e-9))))
        i += 1
    return times


def bytes_written() -> int:
    """Bytes this process has passed to write()-like system calls: here, what gloo sent over its sockets."""
    for line in Path("/proc/self/io").read_text().splitlines():  # Linux; counts every thread of the process
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise OSError("no wchar in /proc/self/io")


def bytes_sent_per_rank(fn, reset) -> list[int]:
    """Bytes each rank sends during one call of fn(), measured by the OS (one untimed call)."""
    reset()
    dist.barrier()
    before = bytes_written()
    fn()
    sent = torch.tensor([bytes_written() - before], dtype=torch.int64)
    dist.barrier()  # every rank's call is over before anyone gathers (gathering sends bytes too)
    everyone = [torch.zeros_like(sent) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, sent)
    return [int(t.item()) for t in everyone]


def worker(rank: int, world: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    with gloo_group(rank, world, args.port, args.timeout):
        rows = []
        for size in args.sizes:
            src = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))  # float32
            x = torch.empty_like(src)
            calls = {name: partial(algorithm(name, args.piece_bytes), x) for name in args.algorithms}
            timed = time_calls(calls, partial(x.copy_, src), args.repeats, args.warmup,
                               args.budget * len(calls), max_over_ranks=True)
            line = []
            for name, times in timed.items():
                seconds = statistics.median(times)
                # Relative to dist.all_reduce: the median of the rounds' ratios. The two calls of a round ran
                # back to back, so their ratio is spared the machine's slower and faster moments.
                paired = (statistics.median(t / ref for t, ref in zip(times, timed["all_reduce"], strict=True))
                          if "all_reduce" in timed else "")
                sent = bytes_sent_per_rank(calls[name], partial(x.copy_, src))
                rows.append({"world_size": world, "algorithm": name, "bytes": size, "repeats": len(times),
                             "median_ms": seconds * 1e3, "time_vs_all_reduce": paired,
                             "busiest_rank_sent_bytes": max(sent), "rank0_sent_bytes": sent[0]})
                line.append(f"{name} {seconds * 1e3:.2f} ms")
            if rank == 0:
                print(f"W={world} {human(size):>6}: " + " | ".join(line), flush=True)
        if rank == 0:
            results.put(rows)
    exit_worker()


def copy_bandwidth(sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """GB/s of dst.copy_(src) per size, in this process alone, one thread: what memory can move."""
    torch.set_num_threads(1)
    out = {}
    for size in sizes:
        src, dst = torch.randn(size // 4), torch.empty(size // 4)
        times = time_calls({"copy": partial(dst.copy_, src)}, lambda: None, args.repeats, args.warmup,
                           args.budget, max_over_ranks=False)["copy"]
        seconds = statistics.median(times)
        out[size] = size / seconds / 1e9
    return out


def human(size: int) -> str:
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def print_table(rows: list[dict], algorithms: list[str]) -> None:
    by = {(r["world_size"], r["bytes"], r["algorithm"]): r for r in rows}
    keys = sorted({(r["world_size"], r["bytes"]) for r in rows})
    header = ["W", "size", *[f"{a} ms" for a in algorithms]]
    if "ring" in algorithms and "all_reduce" in algorithms:
        header.append("ring/all_reduce")
    if "ps" in algorithms and "ring" in algorithms:
        header.append("ps/ring")
    header += [f"busbw {a}" for a in algorithms] + ["copy GB/s"]
    table = []
    for world, size in keys:
        r = {a: by[world, size, a] for a in algorithms}
        over = next(iter(r.values()))["oversubscribed"]
        cells = [f"{world}{'*' if over else ''}", human(size), *[f"{r[a]['median_ms']:.3f}" for a in algorithms]]
        if "ring/all_reduce" in header:
            cells.append(f"{r['ring']['time_vs_all_reduce']:.2f}")
        if "ps/ring" in header:
            cells.append(f"{r['ps']['median_ms'] / r['ring']['median_ms']:.2f}")
        cells += [f"{r[a]['busbw_GBps']:.3f}" for a in algorithms] + [f"{r[algorithms[0]]['copy_GBps']:.2f}"]
        table.append(cells)
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    if any(r["oversubscribed"] for r in rows):
        print(f"* oversubscribed: more processes than the {os.cpu_count()} CPU cores, which they share")
    print("ring/all_reduce: median over the rounds of ring time / all_reduce time, the two run back to back; "
          "ps/ring: ratio of the medians")
    print("busbw = algbw * 2(W-1)/W in GB/s (1 GB = 1e9 bytes); copy GB/s: one tensor.copy_ of the same size")

    # Traffic: what the busiest rank sends in one all-reduce of the largest tensor, counted by the OS.
    size = max(s for _, s in keys)
    print(f"\nbytes sent by the busiest rank in one all-reduce of N = {human(size)}, as a multiple of N "
          f"(measured: /proc/self/io wchar); each rank receives as much as it sends in a ring, rank 0 of ps "
          f"receives what it sends")
    header = ["W", *algorithms, "2(W-1)/W"]
    table = [[str(w), *[f"{by[w, size, a]['busiest_rank_sent_bytes'] / size:.2f}" for a in algorithms],
              f"{2 * (w - 1) / w:.2f}"] for w in sorted({w for w, _ in keys})]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def plot(rows: list[dict], algorithms: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    worlds = sorted({r["world_size"] for r in rows})
    styles = {w: s for w, s in zip(worlds, ["-", "--", ":", "-."] * 4, strict=False)}
    fig, (left, right, traffic) = plt.subplots(1, 3, figsize=(17, 4.5), width_ratios=[1, 1, 0.7])
    for world in worlds:
        over = " (oversubscribed)" if any(r["oversubscribed"] for r in rows if r["world_size"] == world) else ""
        for i, name in enumerate(algorithms):
            pts = sorted((r["bytes"], r["busbw_GBps"], r["time_vs_all_reduce"]) for r in rows
                         if r["world_size"] == world and r["algorithm"] == name)
            kw = {"color": f"C{i}", "linestyle": styles[world], "marker": "o", "markersize": 3}
            left.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{name}, W={world}{over}", **kw)
            if all(p[2] != "" for p in pts):  # ratios exist only when dist.all_reduce was timed too
                right.plot([p[0] for p in pts], [p[2] for p in pts], label=f"{name}, W={world}", **kw)
    copy = sorted({(r["bytes"], r["copy_GBps"]) for r in rows})
    left.plot([c[0] for c in copy], [c[1] for c in copy], color="grey", linewidth=3, alpha=0.5,
              label="tensor.copy_ (one process)")
    left.set(xscale="log", yscale="log", xlabel="tensor size (bytes)", ylabel="busbw (GB/s)",
             title="bus bandwidth = algbw * 2(W-1)/W")
    right.axhline(1.0, color="grey", linewidth=1)
    right.axhline(1.25, color="grey", linewidth=1, linestyle=":")
    right.set(xscale="log", yscale="log", xlabel="tensor size (bytes)", ylabel="time / dist.all_reduce time",
              title="time relative to dist.all_reduce (gloo)")
    right.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    right.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    # The busiest rank's traffic against W: measured points on the formulas (ring 2(W-1)/W, ps W-1).
    size = max(r["bytes"] for r in rows)
    span = range(2, max(8, max(worlds)) + 1)
    traffic.plot(span, [2 * (w - 1) / w for w in span], color="C1", alpha=0.4, label="ring: 2(W-1)/W")
    traffic.plot(span, [w - 1 for w in span], color="C2", alpha=0.4, label="ps, rank 0: W-1")
    for i, name in enumerate(algorithms):
        pts = sorted((r["world_size"], r["busiest_rank_sent_bytes"] / size) for r in rows
                     if r["algorithm"] == name and r["bytes"] == size)
        traffic.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=f"C{i}", markersize=11 - 2.5 * i,
                     label=f"{name} (measured)")  # shrinking markers: equal values stay visible
    traffic.set(xlabel="world size W", ylabel="bytes sent by the busiest rank / N",
                title=f"traffic of one all-reduce (N = {human(size)})")
    traffic.legend(fontsize=7)
    fig.suptitle(f"all-reduce of float32 tensors on gloo/CPU ({os.cpu_count()} cores, torch {torch.__version__})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def size_list(text: str) -> list[int]:
    """'4K,1M,64M' -> bytes; multiples of 4 (float32 elements)."""
    out = []
    for item in text.split(","):
        item = item.strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(item[-1:], 1)
        number = item[:-1] if scale > 1 else item
        if not number.isdigit() or int(number) * scale % 4 or int(number) == 0:
            raise argparse.ArgumentTypeError(f"expected sizes such as 4K,1M,64M (positive multiples of 4 bytes), "
                                             f"got {text!r}")
        out.append(int(number) * scale)
    if len(set(out)) < len(out):  # (a point measured twice, shown once)
        raise argparse.ArgumentTypeError(f"expected distinct sizes, got {text!r}")
    return out


def int_list(text: str) -> list[int]:
    values = list_of(int)(text)  # distinct positive integers
    if min(values) < 2:  # one process has nothing to reduce with
        raise argparse.ArgumentTypeError(f"expected world sizes of 2 or more, such as 2,4, got {text!r}")
    return values


def name_list(text: str) -> list[str]:
    return list_of(str, ALGORITHMS)(",".join(n.strip() for n in text.split(",")))


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="collectives/benchmark.py", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=size_list, default=size_list("4K,16K,64K,256K,1M,4M,16M,64M"),
                   help="tensor sizes in bytes, K/M suffixes (default 4K,16K,...,64M)")
    p.add_argument("--world-sizes", type=int_list, default=[2, 4], help="comma-separated (default 2,4)")
    p.add_argument("--algorithms", type=name_list, default=list(ALGORITHMS),
                   help=f"comma-separated subset of {','.join(ALGORITHMS)}")
    p.add_argument("--repeats", type=positive(int), default=30, help="timed calls per point, at most (default 30)")
    p.add_argument("--warmup", type=positive(int), default=2, help="untimed calls first (default 2)")
    p.add_argument("--budget", type=positive(float), default=2.0,
                   help="seconds of timed calls per point: fewer repeats (at least 5) for slow calls")
    p.add_argument("--piece-bytes", type=positive(int), default=PIECE_BYTES, help="the fast ring's piece size")
    p.add_argument("--out", type=Path, default=Path("runs/collectives"), help="where to write the CSV and PNG")
    p.add_argument("--timeout", type=positive(float), default=120.0,
                   help="seconds a collective waits for the other ranks before the job fails")
    args = p.parse_args(argv)
    p.check_out_writable(args.out)  # fail now, not after measuring

    cores = os.cpu_count() or 1
    print(f"all-reduce benchmark: float32, sizes {human(min(args.sizes))} .. {human(max(args.sizes))}, "
          f"W = {','.join(map(str, args.world_sizes))} ({cores} CPU cores), gloo, 1 intra-op thread per rank, "
          f"median of up to {args.repeats} after {args.warmup} warm-up calls; torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    for world in args.world_sizes:
        args.port = free_port()
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(worker, args=(world, args, queue), nprocs=world)  # worker(rank, world, args, queue)
        rows += queue.get()
    copy = copy_bandwidth(args.sizes, args)  # after the ranks are gone: the machine is otherwise idle
    for r in rows:
        w, seconds = r["world_size"], r["median_ms"] / 1e3
        r["oversubscribed"] = w > cores
        r["algbw_GBps"] = r["bytes"] / seconds / 1e9
        r["busbw_GBps"] = r["algbw_GBps"] * 2 * (w - 1) / w
        r["copy_GBps"] = copy[r["bytes"]]

    print()
    print_table(rows, args.algorithms)
    write_csv(args.out / "collectives.csv", rows, COLUMNS)
    plot(rows, args.algorithms, args.out / "collectives.png")
    print(f"\nwrote {args.out / 'collectives.csv'} and {args.out / 'collectives.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
