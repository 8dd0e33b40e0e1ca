"""Bad input refused before training: this stage's flag values in one line (exit 2), and a checkpoint directory checked
before a rank joins the group; and the names of a checkpoint's files. train.py calls it as `checks.` (its parser, the
checkpoints' names); below the boundary, the machinery every stage shares (tests/test_repo.py checks it). reports.py
holds the run's numbers and files."""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import re
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from dataset import load_corpus
from model import GPT, Config
from pipeline import MULTI, SPLIT_BACKWARD, V_SHAPED

STAGE = Path(__file__).resolve().parent.name  # the folder: 11_gpt, 12_context_parallel, ...


# ═══ The lesson ends here ═══════════════════════════════════════════════════════════════════════════════════════
# Below: what only the tour and the tests need, the same in every stage (tests/test_repo.py checks it); leave it out
# of your own project. Flag values refused in one line (check_args), the run's files for --out (state_of, save_run; a
# GPT stage has its own, in reports.py), one line on how another rank failed (explain_peer_failure), and a clean exit
# past a gloo bug.


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2 (no usage dump)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def ensure_writable(directory: Path) -> None:
    """Create `directory` if needed and write a file there: mkdir alone succeeds on a read-only disk."""
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()


# The torch each folder needs: the release that made its APIs public (fully_shard, which 08, 09, 11, 12 and 13 use, and
# pipelining as 10 uses it: 2.6; fully_shard's ignored_params, 14's: 2.7; register_post_accumulate_grad_hook: 2.1;
# all_gather_single and reduce_scatter_single: 2.13). 08-14 also check it at their top.
NEEDS_TORCH = {"08_fsdp": (2, 6), "09_tensor_parallel": (2, 6), "10_pipeline_parallel": (2, 6), "11_gpt": (2, 6),
               "12_context_parallel": (2, 6), "13_pipeline_4d": (2, 6), "14_experts": (2, 7), "ddp_by_hand": (2, 1),
               "zero_by_hand": (2, 13)}


