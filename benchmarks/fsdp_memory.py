"""FSDP memory on the CPU: peak RSS and model-state bytes per rank for DDP and FSDP2 at W = 1, 2, 4.

    python benchmarks/fsdp_memory.py                                   # 101 M parameters, ~2.5 min on 2 cores
    python benchmarks/fsdp_memory.py --width 256 --blocks 8 --steps 2  # a quick look (0.5 M parameters, ~20 s)

The model is an MLP of --blocks equal blocks, each Linear(width, width) + ReLU, so the largest unit FSDP
gathers is 1/blocks of the model. One job, `torchrun --standalone --nproc_per_node=max(W)` (gloo,
OMP_NUM_THREADS=1), trains it for --steps SGD-momentum steps per W and mode, one after the other; a run at
W ranks uses ranks 0..W-1 (a process group and device mesh of their own) while the others wait, idle. Modes:

    ddp               DistributedDataParallel: every rank holds the whole model, its gradients, SGD's
                      momentum, and DDP's gradient buckets (a flat copy of the gradients it all-reduces)
    fsdp              FSDP2: fully_shard on each block, then on the root. Each rank holds 1/W of every
                      parameter, gradient and momentum, and gathers a block whole only while it computes
                      with it (all-gather before its forward and again before its backward)
    fsdp_no_reshard   the same with reshard_after_forward=False: a block stays gathered from its forward
                      to its backward (one all-gather per block and step instead of two)

FSDP builds the model on the meta device and allocates only the shards (to_empty), as one must when the
whole model would not fit on one device; its weights are random, not DDP's (this measures memory only).
Per rank it records

    rss_before     resident memory (VmRSS) just before the model is built: torch, gloo, Python
    peak_rss       the kernel's peak resident memory (VmHWM) from then to the end of the last step; the
                   counter is reset before each mode (/proc/self/clear_refs), so each mode has its own peak
    state_bytes    what the rank holds after a step: parameters + gradients + momentum, counted from its
                   own tensors (the local shards for FSDP)

beside the theory, for P the bytes of the parameters, U those of one block and W ranks:

    state   DDP 3P;  FSDP 3P / W  (ZeRO-3: all three are sharded)
    peak    ddp              4P               at the end of the backward: parameters, gradients, momentum,
                                              and the buckets (a copy of the gradients)
            fsdp             3P / W + U       at the end of the backward: the shards, and the first block
                                              gathered for its backward
            fsdp_no_reshard  2P / W + P       at the start of the backward: every block is still gathered,
                                              and no gradient exists yet (zero_grad(set_to_none=True) freed
                                              them); or 3P / W + U if larger (W = 1)

The workers run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_): every tensor above 128 KiB gets
pages of its own, returned to the kernel when it is freed, so RSS follows the live tensors instead of what
glibc keeps cached, and one mode's freed memory does not count in the next one's baseline. The price is a
page fault for every new tensor: the seconds per step it prints are not a speed comparison.
Writes DIR/fsdp_memory.csv (one row per mode, W and rank, in bytes) and DIR/fsdp_memory.png; the table
shows MB = 2**20 bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tools/ and tour.py
from tools.cli import ArgumentParser, exit_worker, list_of, positive, write_csv  # noqa: E402

MODES = ("ddp", "fsdp", "fsdp_no_reshard")
COLUMNS = ["mode", "world_size", "rank", "params", "blocks", "width", "batch", "steps", "param_bytes", "unit_bytes",
           "rss_before_bytes", "peak_rss_bytes", "model_rss_bytes", "state_bytes", "theory_state_bytes",
           "state_vs_theory", "theory_peak_bytes", "step_s"]
THEORY = {"ddp": "4P", "fsdp": "3P/W + U", "fsdp_no_reshard": "max(2P/W + P, 3P/W + U)"}  # the peak's model part
MMAP_THRESHOLD = 128 * 1024  # bytes; glibc's default starts there but rises up to 32 MiB as big blocks are freed
RSS_PER_PROCESS = 450 * 2**20  # torch + gloo + Python, per rank (~310 MB measured here), for the memory check


# --- the workers (under torchrun) ------------------------------------------------------------------
# torch is imported inside the functions: the launcher never needs it, so a bad flag is answered at once.

def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def release_and_reset_peak() -> None:
    """Give freed memory back to the kernel, then restart the peak-RSS counter (VmHWM) from the current RSS."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc: free pages in the heap's holes too
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: "reset the peak resident set size" (man 5 proc)


