"""The planner against this machine: what it needs to know about the machine, measured, and its prediction of the
tokens/s that stage 13's GPT trains at here, in eight layouts, beside the tokens/s measured.

    python at_scale/this_machine.py            # the table, from the committed measurements (this_machine.json, .csv)
    python at_scale/this_machine.py --measure  # measure again (~10 minutes on 2 quiet cores), write both files

What is measured, each by itself, in rounds, the layouts taking turns (a slow minute of a shared machine then slows
every layout alike), and each measurement again if other processes took more than QUIET of a core meanwhile:

- gloo's collectives between two processes here (all-reduce, all-gather, reduce-scatter, a send both ways), 4 KiB
  to 4 MiB, each called back to back and after 2, 8 and 32 ms of matmuls on both ranks: the seconds a call costs
  before its bytes and the bytes a rank sends per second (back to back: a weighted least-squares line through the
  sizes), and what a call costs more per second of compute before it (the ranks finish apart; the one that waits
  wakes slowly);
- the matmul rate, at the shapes the model multiplies (its linear layers' forward and backward at 16 windows of 64)
  and at train.py's 512 x 512, one process alone and one of two at once;
- each layout's compute: every rank of the layout, all at once as they share the cores in training, runs stage 13's
  own step (load_train_objs, Trainer._run_step: the model, DDP or FSDP2, tp, the pipeline, the ring) on torch's fake
  process group, which moves nothing: the step without its communication. Real tensors, unlike simulate.py's;
  simulate.py's shims where the fake group cannot carry a piece (DDP's hook, the pipeline's shapes);
- the tokens/s each layout trains at: stage 13's train.py launched as a reader launches it (python, or torchrun
  --standalone), the median of its log intervals after the first, as benchmarks/gpt_scaling.py takes them.

The prediction is plan.predict's, with what it knows of a GPU replaced by what was measured here: each pipeline stage's
compute (the slowest rank's), every collective costs.py counts at gloo's measured cost, nothing hidden (on two busy
cores gloo's copies and sums run on the cores that compute: ddp_by_hand/README.md, "On two cores, hidden is not free"),
and the pipeline's bubble. Nothing is fitted to the tokens/s it is compared with: the compute is a one-process
measurement without communication, the rest is gloo's. Beside it, two other predictions: with gloo's calls as timed
back to back only, and the planner as it predicts a GPU (the FLOPs at the matmul rate: a ceiling).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from datetime import date
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "at_scale"
sys.path.insert(0, str(ROOT))  # the repository root: tools/ and tour.py
sys.path.insert(0, str(HERE))
import costs  # noqa: E402
import hardware  # noqa: E402
import plan  # noqa: E402
from costs import Layout  # noqa: E402

from tools.cli import ArgumentParser, free_port, gloo_group, positive, print_table, read_csv, summary, write_csv  # noqa: E402

STAGE = ROOT / "13_pipeline_4d" / "train.py"
CORPUS = ROOT / "11_gpt" / "data" / "input.txt"
CHARACTERS = 250_000  # as benchmarks/gpt_scaling.py: the corpus's first 250,000 characters (62 distinct)
VOCAB = 62
MODEL = costs.tutorial_gpt(layers=4, width=128, heads=4, context=64, vocab=VOCAB)  # the stages' default GPT
MACHINE, RUNS = HERE / "this_machine.json", HERE / "this_machine_runs.csv"
QUIET = 0.15  # of a core: a measurement during which other processes took more is made again (up to TRIES times)
TRIES = 4
GLOO_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "send")
GLOO_SIZES = [4 << 10, 128 << 10, 1 << 20, 4 << 20]
BURSTS = [0.0, 0.002, 0.008, 0.032]  # seconds of compute before a collective
# The layouts, 16 windows of 64 characters a step per dp rank (weak scaling, as gpt_scaling.py; the pipeline's as 4
# micro-batches of 4). World: dp x tp x pp x cp processes.
LAYOUTS: dict[str, Layout] = {
    "one process": Layout(micro_batch=16),
    "DDP, dp 2": Layout(dp=2, micro_batch=16),
    "FSDP2, dp 2": Layout(dp=2, parallel="fsdp", micro_batch=16),
    "FSDP2, dp 2, 2 micro-batches": Layout(dp=2, parallel="fsdp", micro_batch=8, accumulate=2),
    "FSDP2 + tp 2": Layout(tp=2, parallel="fsdp", micro_batch=16),
    "cp 2 (ring), DDP": Layout(cp=2, micro_batch=16),
    "pp 2, 1F1B, 4 micro-batches": Layout(pp=2, parallel="fsdp", micro_batch=4, accumulate=4),
    "pp 2, GPipe, 4 micro-batches": Layout(pp=2, parallel="fsdp", micro_batch=4, accumulate=4, schedule="gpipe"),
}
COLUMNS = ["layout", "processes", "tokens_per_step", "tokens_per_s", "rounds", "others_cores", "command"]


def layout_flags(lay: Layout) -> list[str]:
    """Stage 13's flags for a layout (its dp: the processes over tp x pp x cp)."""
    return ["--parallel", lay.parallel, "--tp", str(lay.tp), "--pp", str(lay.pp), "--cp", str(lay.cp),
            "--pp-schedule", lay.schedule, "--batch-size", str(lay.micro_batch), "--accumulate", str(lay.accumulate)]