def check_args(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse now, in one line, what would otherwise fail later, on one rank only, or in a traceback."""
    needs = NEEDS_TORCH.get(STAGE.split("/")[0], (2, 0))
    if torch.__version__ < needs:
        p.error(f"torch {torch.__version__} is too old for {STAGE}: it needs {needs[0]}.{needs[1]} or newer "
                f"(the tutorial is tested with 2.13); see 'Using another torch' in README.md")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda asked but no GPU is visible; use --device cpu (or auto)")
    gpus = torch.cuda.device_count() if args.device != "cpu" and torch.cuda.is_available() else 0  # auto or cuda
    spawned = getattr(args, "world_size", None)  # stage 03 starts its processes itself
    if gpus and spawned and spawned > gpus:
        p.error(f"argument --world-size: {spawned} processes but {gpus} GPU(s) visible; "
                f"use --world-size {gpus} or fewer (or --device cpu)")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes torchrun started on this node
    if gpus and local_world_size > gpus:
        p.error(f"torchrun --nproc_per_node: {local_world_size} processes but {gpus} GPU(s) visible; "
                f"use --nproc_per_node={gpus} or fewer (or --device cpu)")
    if "world_size" in args and "MASTER_PORT" in os.environ:  # stage 03, with a port of yours: check it now
        port = os.environ["MASTER_PORT"]
        if not (port.isdigit() and 0 < int(port) < 65536):
            p.error(f"MASTER_PORT={port} is not a port number; unset it (a free port is picked) or use 1-65535")
        if not port_is_free(int(port)):
            p.error(f"MASTER_PORT={port} is in use by another process; unset it (a free port is picked) "
                    f"or choose another")
    if args.out is not None:
        try:  # fail now, not after training
            ensure_writable(args.out)
        except OSError as e:
            p.error(f"argument --out: cannot write to {args.out} ({e.strerror}); choose a writable directory")
    return args


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as rank 0's store does
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def explain_peer_failure(error: RuntimeError, timeout: float) -> str | None:
    """One line for the two ways another rank's failure reaches this one; None for any other error."""
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return (f"waited more than --timeout {timeout:g}s for another rank: it stalled, died or skipped a "
                f"collective this rank called; raise --timeout only if a rank legitimately works alone that long")
    if "connection closed by peer" in text or "connection reset by peer" in text:
        return "another rank closed its connection (it died): its own error, or its launcher's, says why"
    return None


def exit_without_teardown() -> None:
    """Leave without Python's interpreter teardown: a gloo worker thread may still be releasing the last
    collective, which needs the GIL, and teardown aborts it ("terminate called without an active exception":
    5 of 22 runs here; 0 of 60 with this exit). Nothing is left to clean up."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

# ─── This stage's own checks ──────────────────────────────────────────────────────────────────────────────────
# Settings and files refused in one line (the model's shape, --tp, the corpus, a checkpoint directory); a failed save
# says why; the whole state for the trajectory; memory, speed and the files of --out.


PROGRESS = "progress.json"  # beside the shards: steps done, losses, and the settings the checkpoint was made with
CHECKPOINT = re.compile(r"step_(\d{6,})")  # a complete checkpoint; "step_NNNNNN.tmp" is one being written


def checkpoints(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    found = [p for p in directory.iterdir() if CHECKPOINT.fullmatch(p.name)] if directory.is_dir() else []
    return sorted(found, key=lambda p: int(CHECKPOINT.fullmatch(p.name).group(1)))


def check_checkpoint_arg(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    if args.snapshot is not None:
        if args.snapshot.exists() and not args.snapshot.is_dir():
            p.error(f"argument --snapshot: {args.snapshot} is a file; give a directory (each rank writes its own "
                    f"shards)")
        try:  # fail now, not at the first save
            ensure_writable(args.snapshot)
        except OSError as e:
            p.error(f"argument --snapshot: cannot write to {args.snapshot} ({e.strerror}); "
                    f"choose a writable directory")
    return args


def check_gpt_args(p: ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The model's shape, the grid and the corpus: refused now, in one line, rather than in a traceback on a rank."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.width % args.heads:
        p.error(f"argument --heads: {args.heads} does not divide --width {args.width} (each head takes an equal "
                f"part of the width)")
    if args.tp > 1 and args.parallel != "fsdp":
        p.error("argument --tp: tensor parallelism is combined with FSDP2 over dp here (stage 09); add "
                "--parallel fsdp")
    if world_size % args.tp:
        p.error(f"argument --tp: {args.tp} does not divide the world size {world_size} (the grid is pp x "
                f"dp x cp x tp processes); use a divisor of {world_size}")
    if world_size % (args.cp * args.tp):
        p.error(f"argument --cp: {args.cp} x --tp {args.tp} does not divide the world size {world_size} (the grid "
                f"is dp x cp x tp processes); use a cp that divides {world_size // args.tp}")
    if args.cp == 1 and (args.no_zigzag or args.cp_impl != "ring"):  # (said, not left unread)
        flag = "--no-zigzag" if args.no_zigzag else "--cp-impl"
        p.error(f"argument {flag}: it sets how --cp splits the attention, and --cp 1 splits none; add --cp 2 or more, "
                f"or leave {flag} out")
    multiple, why = (args.cp, "cp") if args.no_zigzag else (2 * args.cp, "2 x cp: zigzag cuts it into 2 cp chunks")
    if args.cp > 1 and args.context % multiple:
        p.error(f"argument --context: {args.context} is not a multiple of {multiple} ({why}); use --context "
                f"{max(multiple, args.context // multiple * multiple)}")
    if args.sp and args.tp == 1:
        p.error("argument --sp: sequence parallelism splits the sequence over the tp ranks; add --tp 2 or more")
    if args.sp and args.context % (args.cp * args.tp):  # (after the cp checks: a cp share is context / cp tokens)
        share = f"--context {args.context}" + (f" / --cp {args.cp}" if args.cp > 1 else "")
        p.error(f"argument --sp: --tp {args.tp} does not divide {share} (each tp rank holds an equal part of every "
                f"window{'s cp share' if args.cp > 1 else ''})")
    if args.cp > 1 and args.compile:
        p.error("argument --compile: the ring's sends and receives run between the compiled parts; compile with "
                "--cp 1")
    if world_size % (args.pp * args.cp * args.tp):
        p.error(f"argument --pp: {args.pp} x --cp {args.cp} x --tp {args.tp} does not divide the world size "
                f"{world_size} (the grid is pp x dp x cp x tp processes); use a pp that divides "
                f"{world_size // (args.cp * args.tp)}")
    if args.pp > 1 and args.parallel != "fsdp":
        p.error("argument --pp: pipelining is combined with FSDP2 over dp here (DDP's reducer fails an internal "
                "assert when a schedule runs several backwards a step, torch 2.13); add --parallel fsdp")
    if args.pp > args.layers:
        p.error(f"argument --pp: {args.pp} stages need at least {args.pp} blocks (each stage holds whole blocks), "
                f"not --layers {args.layers}; use --pp {args.layers} or fewer")
    if args.pp > 1 and args.pp_schedule == "1f1b" and args.accumulate < args.pp:
        p.error(f"argument --accumulate: 1F1B needs at least one micro-batch per stage, {args.pp}, not "
                f"{args.accumulate}; use --accumulate {args.pp} or more (or --pp-schedule gpipe)")
    check_virtual_stages(p, args)
    if args.replicate > 1 and args.parallel != "fsdp":
        p.error("argument --replicate: HSDP keeps replicas of FSDP2's shards (DDP already replicates over every dp "
                "rank); add --parallel fsdp")
    dp = world_size // (args.pp * args.cp * args.tp)
    if args.replicate > 1 and dp % args.replicate:
        p.error(f"argument --replicate: {args.replicate} does not divide dp {dp} (world size {world_size} / --pp "
                f"{args.pp} x --cp {args.cp} x --tp {args.tp}: replicate x shard = dp); use one of "
                f"{[d for d in range(1, dp + 1) if dp % d == 0]}")
    if args.heads % args.tp:
        p.error(f"argument --tp: {args.tp} does not divide --heads {args.heads} (each tp rank computes whole heads); "
                f"use one of {[d for d in range(1, args.heads + 1) if args.heads % d == 0]}")
    if args.amp and args.dtype == "float64":
        p.error("argument --amp: autocast leaves float64 alone, so nothing would run in bfloat16; use --dtype float32")
    if args.clip < 0:
        p.error(f"argument --clip: must be 0 (no clipping) or a positive norm, got {args.clip}")
    if args.warmup_steps > args.decay_steps:
        p.error(f"argument --warmup-steps: {args.warmup_steps} is past --decay-steps {args.decay_steps} (the decay "
                f"starts when the warm-up ends); use {args.decay_steps} or less")
    if args.sample < 0:
        p.error(f"argument --sample: must be 0 or more characters, got {args.sample}")
    try:
        corpus = load_corpus(args.data)
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).split(":")[0]
        p.error(f"argument --data: cannot read {args.data} as UTF-8 text ({why})")
    shortest = min(len(corpus.train), len(corpus.held_out))
    if args.context >= shortest:
        p.error(f"argument --context: {args.context} characters is longer than the text allows: it holds "
                f"{len(corpus.held_out):,} held-out characters after {len(corpus.train):,} to train on; "
                f"use --context {max(shortest - 1, 1)} or less, or a longer text (--data)")
    return args


def check_virtual_stages(p: ArgumentParser, args: argparse.Namespace) -> None:
    """--stages-per-rank and the schedules that hold several stages a rank (pipeline.py), refused before torch
    raises on every rank (its ValueErrors, each named below)."""
    v, kind, stages = args.stages_per_rank, args.pp_schedule, args.pp * args.stages_per_rank
    multi = kind in MULTI
    if v > 1 and args.pp == 1:
        p.error(f"argument --stages-per-rank: {v} stages a rank cut a pipeline; add --pp 2 or more")
    if multi and args.pp == 1:  # (one rank would build the stages of a pipeline it does not have)
        p.error(f"argument --pp-schedule: {kind} runs several stages a rank of a pipeline; add --pp 2 or more, or "
                f"leave --pp-schedule out")
    if args.pp == 1:
        return
    if v > 1 and not multi:  # (torch's GPipe and 1F1B take one stage)
        p.error(f"argument --stages-per-rank: {kind} runs one stage a rank, not {v}; use --pp-schedule "
                f"interleaved1f1b (or interleavedzb, zbv, dualpipev), or --stages-per-rank 1")
    if multi and v == 1:  # (with one stage a rank they are 1F1B, or not defined)
        p.error(f"argument --stages-per-rank: {kind} holds several stages a rank; use --stages-per-rank 2")
    if kind in V_SHAPED and v != 2:  # torch: "ZBV requires exactly 2 stages per rank"
        p.error(f"argument --stages-per-rank: {kind} places exactly 2 stages a rank, in a V (rank r: stages r and "
                f"{2 * args.pp - 1} - r), not {v}; use --stages-per-rank 2")
    if stages > args.layers:  # (each stage holds whole blocks; the first ones one more when they do not divide)
        p.error(f"argument --stages-per-rank: --pp {args.pp} x {v} = {stages} stages need at least {stages} blocks, "
                f"not --layers {args.layers}; use --layers {stages} or fewer stages")
    m, rounds = args.accumulate, max(1, args.accumulate // args.pp)
    if kind in MULTI - V_SHAPED and m % rounds:  # round-robin; torch: "... a multiple of the number of rounds"
        p.error(f"argument --accumulate: {kind} runs the micro-batches in --accumulate // --pp = {rounds} rounds "
                f"of equal size, and {m} is not a multiple of {rounds}; use --accumulate {m // args.pp * args.pp} "
                f"(a multiple of --pp)")
    if kind == "dualpipev" and m < stages:  # torch: "DualPipeV requires at least as many microbatches as stages"
        p.error(f"argument --accumulate: dualpipev needs a micro-batch per stage, {stages}, not {m}; use "
                f"--accumulate {stages} or more")
    if kind in SPLIT_BACKWARD and args.compile:  # torch: _check_torch_compile_compatibility
        p.error(f"argument --compile: {kind} splits each backward in two (input, then weight gradients), which a "
                f"compiled block cannot; drop --compile or use --pp-schedule interleaved1f1b")
    if kind in SPLIT_BACKWARD and args.ac == "selective":  # torch: "Trying to backward an extra time ..." on every rank
        p.error(f"argument --ac: {kind} runs two backwards over each block (input, then weight gradients), and a "
                f"selective checkpoint's saved outputs serve one; use --ac full (recomputes for each) or --pp-schedule "
                f"interleaved1f1b")


class SnapshotError(Exception):
    """A --snapshot directory that cannot be resumed from: reported in one line, exit status 2."""


class MetadataUnpickler(pickle.Unpickler):
    """Reads a checkpoint's .metadata, which dcp.load unpickles as it is: only what metadata is made of passes."""

    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("collections", "OrderedDict"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        # The metadata's own classes (dataclasses, an enum); not its module's functions, which a pickle could call.
        metadata_class = module == "torch.distributed.checkpoint.metadata" and \
            isinstance(getattr(dcp.metadata, name, None), type)
        if (module, name) in self.ALLOWED or dtype or metadata_class:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata (a pickle that runs "
                                     f"code?)")


def load_snapshot(args: argparse.Namespace, dp: int) -> dict | None:
    """Check the newest checkpoint in --snapshot without reading its shards; None if there is none yet."""
    directory = args.snapshot
    strangers = [p.name for p in directory.iterdir() if not CHECKPOINT.fullmatch(p.name.removesuffix(".tmp"))] \
        if directory.is_dir() else []
    if strangers:
        raise SnapshotError(f"{directory} is not a checkpoint directory of this stage (it holds {strangers[0]}); "
                            f"give a new or empty directory")
    if not (found := checkpoints(directory)):
        return None
    path = found[-1]
    try:
        progress = json.loads((path / PROGRESS).read_text())
        with open(path / ".metadata", "rb") as f:  # what was saved, and where each piece lies
            metadata = MetadataUnpickler(f).load()
    except Exception as e:  # a file missing or unreadable
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SnapshotError(f"cannot load {path}: {first_line}") from e
    keys = {"steps", "losses", "curve", "grad_norms", "seed", "global_batch", "dtype", "model", "world_size",
            "schedule"}
    if not isinstance(progress, dict) or not keys <= progress.keys():
        raise SnapshotError(f"{path / PROGRESS} is not this stage's (expected the keys {sorted(keys)})")
    # The model's shape as train.py builds it: the flags named as Config's fields (stage 14 adds experts, top_k).
    cfg = Config(len(set(args.data.read_text(encoding="utf-8"))), *(getattr(args, f) for f in Config._fields[1:]))
    with torch.device("meta"):
        expected = {f"model.{k}": list(v.shape) for k, v in GPT(cfg).state_dict().items()}
    found_shapes = {k: list(getattr(metadata.state_dict_metadata.get(k), "size", [])) for k in expected}
    if found_shapes != expected or progress["model"] != cfg._asdict():
        def shape(model: dict) -> str:  # "context 32, layers 4, heads 4, width 128, vocab 65" (14: and experts)
            return ", ".join(f"{k} {model.get(k)}" for k in [*Config._fields[1:], "vocab"]) + "".join(
                f", {k} {v}" for k, v in model.items() if k not in Config._fields)  # (another stage's: 14's experts)
        raise SnapshotError(f"{path} holds another model: {shape(progress['model'])} (this run: "
                            f"{shape(cfg._asdict())}); resume with the same, or use another --snapshot")
    for piece in metadata.storage_data.values():  # a shard file missing or cut short: found now, not mid-load
        file = path / piece.relative_path
        if not file.exists() or file.stat().st_size < piece.offset + piece.length:
            raise SnapshotError(f"{file} is {'truncated' if file.exists() else 'missing'}; that checkpoint is "
                                f"incomplete")
    global_batch = dp * args.accumulate * args.batch_size
    made_with = (progress["seed"], progress["global_batch"], progress["dtype"])
    if made_with != (args.seed, global_batch, args.dtype):
        raise SnapshotError(f"{path} was made with --seed {made_with[0]}, global batch {made_with[1]} and "
                            f"--dtype {made_with[2]}; resume with the same, or use another --snapshot")
    if progress["schedule"] != schedule(args):  # the rate of every step to come depends on all three
        made = progress["schedule"]
        raise SnapshotError(f"{path} was made with --lr {made.get('lr')} --warmup-steps {made.get('warmup_steps')} "
                            f"--decay-steps {made.get('decay_steps')}; resume with the same (a longer run: a larger "
                            f"--max-steps, the same --decay-steps), or use another --snapshot")
    return {"path": path, **progress}


def schedule(args: argparse.Namespace) -> dict:
    """What learning_rate() reads besides the step: saved with a checkpoint, checked when resuming."""
    return {"lr": args.lr, "warmup_steps": args.warmup_steps, "decay_steps": args.decay_steps}


def failed_save(error: Exception, tmp: Path, directory: Path) -> OSError:
    """One line for a save that failed on some rank (dcp names each failure), and what is still there."""
    causes = "; ".join(f"rank {r}: {exc}" for r, (exc, _) in error.failures.items()) \
        if isinstance(error, dcp.CheckpointException) else str(error)
    free = shutil.disk_usage(directory).free
    kept = f"{checkpoints(directory)[-1]} is still the last checkpoint" if checkpoints(directory) \
        else "there is no earlier checkpoint"
    return OSError(f"writing the checkpoint {tmp} failed ({causes}; {free} bytes free on that disk); {kept}")
