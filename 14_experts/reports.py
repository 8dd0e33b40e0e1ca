"""The run's numbers and files, the same file in every GPT stage (tests/test_repo.py checks it): the whole state for
the tests' step-by-step comparisons, every rank's memory, the speed and the MFU, and the files of --out. Leave it out
of your own project, or keep what you want to measure: train.py calls it as `reports.`."""
from __future__ import annotations

import argparse
import json
import resource
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from checks import STAGE, schedule
from evaluate import clock
from model import DTYPES, GPT, Config
from pipeline import Pipeline, held_at_most

if TYPE_CHECKING:  # for the annotations only: train.py imports this file
    from train import Trainer


def state_at(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, pipe: Pipeline) -> dict:
    """Weights and AdamW's two moments after `step` steps, whole, on the CPU, by parameter name. DTensors (FSDP2's
    shards, tp's slices) are all-gathered, and the pipeline stages' parts exchanged: every rank calls this."""
    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()
    named = [(name.removeprefix("module."), p) for name, p in model.named_parameters()]
    moments = {key: {n: whole(optimizer.state[p][key]) for n, p in named if p in optimizer.state}
               for key in ("exp_avg", "exp_avg_sq")}
    state = {"params": {n: whole(p) for n, p in named}, **moments}
    if pipe.size > 1:
        parts: list[dict] = [{} for _ in range(pipe.size)]
        dist.all_gather_object(parts, state, group=pipe.group)
        state = {key: {n: t for part in parts for n, t in part[key].items()} for key in state}
    return {"step": step, **state}


def activations_held(schedule, args: argparse.Namespace, pipe: Pipeline) -> str:
    """The start-up line of the stage-sized activations a rank keeps for backward at most (pipeline.py's count)."""
    held, blocks = held_at_most(schedule, args.accumulate, pipe.size), args.layers / pipe.count
    return (f"pipeline: a rank holds at most {held} micro-batches' activations of a stage of {blocks:g} "
            f"block{'s' if blocks != 1 else ''} ({held * blocks:g} blocks' worth)")


