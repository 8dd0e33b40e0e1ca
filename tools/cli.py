"""Pieces shared by the tools: tour.py, benchmarks/, collectives/, ddp_by_hand/'s scripts (not by the stages, which
stay self-contained). A tool in a folder puts the repository root on sys.path first (Python adds only the script's own
folder), then imports `from tools.cli import ...`. Here: one-line errors with exit status 2, positive numbers,
comma-separated lists, a free port, an output directory checked before any measuring starts, and the gloo group each
worker runs in."""
from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import socket
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path


def summary(doc: str) -> str:
    """A docstring's first paragraph on one line: --help's description (its first line may end mid-sentence)."""
    return " ".join(doc.split("\n\n")[0].split())


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2 (no usage dump)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def check_out_writable(self, out: Path) -> None:
        """Refuse an --out directory that cannot be written, now rather than after measuring."""
        try:
            ensure_writable(out)
        except OSError as e:
            self.error(f"argument --out: cannot write to {out} ({e.strerror}); choose a writable directory")


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def list_of(kind, choices: tuple[str, ...] = ()):
    """A comma-separated flag value: distinct positive numbers, or names from `choices`."""
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or len(set(values)) < len(values) or any(v not in choices if choices else v <= 0
                                                                for v in values):
            allowed = f"names from {','.join(choices)}" if choices else "positive integers"
            raise argparse.ArgumentTypeError(f"expected distinct comma-separated {allowed}, got {text!r}")
        return values
    parse.__name__ = "list"
    return parse


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_writable(directory: Path) -> None:
    """Create `directory` if needed and write a file there: mkdir alone succeeds on a read-only disk."""
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int, timeout: float) -> Iterator[None]:
    """The block runs in a gloo group on 127.0.0.1:port, with one intra-op thread per rank."""
    import torch  # here, not at the top: dp_vs_ddp.py only starts subprocesses
    import torch.distributed as dist

    torch.set_num_threads(1)  # W ranks share the machine's cores: one core each
    # Sync point: every rank meets here; any collective that then waits longer than `timeout` fails the job.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        yield
    finally:
        dist.destroy_process_group()


def print_table(rows: list[list[str]]) -> None:
    """Rows of cells (the first: the header), each column as wide as its widest cell, two spaces apart."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def read_csv(path: Path) -> list[dict[str, str]]:
    """A CSV file's rows, each a dict from its header's columns to the row's cells."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_csv(path: Path, rows: Iterable[dict], columns: Sequence[str], floats: str | None = ".6g") -> None:
    """`rows` as a CSV file under `columns` (a row's other keys left out), each float in the format `floats` (None: in
    full, as Python prints it)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: format(v, floats) if floats and isinstance(v, float) else v for k, v in r.items()}
                         for r in rows)


def exit_worker() -> None:
    """Leave without interpreter teardown, which can abort gloo's threads (see 03_ddp_spawn/README.md)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class SentBytes:
    """Stands in for torch.distributed inside a module being measured (module.dist = SentBytes()): every call passes
    through, and `sent` counts the bytes this rank hands over: a point-to-point send's tensor, for an all-gather or
    a reduce-scatter of W shares the W - 1 shares a ring algorithm sends (gloo's own algorithm may differ), and for an
    all-to-all the rows for the other ranks (its own share stays)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist, self.sent = dist, 0

    def __getattr__(self, name: str):
        return getattr(self.dist, name)

    def batch_isend_irecv(self, ops: list):
        self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is self.dist.isend)
        return self.dist.batch_isend_irecv(ops)

    def all_gather(self, parts: list, x, *args, **kwargs):
        self.sent += (len(parts) - 1) * x.numel() * x.element_size()
        return self.dist.all_gather(parts, x, *args, **kwargs)

    def reduce_scatter(self, out, parts: list, *args, **kwargs):
        self.sent += (len(parts) - 1) * out.numel() * out.element_size()
        return self.dist.reduce_scatter(out, parts, *args, **kwargs)

    def all_to_all_single(self, out, x, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
        self.sent += off_rank_bytes(x, input_split_sizes, self.dist.get_rank(group), self.dist.get_world_size(group))
        return self.dist.all_to_all_single(out, x, output_split_sizes, input_split_sizes, group=group, **kwargs)


def off_rank_bytes(x, split_sizes: list[int] | None, me: int, world: int) -> int:
    """The bytes of an all-to-all's tensor x (rows split over the ranks in order: split_sizes, or equal shares) that
    are not rank `me`'s own share: what leaves, or arrives at, this rank."""
    rows = x.shape[0] if x.dim() else 0
    own = split_sizes[me] if split_sizes else rows // world
    return (rows - own) * (x.numel() // max(rows, 1)) * x.element_size()