# ─── A shared machine: what other processes take meanwhile ─────────────────────────────────────────────────────────

def cpu_seconds() -> tuple[float, float]:
    """(core-seconds the machine has been busy since it started, core-seconds this process and its finished children
    have used): /proc/stat, getrusage. Their difference over an interval is what other processes took."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return busy / os.sysconf("SC_CLK_TCK"), sum(u.ru_utime + u.ru_stime for u in used)


@contextlib.contextmanager
def others() -> Iterator[dict]:
    """{"cores": ...}: the cores other processes took, on average, during the block."""
    seen: dict = {}
    (busy, ours), start = cpu_seconds(), time.monotonic()
    yield seen
    (busy2, ours2), wall = cpu_seconds(), time.monotonic() - start
    seen["cores"] = max(0.0, (busy2 - busy) - (ours2 - ours)) / wall


def quietly(measure, what: str):
    """measure(), after a quiet second, again until other processes took at most QUIET of a core during it (TRIES at
    most; the last kept): (its result, the cores others took)."""
    for attempt in range(TRIES):
        for _ in range(120):  # first a quiet second (two minutes at most)
            with others() as before:
                time.sleep(1.0)
            if before["cores"] <= QUIET:
                break
        with others() as seen:
            result = measure()
        if seen["cores"] <= QUIET:
            break
        print(f"  {what}: other processes took {seen['cores']:.2f} cores meanwhile"
              + ("; again" if attempt < TRIES - 1 else "; kept"), flush=True)
        time.sleep(2.0 * (attempt + 1))
    return result, seen["cores"]


# ─── gloo, per kind of collective ───────────────────────────────────────────────────────────────────────────────────

def gloo_worker(rank: int, world: int, port: int, repeats: int, queue) -> None:
    """Each kind of collective and size, called as training calls them: after a burst of compute (a matmul loop of
    BURSTS seconds on every rank; 0: back to back, as collectives/benchmark.py times them). A call's cost is what it
    adds to a step: the time from calling it to its return, averaged over the ranks (the rank that arrives first waits
    for the other), the median over `repeats` calls."""
    import torch
    import torch.distributed as dist

    def exchange(x: torch.Tensor, y: torch.Tensor) -> None:  # a ring's hop: send to the next, receive from the last
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, y, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    warnings.filterwarnings("ignore", category=FutureWarning)  # (torch 2.13 renames the two tensor collectives)
    with gloo_group(rank, world, port, timeout=60.0):
        a, b = torch.randn(128, 128), torch.randn(128, 128)
        for _ in range(100):
            a @ b
        start = time.perf_counter()
        for _ in range(2000):
            a @ b
        matmul = (time.perf_counter() - start) / 2000
        rows = []
        for size in GLOO_SIZES:
            x, y = torch.randn(size // 4), torch.empty(size // 4)
            share, piece = torch.empty(size // 4 // world), x[:size // 4 // world].clone()
            calls = {"all_reduce": partial(dist.all_reduce, x),
                     "all_gather": partial(dist.all_gather_into_tensor, x, piece),
                     "reduce_scatter": partial(dist.reduce_scatter_tensor, share, x), "send": partial(exchange, x, y)}
            for burst in BURSTS:
                took: dict[str, list[float]] = {kind: [] for kind in calls}
                dist.barrier()
                for i in range(2 + repeats):  # the kinds in turns; 2 rounds of warm-up
                    for kind, call in calls.items():
                        for _ in range(round(burst / matmul)):
                            a @ b
                        start = time.perf_counter()
                        call()
                        if i >= 2:
                            took[kind].append(time.perf_counter() - start)
                for kind, mine in took.items():
                    every = [torch.zeros(repeats, dtype=torch.float64) for _ in range(world)]
                    dist.all_gather(every, torch.tensor(mine, dtype=torch.float64))
                    # bytes sent by a rank, as costs.py counts them: an all-gather of `size` bytes in all, a
                    # reduce-scatter and an all-reduce of a tensor of `size` bytes, a send of `size`
                    tensor = size // world if kind == "all_gather" else size
                    sent = tensor * (costs.ring(kind, world) if kind != "send" else 1)
                    rows.append({"kind": kind, "bytes": size, "sent_bytes": sent, "burst_s": burst,
                                 "seconds": torch.stack(every).mean(0).median().item()})
        if rank == 0:
            queue.put(rows)
    sys.stdout.flush()
    os._exit(0)  # (no interpreter teardown: it can abort gloo's threads; tools.cli.exit_worker)


def measure_gloo(repeats: int) -> list[dict]:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(gloo_worker, args=(2, free_port(), repeats, queue), nprocs=2, start_method="spawn")
    return queue.get()


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of the line t = a + b x closest to the points in relative terms (each weighted 1 / t^2): the latency a
    call costs and the seconds per byte, from sizes a thousand times apart."""
    w = [1 / t ** 2 for _, t in points]
    sw = sum(w)
    sx, sy = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)), sum(wi * t for wi, (_, t) in
                                                                            zip(w, points, strict=True))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points, strict=True))
    sxy = sum(wi * x * t for wi, (x, t) in zip(w, points, strict=True))
    b = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    return (sy - b * sx) / sw, b