def peak_memory(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> dict:
    """Every rank's peak memory, and the bytes of the training state it holds (its pieces of the weights, gradients
    and AdamW's moments: what DDP replicates and FSDP2 and tp split). On the CPU the peak is the process's largest
    resident set (getrusage's ru_maxrss), torch's own code and buffers included; on a GPU, the most that torch had
    allocated on it (torch.cuda.max_memory_allocated)."""
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    # A gradient is as large as its weight (and is freed between steps); each of AdamW's moments too.
    state = sum(2 * local(p) + sum(local(m) for m in optimizer.state[p].values() if m.dim())
                for p in model.parameters())
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    here = torch.tensor([peak, state], dtype=torch.float64, device=device)
    every = [torch.zeros_like(here) for _ in range(dist.get_world_size())]
    dist.all_gather(every, here)
    return {"how": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "ru_maxrss, the whole process",
            "peak": [int(m[0]) for m in every], "state": [int(m[1]) for m in every]}


# Dense peaks of a few GPUs in FLOP/s (bfloat16, float32 without TF32), from NVIDIA's data sheets: for the MFU.
PEAK_FLOPS = {"H100 PCIe": (756e12, 51e12), "H100": (989e12, 67e12), "H200": (989e12, 67e12),
              "A100": (312e12, 19.5e12), "L40S": (362e12, 91.6e12), "L4": (121e12, 30.3e12)}


def flops_per_token(cfg: Config) -> int:
    """Training FLOPs per token (forward and backward): 6 per weight of every matmul (PaLM's 6N; the embeddings are
    look-ups, not matmuls), plus the attention's scores and weighted sums, 12 x layers x context x width (PaLM,
    appendix B; the causal mask's skipped half counted, as there)."""
    # Each token goes through k MLPs (experts), and the router's width x E.
    per_block = (4 + 8 * cfg.top_k) * cfg.width ** 2 + cfg.width * cfg.experts
    matmul_weights = cfg.layers * per_block + cfg.width * cfg.vocab
    return 6 * matmul_weights + 12 * cfg.layers * cfg.context * cfg.width  # (q, k, v, proj: 4w^2; an MLP: 8w^2)


def machine_peak(device: torch.device, args: argparse.Namespace) -> dict:
    """The peak the MFU is of, for the world. On a GPU, its data sheet's (PEAK_FLOPS: bf16 with --amp bf16, else
    float32 without TF32), times the world size. On a CPU there is no data sheet to trust: every rank multiplies
    512 x 512 matrices at the weights' dtype and its thread count for 0.1 s, all ranks at once, as they shared the
    cores in training; the world's peak is the FLOPs of all of them over the time the slowest took (so that ranks
    sharing a core, W above the cores, count the core once), the best of 3 rounds. With --amp bf16 in bfloat16 too,
    and the faster of the two counts (a CPU without bf16 units multiplies bfloat16 far slower than float32; one
    with them, faster). Every rank calls this (collectives)."""
    world_size = dist.get_world_size()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = next((p for key, p in PEAK_FLOPS.items() if key in name), None)
        if peak is None:
            return {"flops": None, "how": f"the peak of a {name} is not in PEAK_FLOPS"}
        flops = peak[0] if args.amp == "bf16" else peak[1]
        return {"flops": world_size * flops, "how": f"{world_size} x {flops / 1e12:g} TFLOP/s ({name}, data sheet)"}
    n, measured = 512, {}
    for dtype in [DTYPES[args.dtype]] + ([torch.bfloat16] if args.amp == "bf16" else []):
        a, b = (torch.randn(n, n, dtype=dtype) for _ in range(2))
        a @ b  # once first: the first call allocates and picks its kernel
        rounds = []
        for _ in range(3):
            dist.barrier()  # start together
            start, count = clock(device), 0
            while clock(device) - start < 0.1:  # as many as fit
                a @ b
                count += 1
            done = torch.tensor([count * 2 * n ** 3, clock(device) - start], dtype=torch.float64)
            every = [torch.zeros_like(done) for _ in range(world_size)]
            dist.all_gather(every, done)  # the world's matmuls are done when the slowest rank's are
            rounds.append(sum(d[0].item() for d in every) / max(d[1].item() for d in every))
        measured[str(dtype).removeprefix("torch.")] = max(rounds)
    fastest = max(measured, key=measured.get)
    threads = torch.get_num_threads()
    return {"flops": measured[fastest], "how": f"{world_size} rank{'s' if world_size > 1 else ''} x {threads} "
                                               f"thread{'s' if threads > 1 else ''}: "
                                               f"{measured[fastest] / 1e9:.1f} GFLOP/s, a {fastest} matmul measured "
                                               f"now" + "".join(f" ({k}: {v / 1e9:.1f})" for k, v in measured.items()
                                                                if k != fastest)}


def report_speed(trainer: Trainer, cfg: Config, device: torch.device, peak: dict) -> dict:
    """Tokens per second of the training steps (evaluation and checkpoints left out), and the model FLOPs
    utilisation: the FLOPs the model needs per token (flops_per_token), times tokens/s, over the world's peak
    (machine_peak: a GPU's data sheet, a CPU's measured matmul)."""
    steps_here = trainer.steps - trainer.resumed_at
    tokens_per_s = steps_here * trainer.global_batch * cfg.context / trainer.train_seconds if steps_here else 0.0
    speed = {"tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token(cfg), "mfu": None,
             "peak_flops": peak["flops"], "peak": peak["how"]}
    line = f"tokens/s {tokens_per_s:,.0f} over {steps_here} steps ({trainer.train_seconds:.1f}s of training)"
    if peak["flops"] is None:
        line += f" | MFU: {peak['how']}"
    else:
        speed["mfu"] = tokens_per_s * speed["flops_per_token"] / peak["flops"]
        line += f" | {speed['flops_per_token'] / 1e6:.2f} MFLOP/token | MFU {speed['mfu']:.1%} of {peak['how']}"
    print(line)
    return speed


def write_run(args: argparse.Namespace, trainer: Trainer, model: GPT, floor: dict, evaluation: tuple, seconds: float,
              speed: dict, memory: dict, max_diff: float, text: str) -> None:
    """--out: summary.json (the run in numbers), model.pt (the plain GPT's weights), trajectory.pt (state_at's)."""
    loss, count = evaluation
    summary = {
        "stage": STAGE, "world_size": dist.get_world_size(), "backend": dist.get_backend(),
        "device": trainer.device.type, "dtype": args.dtype, "parallel": args.parallel, "dp": trainer.dp,
        "tp": args.tp, "pp": args.pp, "pp_schedule": args.pp_schedule, "stages_per_rank": args.stages_per_rank,
        "cp": args.cp, "cp_impl": args.cp_impl, "zigzag": not args.no_zigzag,
        "accumulate": args.accumulate, "amp": args.amp, "compile": args.compile, "ac": args.ac, "sp": args.sp,
        "batch_size": args.batch_size, "global_batch": trainer.global_batch, "max_steps": args.max_steps,
        **schedule(args), "clip": args.clip, "seed": args.seed, "model": model.cfg._asdict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": trainer.steps, "resumed_at": trainer.resumed_at, "losses": trainer.losses,
        "grad_norms": trainer.grad_norms,
        "curve": trainer.curve, "eval_loss": loss, "eval_count": count, "baselines": floor,
        "replica_max_abs_diff": max_diff, "seconds": seconds, "train_seconds": trainer.train_seconds, **speed,
        "memory": memory, "sample": text,
        "experts": {"experts": args.experts, "top_k": args.top_k, "ep": args.ep, "aux_weight": args.aux_weight,
                    "balance": args.balance, "capacity_factor": args.capacity_factor, **trainer.expert_log.history()},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save(model.state_dict(), args.out / "model.pt")
    torch.save(trainer.trajectory, args.out / "trajectory.pt")