def make_mlp(width: int, blocks: int):
    from torch import nn

    class MLP(nn.Module):
        """Equal blocks: each is one FSDP unit, and the root holds no parameters of its own."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(blocks))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    return MLP()


def build(mode: str, args: argparse.Namespace, group, rank: int):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(args.seed)
    if mode == "ddp":  # broadcasts rank 0's weights; allocates the buckets
        model = DDP(make_mlp(args.width, args.blocks), process_group=group)
    else:
        with torch.device("meta"):  # shapes only: no rank ever holds the whole model
            model = make_mlp(args.width, args.blocks)
        mesh = DeviceMesh.from_group(group, "cpu")  # explicit cpu: the default is cuda where a GPU is visible
        reshard = mode == "fsdp"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        model.to_empty(device="cpu")  # allocates this rank's shards, uninitialised
        g = torch.Generator().manual_seed(args.seed + rank)
        bound = args.width ** -0.5  # nn.Linear's default range
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().uniform_(-bound, bound, generator=g)
    dist.barrier(group=group)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def local(t) -> int:
    """Bytes this rank holds of a tensor: its shard for a DTensor."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(mode: str, args: argparse.Namespace, group, world: int, rank: int) -> dict:
    """Build and train one mode on the `world` ranks of `group`; what this rank used and held."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    dist.barrier(group=group)
    release_and_reset_peak()
    before = status_kb("VmRSS") * 1024
    model, opt = build(mode, args, group, rank)
    g = torch.Generator().manual_seed(args.seed + 1000 + rank)
    x, target = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    times, state = [], {}
    for step in range(args.steps):
        start = time.perf_counter()
        F.mse_loss(model(x), target).backward()  # ddp: all-reduce of the buckets; fsdp: all-gathers, reduce-scatters
        opt.step()
        if step == args.steps - 1:  # before zero_grad frees the gradients
            params = list(model.parameters())
            state = {"params": sum(local(p) for p in params), "grads": sum(local(p.grad) for p in params),
                     "optimizer": sum(local(opt.state[p]["momentum_buffer"]) for p in params)}
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    dist.barrier(group=group)
    peak = status_kb("VmHWM") * 1024
    del model, opt, x, target
    return {"mode": mode, "world_size": world, "rank": rank, "rss_before_bytes": before, "peak_rss_bytes": peak,
            "state_bytes": sum(state.values()), "state": state,
            "step_s": statistics.median(times[1:] or times)}  # the first step also allocates momentum


def worker(args: argparse.Namespace) -> None:
    """One rank of the job: every (W, mode) in turn, on ranks 0..W-1, while the other ranks wait."""
    import torch
    import torch.distributed as dist

    with contextlib.suppress(OSError, AttributeError):  # if torchrun's agent dies (killed), die with it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    from datetime import timedelta
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    # A group per W, made now (every rank takes part in making each), so their memory is in every baseline.
    groups = {w: dist.new_group(list(range(w))) for w in args.worlds}
    # Warm-up with a tiny model: what each mode loads on first use (DDP imports torch._dynamo: ~3 s; DTensor,
    # FSDP) then counts in every baseline alike, not in whichever mode runs first. Largest W first, so that
    # every rank loads it at once, not one W after the other.
    for w in sorted(args.worlds, reverse=True):
        if rank < w:
            tiny = argparse.Namespace(**{**vars(args), "width": 8 * w, "blocks": 2, "batch": 2, "steps": 1})
            for mode in args.modes:
                measure(mode, tiny, groups[w], w, rank)
        dist.barrier()
    results = []
    for w in args.worlds:
        for mode in args.modes:
            mine = measure(mode, args, groups[w], w, rank) if rank < w else None
            everyone: list[dict | None] = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)  # the ranks beyond w wait here
            measured = [r for r in everyone if r is not None]
            results += measured
            if rank == 0:
                peak = max(r["peak_rss_bytes"] for r in measured)
                model = max(r["peak_rss_bytes"] - r["rss_before_bytes"] for r in measured)
                state = max(r["state_bytes"] for r in measured)
                print(f"W={w} {mode:<15} peak RSS {mb(peak):>7} MB/rank (model's part {mb(model):>6} MB), model "
                      f"state {mb(state):>6} MB/rank, {max(r['step_s'] for r in measured):.2f} s/step", flush=True)
    if rank == 0:
        Path(args.worker).write_text(json.dumps({"torch": torch.__version__, "rows": results}))
    dist.barrier()
    dist.destroy_process_group()
    exit_worker()


# --- the launcher ---------------------------------------------------------------------------------

def mb(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def launch(args: argparse.Namespace, argv: list[str], result: Path) -> dict:
    """One torchrun job of max(W) ranks, in its own session; at --timeout it is stopped (SIGTERM, then SIGKILL)."""
    world = max(args.worlds)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).resolve()), *argv, "--worker", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 5)):  # torchrun passes SIGTERM to its workers
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=wait)
                break
        raise SystemExit(f"fsdp_memory: the torchrun job took longer than --timeout {args.timeout:g}s; "
                         f"stopped") from None
    if code != 0 or not result.exists():
        raise SystemExit(f"fsdp_memory: the torchrun job failed (exit status {code}); its output is above")
    return json.loads(result.read_text())


def theory(row: dict, args: argparse.Namespace) -> None:
    """Fill in the sizes and the theory of one row (bytes, float32)."""
    unit = (args.width * args.width + args.width) * 4
    p, w = unit * args.blocks, row["world_size"]
    state = 3 * p if row["mode"] == "ddp" else 3 * p // w  # exact: --width is a multiple of every W
    peak = {"ddp": 4 * p,  # at the end of the backward: params, grads, momentum, buckets
            "fsdp": 3 * p // w + unit,  # at the end of the backward: the shards, the first block gathered
            # at the start of the backward: params and momentum shards, every block gathered, no grads yet
            "fsdp_no_reshard": max(2 * p // w + p, 3 * p // w + unit)}[row["mode"]]
    row.update(params=p // 4, blocks=args.blocks, width=args.width, batch=args.batch, steps=args.steps,
               param_bytes=p, unit_bytes=unit, model_rss_bytes=row["peak_rss_bytes"] - row["rss_before_bytes"],
               theory_state_bytes=state, state_vs_theory=row["state_bytes"] / state,
               theory_peak_bytes=peak)


def summarise(rows: list[dict]) -> list[dict]:
    """One line per (mode, W): the largest value over the ranks (the rank that would run out first)."""
    out = []
    for key in dict.fromkeys((r["mode"], r["world_size"]) for r in rows):
        group = [r for r in rows if (r["mode"], r["world_size"]) == key]
        out.append({"mode": key[0], "world_size": key[1], "ranks": len(group),
                    **{c: max(r[c] for r in group) for c in ("rss_before_bytes", "peak_rss_bytes", "model_rss_bytes",
                                                             "state_bytes", "step_s")},
                    "theory_state_bytes": group[0]["theory_state_bytes"],
                    "theory_peak_bytes": group[0]["theory_peak_bytes"],
                    "state_vs_theory": max((r["state_vs_theory"] for r in group), key=lambda v: abs(v - 1))})
    return out


def print_table(lines: list[dict]) -> None:
    header = ["mode", "W", "RSS before", "peak RSS", "model part", "theory", "excess", "state", "theory",
              "state/theory", "s/step"]
    table = [[r["mode"], str(r["world_size"]), mb(r["rss_before_bytes"]), mb(r["peak_rss_bytes"]),
              mb(r["model_rss_bytes"]), mb(r["theory_peak_bytes"]),
              f"{(r['model_rss_bytes'] - r['theory_peak_bytes']) / 2**20:+,.0f}", mb(r["state_bytes"]),
              mb(r["theory_state_bytes"]), f"{r['state_vs_theory']:.4f}", f"{r['step_s']:.2f}"] for r in lines]
    widths = [max(len(row[i]) for row in [header, *table]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *table]:
        print("  ".join(c.ljust(w) if i < 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))


def plot(lines: list[dict], args: argparse.Namespace, torch_version: str, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.8))
    names = {"ddp": "DDP", "fsdp": "FSDP2", "fsdp_no_reshard": "FSDP2, reshard_after_forward=False"}
    for i, mode in enumerate(m for m in MODES if any(r["mode"] == m for r in lines)):
        pts = sorted((r["world_size"], r) for r in lines if r["mode"] == mode)
        ws = [w for w, _ in pts]
        left.plot(ws, [r["peak_rss_bytes"] / 2**20 for _, r in pts], "-o", color=f"C{i}",
                  label=f"{names[mode]}: measured")
        left.plot(ws, [(r["rss_before_bytes"] + r["theory_peak_bytes"]) / 2**20 for _, r in pts], ":",
                  color=f"C{i}", label="RSS before the model + theory: " + THEORY[mode])
        right.plot(ws, [r["state_bytes"] / 2**20 for _, r in pts], "o", color=f"C{i}", markersize=8 - 2 * i,
                   label=f"{names[mode]}: measured")
        right.plot(ws, [r["theory_state_bytes"] / 2**20 for _, r in pts], "-", color=f"C{i}", linewidth=1,
                   label="theory: " + ("3P" if mode == "ddp" else "3P/W"))
    worlds = sorted({r["world_size"] for r in lines})
    p = args.width * (args.width + 1) * args.blocks
    base = statistics.mean(r["rss_before_bytes"] for r in lines) / 2**20
    left.axhline(base, color="grey", linewidth=1, linestyle="--",
                 label=f"RSS before the model is built: torch, gloo, Python ({base:.0f} MB)")
    left.set(xlabel="ranks W", ylabel="MB per rank (largest over the ranks)", xticks=worlds, ylim=(0, None),
             title="peak RSS per rank")
    right.set(xlabel="ranks W", ylabel="MB per rank (largest over the ranks)", xticks=worlds, ylim=(0, None),
              title="model state per rank: parameters + gradients + momentum")
    left.legend(fontsize=7, loc="lower right")  # clear of the curves, which start high at W = 1
    right.legend(fontsize=7)
    fig.suptitle(f"MLP of {args.blocks} blocks of {args.width}x{args.width}: {p / 1e6:.1f} M parameters, P = "
                 f"{p * 4 / 2**20:,.0f} MB, one block U = {p * 4 / args.blocks / 2**20:,.1f} MB (float32); gloo/CPU, "
                 f"{args.steps} SGD-momentum steps, torch {torch_version}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)




def available_bytes() -> int | None:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            return int(next(line for line in f if line.startswith("MemAvailable:")).split()[1]) * 1024
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(prog="benchmarks/fsdp_memory.py", description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=list_of(int), default=[1, 2, 4], help="numbers of ranks (one job of the largest)")
    p.add_argument("--modes", type=list_of(str, MODES), default=list(MODES))
    p.add_argument("--width", type=positive(int), default=2048, help="width of every block (a multiple of each W)")
    p.add_argument("--blocks", type=positive(int), default=24, help="equal Linear blocks (24 x 2048: 101 M params)")
    p.add_argument("--batch", type=positive(int), default=16, help="samples per rank per step")
    p.add_argument("--steps", type=positive(int), default=3, help="SGD-momentum steps per mode (the peak is reached "
                                                                   "from the second on)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/fsdp_memory"), help="where to write the CSV and PNG")
    p.add_argument("--timeout", type=positive(float), default=300.0,
                   help="seconds one torchrun job may take (and a collective may wait)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # set by the launcher: this process is a rank
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
    if bad := [w for w in args.worlds if args.width % w]:
        p.error(f"argument --width: must be a multiple of every --worlds value, so that each rank holds exactly 1/W "
                f"of every layer; {args.width} is not a multiple of {bad[0]}")
    params = args.width * (args.width + 1) * args.blocks
    need = max(args.worlds) * (4 * params * 4 + RSS_PER_PROCESS)  # at most 4P per rank (DDP's peak), W ranks
    if (free := available_bytes()) is not None and need > 0.8 * free:
        p.error(f"argument --width/--blocks: {params / 1e6:.0f} M parameters need ~{need / 2**30:.1f} GiB at "
                f"W={max(args.worlds)}, more than 80% of the {free / 2**30:.1f} GiB available; make the model "
                f"smaller")
    p.check_out_writable(args.out)  # fail now, not after measuring

    cores = os.cpu_count() or 1
    print(f"FSDP memory: MLP of {args.blocks} blocks of {args.width}x{args.width} ({params / 1e6:.1f} M parameters, "
          f"P = {mb(params * 4)} MB float32, one block U = {mb(params * 4 / args.blocks)} MB); W = "
          f"{', '.join(map(str, args.worlds))} on {cores} CPU cores, in one torchrun job of {max(args.worlds)} (gloo, "
          f"OMP_NUM_THREADS=1); {args.steps} SGD-momentum steps of batch {args.batch} per mode", flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fsdp_memory-") as tmp:
        got = launch(args, argv, Path(tmp) / "result.json")
    print(f"(torchrun job: {time.monotonic() - start:.0f}s)", flush=True)
    rows = got["rows"]
    for r in rows:
        theory(r, args)
    rows.sort(key=lambda r: (MODES.index(r["mode"]), r["world_size"], r["rank"]))
    lines = summarise(rows)

    print()
    print_table(lines)
    print("MB per rank, the largest over the ranks. model part = peak RSS - RSS before the model was built; its "
          "theory: ddp 4P (with the buckets), fsdp 3P/W + U, fsdp_no_reshard max(2P/W + P, 3P/W + U); excess = "
          "model part - theory. state = parameters + gradients + momentum this rank holds; theory DDP 3P, FSDP 3P/W.")
    write_csv(args.out / "fsdp_memory.csv", rows, COLUMNS)
    plot(lines, args, got["torch"], args.out / "fsdp_memory.png")
    print(f"\nwrote {args.out / 'fsdp_memory.csv'} and {args.out / 'fsdp_memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
