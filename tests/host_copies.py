"""Stages 11 and 12: a training step's forward and backward make no tensor on the host and copy none from it.

A GPU runs ahead of Python only while Python gives it nothing to wait for: a mask or a list of positions made on the
CPU and copied to the GPU inside the step waits for the copy, every layer; so does a single number, a scalar made on
the host and copied (`torch.tensor(0.5, device=x.device)`, or `torch.tensor(0.5).to(x.device)`). This script builds
each stage's GPT on --device and runs two steps (forward, loss, backward) under a dispatch mode that records every
operation with a CPU tensor of one or more dimensions among its inputs or outputs, and every copy of a CPU scalar
(0-dim) to the device, and under a function mode that records every tensor made from Python's data on the device
(torch.tensor and the like copy it from the host; their copy runs below the dispatch mode, unseen there). A CPU
scalar an operation takes as it is is allowed, and listed apart: a CUDA kernel takes it by value, with no copy and
nothing to wait for. SDPA's memory-efficient kernels return their random seed and offset as two such scalars, and
its backward takes them: the first run on a GPU, an H200, counted 4 such operations in a float32 step of 11 (two
layers), and on `meta` the stages make none. On `meta`, the suite's stand-in for a GPU (tensors with shapes and no
data: a copy from the CPU shows as an operation on a CPU tensor, and reading a value, `.item()`, raises), and on
`cuda`, where the steps also run under torch.cuda.set_sync_debug_mode("error") (any call that waits for the GPU
raises: the operation that raised is recorded too). 12's context parallelism (cp 2, this process its rank 0) runs
through torch's fake process group, whose collectives move nothing: what is checked is the code around them.

Besides the count, how many times a step builds the diagonal's mask (`aten.tril`): the ring makes it once per size,
so the second step builds none. The planted controls are edits of 12's source that make what the issue found: the
positions made on the host and copied every forward, the mask made on the host and copied every layer, the mask made
on the device but not kept; and a scalar made on the host and copied every layer, both ways. Each must be seen as
what it plants, in every step: its copy among the step's host operations (a step that merely fails does not count),
or its masks built. One more edit must pass: a CPU scalar taken by value every layer (listed among the scalars).

    python tests/host_copies.py --device meta        prints one JSON object: per case, per step, what was seen
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from harness import load_copy, mutated

SIZES = {"layers": 2, "heads": 2, "width": 16, "context": 16}  # a window of 16 tokens: 8 per cp rank
BATCH, CP = 2, 2
POSITIONS = "where = torch.arange(t, device=idx.device) if self.cp is None else self.cp.positions(t, idx.device)"
MASK = "return torch.ones(rows, before + rows, dtype=torch.bool, device=device).tril(before)"
CACHE = "@functools.cache\ndef causal_mask("
CASES = ["11", "12 ring zigzag", "12 ring contiguous", "12 allgather zigzag", "12 allgather contiguous"]
RESIDUAL = "x = x + self.attn(self.norm1(x))"
PLANTED = {  # name: the edits of 12_context_parallel's files (old, new), and what must be seen: an operation among
    # the step's host operations, or "tril" for masks built
    "positions from the host": ([(POSITIONS, "where = (torch.arange(t) if self.cp is None else "
                                             "self.cp.positions(t, 'cpu')).to(idx.device)")], "aten._to_copy.default"),
    "mask from the host, every layer": ([(MASK, "return torch.ones(rows, before + rows, dtype=torch.bool)"
                                                ".tril(before).to(device)"), (CACHE, "def causal_mask(")],
                                        "aten._to_copy.default"),
    "mask made again every layer": ([(CACHE, "def causal_mask(")], "tril"),
    "a scalar made on the device from the host, every layer": (
        [(RESIDUAL, RESIDUAL + " * torch.tensor(1.0, device=x.device)")], "torch.tensor"),
    "a scalar copied from the host, every layer": (
        [(RESIDUAL, RESIDUAL + " * torch.tensor(1.0).to(x.device)")], "aten._to_copy.default"),
}
BY_VALUE = [(RESIDUAL, RESIDUAL + " * torch.tensor(1.0)")]  # a CPU scalar the multiplication takes by value: allowed
COPIES = {torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.copy, torch.ops.aten._copy_from,
          torch.ops.aten._copy_from_and_resize}
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}  # a tensor made from Python's data (a host buffer)


def on_host(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]


class HostTensors(TorchDispatchMode):
    """Records the name of every operation with a CPU tensor of one or more dimensions among its inputs or outputs,
    or that copies a CPU scalar to the device (`host`); lists apart those whose only host tensors are scalars taken
    as they are (`scalars`); counts the masks built."""

    def __init__(self) -> None:
        super().__init__()
        self.host: list[str] = []
        self.scalars: list[str] = []  # operations whose only host tensors are scalars taken by value (allowed)
        self.tril = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            out = func(*args, **(kwargs or {}))
        except RuntimeError:  # on cuda, set_sync_debug_mode("error") refuses the wait: the operation is seen still
            self.note(func, (args, kwargs), None)
            raise
        self.note(func, (args, kwargs), out)
        self.tril += func.overloadpacket is torch.ops.aten.tril
        return out

    def note(self, func, inputs, out) -> None:
        """`out` None: the operation raised."""
        host_in, host_out = on_host(inputs), on_host(out)
        to_device = out is None or any(isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in tree_leaves(out))
        if any(t.dim() for t in host_in + host_out) or (func.overloadpacket in COPIES and host_in and to_device):
            self.host.append(str(func))
        elif host_in or host_out:
            self.scalars.append(str(func))


class FromData(TorchFunctionMode):
    """Adds to `host` every tensor made from Python's data on the device: torch.tensor(0.5, device=x.device) copies
    it from a host buffer, below the dispatch mode."""

    def __init__(self, host: list[str]) -> None:
        super().__init__()
        self.host = host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made = func in FROM_DATA and not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor)
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            if made and torch.device(kwargs.get("device") or "cpu").type != "cpu":
                self.host.append(f"torch.{func.__name__}")
            raise
        if made and out.device.type != "cpu":
            self.host.append(f"torch.{func.__name__}")
        return out


def load(stage: str, edits: list[tuple[str, str]] = ()) -> types.ModuleType:
    """A stage's train.py as a fresh module, with `edits` made to its files (a copy of them, in a folder of its own)."""
    return load_copy(mutated(stage, list(edits), Path(tempfile.mkdtemp(dir=WORK.name))))