def gloo_links(rows: list[dict]) -> plan.Links:
    """plan.Links from the timed calls: per kind, the latency and the bytes sent per second (the calls back to back);
    then what a call costs more per second of compute before it (one figure, the least-squares slope of every
    call's excess over its kind's line against its burst); nothing hidden."""
    latency, bandwidth = {}, {}
    for kind in GLOO_KINDS:
        a, b = fit_line([(r["sent_bytes"], r["seconds"]) for r in rows if r["kind"] == kind and r["burst_s"] == 0])
        latency[kind], bandwidth[kind] = a, 1 / b
    excess = [(r["burst_s"], r["seconds"] - latency[r["kind"]] - r["sent_bytes"] / bandwidth[r["kind"]])
              for r in rows]
    after = sum(t * e for t, e in excess) / sum(t * t for t, _ in excess)
    return plan.Links(latency, bandwidth, {k: 0.0 for k in hardware.OVERLAP}, after)


# ─── The matmul rate ────────────────────────────────────────────────────────────────────────────────────────────────

def model_matmuls(tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every matmul of one forward and backward of the model's linear layers at `tokens` rows: per
    layer y = x W^T (tokens x in x out), and backward dx = dy W (tokens x out x in), dW = dy^T x (out x tokens x in)."""
    w, f, v = MODEL.width, MODEL.ffn, MODEL.vocab
    layers = [(w, w)] * 4 + [(w, f), (f, w)]  # q, k, v, proj; the MLP
    shapes = [(i, o) for i, o in layers] * MODEL.layers + [(w, v)]  # and the head
    return [s for i, o in shapes for s in ((tokens, i, o), (tokens, o, i), (o, tokens, i))]


def matmul_rate(shapes: list[tuple[int, int, int]], seconds: float = 1.0) -> float:
    """FLOP/s of the shapes' matmuls run one after another, one thread, as many rounds as fit (the best of 3)."""
    import torch
    torch.set_num_threads(1)
    pairs = [(torch.randn(m, k), torch.randn(k, n)) for m, k, n in shapes]
    flops = sum(2 * m * k * n for m, k, n in shapes)
    for a, b in pairs:
        a @ b  # once first: the first call allocates and picks its kernel
    best = 0.0
    for _ in range(3):
        start, rounds = time.perf_counter(), 0
        while time.perf_counter() - start < seconds / 3:
            for a, b in pairs:
                a @ b
            rounds += 1
        best = max(best, rounds * flops / (time.perf_counter() - start))
    return best


def measure_matmul() -> dict:
    """The rate of the model's own matmuls and of train.py's 512 x 512, one process alone and each of two at once."""
    out = {}
    for name, shapes in (("model", model_matmuls(16 * MODEL.context)), ("512", [(512, 512, 512)])):
        out[f"{name}_alone"] = matmul_rate(shapes)
        both = [subprocess.Popen([sys.executable, __file__, "--matmul", name], stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
        out[f"{name}_two_at_once"] = min(float(p.communicate()[0]) for p in both)
    return out


# ─── Each layout's compute: its ranks on the fake process group ────────────────────────────────────────────────────

def compute_rank(name: str, rank: int, steps: int) -> list[float]:
    """Seconds of each of `steps` training steps (after 3 unmeasured) of rank `rank` of layout `name`: stage 13's own
    step on torch's fake process group (every collective returns at once, moving nothing), on real tensors."""
    from unittest import mock

    import simulate
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore  # (importing it makes the "fake" backend)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake group fills no received tensor: what they hold must not slow the step
    lay = LAYOUTS[name]
    sim = simulate.parse_args([
        "--layers", str(MODEL.layers), "--width", str(MODEL.width), "--heads", str(MODEL.heads), "--context",
        str(MODEL.context), "--vocab", str(VOCAB), "--world", str(lay.world), "--tp", str(lay.tp), "--pp",
        str(lay.pp), "--cp", str(lay.cp), "--pp-schedule", lay.schedule, "--parallel", lay.parallel,
        "--micro-batch", str(lay.micro_batch), "--accumulate", str(lay.accumulate), "--rank", str(rank)])
    s, a = simulate.stage(sim.stage_name), sim.stage
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world)
    device = torch.device("cpu")
    grid = s.Grid({"pp": lay.pp, "dp": lay.dp, "cp": lay.cp, "tp": lay.tp}, device, a.timeout)
    cp = s.ContextParallel(grid.group("cp"), a.cp_impl, zigzag=not a.no_zigzag)
    pipe = s.Pipeline(grid.group("pp"), a.width, s.DTYPES[a.dtype])
    # simulate.py's shims that real tensors still need (simulate.ASSUMED: ddp_verify, pp_shapes)
    shims = [mock.patch("torch.nn.parallel.distributed._verify_param_shape_across_processes", lambda *x, **k: None),
             mock.patch.object(PipelineStage, "_recv_meta", simulate.neighbour_sends(
                 lay.micro_batch, MODEL.context // lay.cp, MODEL.width, torch.float32)),
             mock.patch.object(PipelineStage, "_send_meta", lambda *x, **k: None)]
    with contextlib.ExitStack() as stack:
        for shim in shims:
            stack.enter_context(shim)
        corpus = s.load_corpus(a.data)
        cfg, model, optimizer = s.load_train_objs(a, corpus, device, grid, cp, pipe)
        if isinstance(model, DDP):  # (simulate.ASSUMED: ddp_hook, ddp_buckets)
            model.register_comm_hook(grid.group("dp_cp"), simulate.all_reduce_hook)
            model.reducer = simulate.KeptBuckets(model.reducer)
        trainer = s.Trainer(model, optimizer, corpus, cfg, a, grid, cp, pipe, device, None)
        seconds = []
        for step in range(3 + steps):
            start = time.perf_counter()
            trainer._run_step()
            trainer.steps += 1
            if step >= 3:
                seconds.append(time.perf_counter() - start)
    return seconds


def measure_compute(name: str, steps: int) -> list[float]:
    """Each rank's median step (seconds) of layout `name` on the fake group, its ranks run at once."""
    lay = LAYOUTS[name]
    procs = [subprocess.Popen([sys.executable, __file__, "--compute", name, "--rank", str(r), "--steps", str(steps)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}) for r in range(lay.world)]
    out = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{name}: the fake-group step failed:\n" + "\n".join(err[-3000:] for _, err in out))
    return [statistics.median(json.loads(o.strip().splitlines()[-1])) for o, _ in out]


# ─── Each layout trained: tokens/s ─────────────────────────────────────────────────────────────────────────────────

def run_command(lay: Layout, data: Path, steps: int) -> list[str]:
    from tour import TORCHRUN
    launcher = [sys.executable] if lay.world == 1 else [*TORCHRUN, "--standalone", f"--nproc_per_node={lay.world}"]
    return [*launcher, str(STAGE), *layout_flags(lay), "--max-steps", str(steps), "--eval-every", str(steps // 4),
            "--sample", "0", "--device", "cpu", "--data", str(data)]


def measure_run(name: str, data: Path, steps: int, out: Path) -> float:
    """tokens/s of the layout trained by stage 13's train.py: the median of its log intervals after the first."""
    from tour import run_job
    out.mkdir(parents=True, exist_ok=True)
    run = run_job([[*run_command(LAYOUTS[name], data, steps), "--out", str(out)]], out, {"OMP_NUM_THREADS": "1"},
                  timeout=300.0)
    if run.returncode != 0 or run.survivors:
        raise SystemExit(f"{name} failed:\n{run.describe()}")
    return statistics.median(c[3] for c in run.summary["curve"][1:])


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def measure(args: argparse.Namespace) -> None:
    """Everything, in rounds; writes this_machine.json (the machine) and this_machine_runs.csv (the runs)."""
    import torch
    scratch = Path(tempfile.mkdtemp(prefix="this_machine_"))  # the runs' own files, not kept
    data = scratch / "input_250k.txt"
    data.write_text(CORPUS.read_text(encoding="utf-8")[:CHARACTERS], encoding="utf-8")
    print(f"this machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}", flush=True)
    matmul, matmul_others = quietly(measure_matmul, "matmul")
    compute: dict[str, list] = {n: [] for n in LAYOUTS}
    tokens: dict[str, list] = {n: [] for n in LAYOUTS}
    seen: dict[str, list] = {n: [] for n in LAYOUTS}
    gloo_rounds, gloo_others = [], []
    for r in range(args.rounds):
        rows, c = quietly(lambda: measure_gloo(args.repeats), "gloo")
        gloo_rounds.append(rows)
        gloo_others.append(c)
        links = gloo_links(rows)
        print(f"round {r + 1}/{args.rounds} | gloo: " + " | ".join(
            f"{k} {links.latency_s[k] * 1e6:,.0f} us, {links.bytes_per_s[k] / 1e9:.2f} GB/s" for k in GLOO_KINDS)
            + f" | {links.after_compute:.3f} s a second of compute before", flush=True)
        for name in LAYOUTS:
            ranks, c = quietly(partial(measure_compute, name, args.steps), f"{name}, compute")
            speed, t = quietly(partial(measure_run, name, data, args.steps * 2, scratch / name.replace(" ", "_")
                                       .replace(",", "")), f"{name}, run")
            compute[name].append(ranks)
            tokens[name].append(speed)
            seen[name] += [c, t]
            print(f"round {r + 1}/{args.rounds} | {name}: compute {' '.join(f'{x * 1e3:.1f}' for x in ranks)} ms a "
                  f"step | trained at {speed:,.0f} tokens/s", flush=True)
    machine = {
        "command": "python at_scale/this_machine.py --measure" + (f" --rounds {args.rounds}" if args.rounds != 3
                                                                  else ""),
        "date": date.today().isoformat(), "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "model": {k: getattr(MODEL, k) for k in ("layers", "width", "heads", "context", "vocab")},
        # each kind, size and burst: the median over the rounds
        "gloo": [{**row, "seconds": statistics.median(g[i]["seconds"] for g in gloo_rounds)}
                 for i, row in enumerate(gloo_rounds[0])],
        "matmul_flops": matmul,
        # per layout, per rank: the median over the rounds of each round's median step on the fake group
        "compute_seconds": {n: [statistics.median(r[i] for r in compute[n]) for i in range(LAYOUTS[n].world)]
                            for n in LAYOUTS},
        "compute_rounds": compute,
        "others_cores": {"gloo": max(gloo_others), "matmul": matmul_others},
    }
    (args.out / MACHINE.name).write_text(json.dumps(machine, indent=1) + "\n")
    rows = [{"layout": n, "processes": LAYOUTS[n].world, "tokens_per_step": tokens_per_step(LAYOUTS[n]),
             "tokens_per_s": statistics.median(tokens[n]), "rounds": " ".join(f"{v:.0f}" for v in tokens[n]),
             "others_cores": max(seen[n]),
             "command": " ".join(run_command(LAYOUTS[n], Path("input_250k.txt"), args.steps * 2))
             .replace(sys.executable, "python").replace(str(ROOT) + "/", "")} for n in LAYOUTS]
    write_csv(args.out / RUNS.name, rows, COLUMNS)
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {args.out / MACHINE.name} and {args.out / RUNS.name}")


def tokens_per_step(lay: Layout) -> int:
    return lay.dp * lay.micro_batch * lay.accumulate * MODEL.context


# ─── The prediction ─────────────────────────────────────────────────────────────────────────────────────────────────

def this_gpu(machine: dict) -> hardware.GPU:
    """This machine as the planner's GPU record: a core is a 'GPU', the cores one node; its matmul rate the model's
    own matmuls' (two processes at once); its links gloo's all-reduce."""
    links = gloo_links(machine["gloo"])
    rate = machine["matmul_flops"]
    src = f"at_scale/this_machine.json ({machine['command']}, {machine['date']})"
    return hardware.GPU(f"{machine['cpu']} core", rate["512_alone"], 0, links.bytes_per_s["all_reduce"],
                        links.bytes_per_s["all_reduce"], machine["cores"], rate["model_two_at_once"],
                        {f: src for f in hardware.FIGURES})


def predictions(machine: dict, runs: list[dict]) -> list[dict]:
    """Each layout: measured tokens/s, the planner's with the measured compute, and the planner's as on a GPU."""
    gpu, links = this_gpu(machine), gloo_links(machine["gloo"])
    measured = {r["layout"]: float(r["tokens_per_s"]) for r in runs}
    out = []
    for name, lay in LAYOUTS.items():
        ranks = machine["compute_seconds"][name]
        # the ranks of pipeline stage s: the grid orders them pp, dp, cp, tp (tp fastest)
        per_stage = lay.world // lay.pp
        stages = [max(ranks[s * per_stage:(s + 1) * per_stage]) for s in range(lay.pp)]
        p = plan.predict(MODEL, lay, gpu, links, compute_s=stages)
        back_to_back = plan.predict(MODEL, lay, gpu, dataclasses.replace(links, after_compute=0.0), compute_s=stages)
        ceiling = plan.predict(MODEL, lay, gpu, links)
        out.append({"layout": name, "measured": measured[name], "predicted": p.tokens_per_s,
                    "error": p.tokens_per_s / measured[name] - 1, "seconds": p.seconds,
                    "back_to_back": back_to_back.tokens_per_s, "ceiling": ceiling.tokens_per_s})
    return out


def cells(p: dict) -> list[str]:
    """A layout's row: the tokens/s measured and predicted, the predicted step's parts (ms), and the two other
    predictions (gloo's calls as timed back to back; the FLOPs at the matmul rate)."""
    def ms(*keys: str) -> str:
        return f"{sum(p['seconds'][k] for k in keys) * 1e3:.1f}"
    return [p["layout"], f"{p['measured']:,.0f}", f"{p['predicted']:,.0f} ({p['error']:+.0%})", ms("compute"),
            ms("tp", "cp", "ep", "pp", "dp"), ms("bubble"),
            f"{p['back_to_back']:,.0f} ({p['back_to_back'] / p['measured'] - 1:+.0%})",
            f"{p['ceiling']:,.0f} ({p['ceiling'] / p['measured'] - 1:+.0%})"]


HEADER = ["layout", "measured tokens/s", "predicted", "compute ms", "communication ms", "bubble ms",
          "gloo back to back", "FLOPs at the matmul rate"]


def told_apart(runs: list[dict]) -> list[tuple[str, str]]:
    """The pairs (faster, slower) of layouts the measurement tells apart: the faster's slowest round above the
    slower's fastest. Layouts whose rounds overlap have no order to check."""
    rounds = {r["layout"]: [float(v) for v in r["rounds"].split()] for r in runs}
    return [(a, b) for a in rounds for b in rounds if min(rounds[a]) > max(rounds[b])]


def misordered(preds: list[dict], runs: list[dict]) -> list[tuple[str, str]]:
    """The pairs told apart (told_apart) that the prediction puts the other way round."""
    predicted = {p["layout"]: p["predicted"] for p in preds}
    return [(a, b) for a, b in told_apart(runs) if predicted[a] <= predicted[b]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="at_scale/this_machine.py", description=summary(__doc__))
    p.add_argument("--measure", action="store_true", help="measure this machine and the runs again (~10 minutes)")
    p.add_argument("--rounds", type=positive(int), help="with --measure: rounds, the layouts in turns (default 3)")
    p.add_argument("--steps", type=positive(int),
                   help="with --measure: fake-group steps timed per rank (the runs train twice as many; default 20)")
    p.add_argument("--repeats", type=positive(int),
                   help="with --measure: timed calls per gloo kind, size and compute before it (default 20)")
    p.add_argument("--out", type=Path, default=HERE, help="where --measure writes (default at_scale/); the table "
                                                          "reads from there too")
    p.add_argument("--compute", choices=list(LAYOUTS), help=argparse.SUPPRESS)  # one rank's fake-group steps
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--matmul", choices=["model", "512"], help=argparse.SUPPRESS)  # one process's matmul rate
    args = p.parse_args(argv)
    table = not args.measure and args.compute is None and args.matmul is None  # the table from --out's files alone
    for flag in ("rounds", "steps", "repeats") if table else ():
        if getattr(args, flag) is not None:
            p.error(f"argument --{flag}: it sets how --measure measures, and this run reads the measurements; add "
                    f"--measure, or leave --{flag} out")
    args.rounds, args.steps, args.repeats = args.rounds or 3, args.steps or 20, args.repeats or 20
    if args.measure:
        p.check_out_writable(args.out)
    elif table:
        for needed in (MACHINE.name, RUNS.name):
            if not (args.out / needed).exists():
                p.error(f"argument --out: no {needed} in {args.out}; make one there with --measure")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compute is not None:
        print(json.dumps(compute_rank(args.compute, args.rank, args.steps)))
        return
    if args.matmul is not None:
        print(matmul_rate(model_matmuls(16 * MODEL.context) if args.matmul == "model" else [(512, 512, 512)]))
        return
    if args.measure:
        measure(args)
    machine = json.loads((args.out / MACHINE.name).read_text())
    runs = read_csv(args.out / RUNS.name)
    preds = predictions(machine, runs)
    links = gloo_links(machine["gloo"])
    print(f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, {machine['date']}: "
          f"{machine['command']}")
    print("gloo, 2 processes, a call: " + " | ".join(
        f"{k} {links.latency_s[k] * 1e6:,.0f} us + bytes at {links.bytes_per_s[k] / 1e9:.2f} GB/s" for k in GLOO_KINDS)
        + f"; and {links.after_compute * 1e3:.0f} ms more per second of compute before the call")
    rates = machine["matmul_flops"]
    busy = machine["others_cores"]["matmul"]
    print(f"matmul, one thread: the model's shapes {rates['model_alone'] / 1e9:.1f} GFLOP/s alone, "
          f"{rates['model_two_at_once'] / 1e9:.1f} two at once | 512 x 512 {rates['512_alone'] / 1e9:.1f} alone, "
          f"{rates['512_two_at_once'] / 1e9:.1f} two at once"
          + (f" (other processes took {busy:.2f} of a core meanwhile)" if busy > QUIET else ""))
    print_table([HEADER, *[cells(q) for q in preds]])
    worst = max(preds[1:], key=lambda q: abs(q["error"]))
    wrong = misordered(preds, runs)
    print(f"the largest error of the {len(preds) - 1} layouts of 2 processes: {worst['error']:+.0%} "
          f"({worst['layout']}) | of the {len(told_apart(runs))} pairs of layouts whose rounds do not overlap, "
          + (f"{len(wrong)} predicted the other way round: {wrong}" if wrong else "every one predicted in order"))


if __name__ == "__main__":
    main()