WORK = tempfile.TemporaryDirectory(prefix="host_copies_")  # the copies load() makes: removed as the process ends


def steps(module: types.ModuleType, device: torch.device, impl: str | None, zigzag: bool) -> list[dict]:
    """Two steps of the stage's GPT on `device` (with cp 2 by `impl`, or without cp for None): per step, the
    operations on host tensors and the masks built."""
    cfg = module.Config(vocab=65, **SIZES)
    torch.manual_seed(0)
    with torch.device(device):
        model = module.GPT(cfg)
    t = cfg.context
    if impl is not None:  # what 12's parallelize() does for --cp
        model.cp = cp = module.ContextParallel(dist.group.WORLD, impl, zigzag)
        for block in model.blocks:
            block.attn.cp = cp
        t //= CP
    x, y = (torch.randint(0, cfg.vocab, (BATCH, t), device=device) for _ in range(2))
    seen = []
    for _ in range(2):
        waited = None
        with HostTensors() as mode, FromData(mode.host):
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
            except RuntimeError as e:  # set_sync_debug_mode("error") raises where the host would wait
                waited = str(e).splitlines()[0]
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        seen.append({"host": mode.host, "scalars": mode.scalars, "tril": mode.tril, "waited": waited})
    return seen


def problems(report: dict) -> list[str]:
    """What is wrong in a report: a case with an operation on a host tensor, a second step of 12 that builds a mask
    again, a planted control not seen as what it plants, a scalar taken by value not allowed."""
    found = []
    if list(report["cases"]) != CASES:
        found.append(f"cases {list(report['cases'])}, expected {CASES}")
    for case, seen in report["cases"].items():
        for i, step in enumerate(seen, start=1):
            if step["host"] or step["waited"]:
                found.append(f"{case}, step {i}: {len(step['host'])} operations on host tensors "
                             f"{step['host'][:5]}, waited: {step['waited']}")
        if case.startswith("12") and seen[1]["tril"]:
            found.append(f"{case}: the second step built {seen[1]['tril']} masks")
    if list(report["planted"]) != list(PLANTED):
        found.append(f"planted {list(report['planted'])}, expected {list(PLANTED)}")
    for name, seen in report["planted"].items():
        sign = PLANTED[name][1] if name in PLANTED else None
        if not all(step["tril"] if sign == "tril" else sign in step["host"] for step in seen):
            found.append(f"planted {name!r} unseen as {sign}: {seen}")
    for i, step in enumerate(report["by value"], start=1):
        if step["host"] or step["waited"] or not step["scalars"]:
            found.append(f"a scalar taken by value, step {i}: not listed apart as allowed: {step}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["meta", "cuda"], default="meta")
    device = torch.device(parser.parse_args().device)
    dist.init_process_group(f"cpu:fake,{device.type}:fake", store=FakeStore(), rank=0, world_size=CP)
    report: dict = {"device": str(device), "cases": {}, "planted": {}}
    report["cases"]["11"] = steps(load("11_gpt"), device, None, False)
    stage12 = load("12_context_parallel")
    for impl in ("ring", "allgather"):
        for zigzag in (True, False):
            report["cases"][f"12 {impl} {'zigzag' if zigzag else 'contiguous'}"] = steps(stage12, device, impl, zigzag)
    for name, (edits, _) in PLANTED.items():
        report["planted"][name] = steps(load("12_context_parallel", edits), device, "ring", True)
    report["by value"] = steps(load("12_context_parallel", BY_VALUE), device, "ring", True)
    dist.destroy_process_group()
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
