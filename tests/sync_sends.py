"""Run a script with torch.distributed's messages and collectives run as NCCL runs them: synchronous and in order.

    torchrun --standalone --nproc_per_node=2 tests/sync_sends.py 10_pipeline_parallel/by_hand.py --schedule 1f1b
    python tests/sync_sends.py SCRIPT [ARGS...]

gloo runs each message on its own as soon as it is posted, and its collectives apart from the messages, so an order
of messages that waits on itself runs on gloo and hangs on NCCL. There, above its eager size (a few hundred KiB), a send
completes only once the receiver has posted the matching receive, and the messages and collectives of a communicator
run one after another, in the order they were posted, on one stream. Before running SCRIPT (runpy, as __main__), this
replaces dist.isend, irecv, send, recv, batch_isend_irecv and the collectives (COLLECTIVES: all_reduce, broadcast,
barrier, all_gather, reduce_scatter, ...) with versions on top of gloo that keep those rules:

- each process has one stream, a thread that runs its messages and collectives one at a time in the order they were
  posted; isend, irecv and a collective with async_op=True return at once, and their work is done when the stream has
  run them; a blocking call waits for that (where NCCL's would make the current CUDA stream wait: the same order);
- a send is done only once the receiver has taken it: the receiver answers with an acknowledgement (a message on a
  tag of its own), and the stream waits for it before it starts the next item: a collective posted after a send
  begins only once that send was taken, as on NCCL;
- a batch_isend_irecv is one item of the stream: its messages run at once, and it is done when all of them are (a
  receive is acknowledged as soon as it arrives), so a send and a receive of one batch never wait on each other;
- a collective is one item: the stream runs gloo's, which waits for the other ranks as usual; the object collectives
  (all_gather_object, broadcast_object_list, ...) run as the collectives they are made of;
- the messages from one process to another are matched in the order they were posted, whatever their tags (NCCL
  ignores tags).

So an order that can wait on itself waits here until the process group's timeout, and fails with gloo's "Timed out"
error, prefixed with "sync_sends:" and the message that was never taken; every later item of that process group fails
with it too, as a broken communicator's do (other groups' items still run). At exit each process says on stderr how
many messages and collectives it ran this way ("sync_sends: rank R: N messages ..."), so a test can see the emulation
was in the way.

Against NCCL this is stricter in two ways: every send waits for its receiver, however small (NCCL's eager ones do
not), and one stream carries all of a process's groups and peers (NCCL has one per communicator, and torch gives a
send or receive outside a batch a communicator per pair of processes, ordered apart from the group's collectives).
Not emulated, so a script that passes here may still hang on NCCL: collectives that do not go through these functions
(torch.distributed._functional_collectives, DTensor's, a ProcessGroup's own methods), and NCCL's own rules (a batch of
messages must not be a group's first call; a batched send and an unbatched receive between the same two processes go
through different communicators and never meet). CPU tensors only (gloo).
"""
from __future__ import annotations

import atexit
import functools
import inspect
import os
import queue
import re
import runpy
import sys
import threading
from collections import defaultdict
from itertools import count
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

GLOO = {name: getattr(c10d, name) for name in ("isend", "irecv")}  # the real ones, which the emulation runs on
ACK = 1 << 30  # acknowledgements use the tags from here up; messages are numbered below it, per pair of processes
# The collectives run in the stream, those of them this torch has. The object collectives (all_gather_object, ...) call
# these through distributed_c10d's globals, so they are in the stream too; send_object_list calls send.
COLLECTIVES = [name for name in (
    "all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_single",
    "all_gather_into_tensor", "all_gather_coalesced", "_all_gather_base", "gather", "scatter", "reduce_scatter",
    "reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier") if hasattr(c10d, name)]


class Work:
    """What the emulated isend, irecv, batch_isend_irecv and async collectives return: done when the stream has run
    the item."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: str | None = None

    def wait(self, timeout=None) -> bool:
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(self.error)  # the stage's explain_peer_failure reads gloo's "Timed out" in it
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None


class Stream:
    """This process's point-to-point messages and collectives, run one item at a time in the order they were posted."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()
        self.numbers: defaultdict = defaultdict(count)  # (group, peer, "send" or "recv") -> the next message's number
        # A group's first failure: every later item of that group fails with it, as a broken communicator's do.
        self.errors: dict[int, str] = {}
        self.messages = 0
        self.collectives = 0
        self.thread = threading.Thread(target=self._loop, name="sync_sends", daemon=True)
        self.thread.start()

    def post(self, ops: list[tuple[str, torch.Tensor, int, object]]) -> Work:
        """ops: (send or recv, tensor, peer's global rank, group), run at once as one item; returns its work."""
        return self._put([group for *_, group in ops], lambda: self._run_together(ops))

    def call(self, group, collective: functools.partial) -> Work:
        """A collective of `group` (gloo's, blocking), run as one item; returns its work."""
        def run() -> None:
            collective()
            self.collectives += 1
        return self._put([group], run)

    def _put(self, groups: list, run) -> Work:
        work = Work()
        self.items.put(([id(g) for g in groups], run, work))
        return work

    def _loop(self) -> None:
        while True:
            groups, run, work = self.items.get()
            error = next((self.errors[g] for g in groups if g in self.errors), None)
            if error is None:
                try:
                    run()
                except Exception as e:  # gloo's timeout, mostly
                    error = f"sync_sends: rank {dist.get_rank()}: {e}"
                    for g in groups:
                        self.errors.setdefault(g, error)
            work.error = error
            work.done.set()

    def _run_together(self, ops: list[tuple[str, torch.Tensor, int, object]]) -> None:
        sends, receives = [], []
        for kind, tensor, peer, group in ops:  # post every message of the item first: they run at once
            n = next(self.numbers[(id(group), peer, kind)])
            assert n < ACK, "sync_sends: too many messages between two processes"
            if kind == "send":
                ack = torch.zeros(1, dtype=torch.int32)
                sends.append((peer, n, GLOO["isend"](tensor, peer, group, tag=n), GLOO["irecv"](ack, peer, group,
                                                                                               tag=ACK + n)))
            else:
                receives.append((peer, n, group, GLOO["irecv"](tensor, peer, group, tag=n)))
        # Each receive is acknowledged as soon as it arrives, whatever the others of the item do: a thread each.
        errors: list[Exception] = []

        def take(peer: int, n: int, group, work) -> None:
            try:
                work.wait()
                GLOO["isend"](torch.ones(1, dtype=torch.int32), peer, group, tag=ACK + n).wait()
            except Exception as e:
                errors.append(RuntimeError(f"receiving message {n} from rank {peer}: {e}"))
        threads = [threading.Thread(target=take, args=r, daemon=True) for r in receives]
        for t in threads:
            t.start()
        for peer, n, data, ack in sends:
            try:
                data.wait()
                ack.wait()  # the receiver took it: only now is the send done
            except Exception as e:
                errors.append(RuntimeError(f"message {n} to rank {peer} was never taken: {e}"))
        for t in threads:
            t.join()
        self.messages += len(ops)
        if errors:
            raise errors[0]


_stream: Stream | None = None


def stream() -> Stream:
    global _stream
    if _stream is None:
        _stream = Stream()
    return _stream


def _peer(group, rank: int | None, group_rank: int | None) -> tuple[object, int]:
    group = group if group is not None else dist.group.WORLD
    if group_rank is not None:
        rank = dist.get_global_rank(group, group_rank)
    if rank is None:
        raise NotImplementedError("sync_sends: a receive from any source")
    return group, rank


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None):
    group, dst = _peer(group, dst, group_dst)
    return stream().post([("send", tensor, dst, group)])


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None):
    group, src = _peer(group, src, group_src)
    return stream().post([("recv", tensor, src, group)])


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, group_dst: int | None = None) -> None:
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, group_src: int | None = None) -> int:
    group, src = _peer(group, src, group_src)
    stream().post([("recv", tensor, src, group)]).wait()
    return src


def batch_isend_irecv(p2p_op_list: list) -> list[Work]:
    if not p2p_op_list:
        raise ValueError("sync_sends: batch_isend_irecv of no messages (torch refuses it too)")
    ops = [("send" if op.op in (isend, GLOO["isend"]) else "recv", op.tensor, op.peer, op.group) for op in p2p_op_list]
    return [stream().post(ops)] * len(ops)


def in_the_stream(real):
    """`real`, a collective of torch.distributed, made an item of the stream: behind every message and collective the
    process posted before it, as on NCCL's stream."""
    signature = inspect.signature(real)

    @functools.wraps(real)
    def collective(*args, **kwargs):
        if threading.current_thread() is stream().thread:  # a collective made of others (all_gather_into_tensor's)
            return real(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        group = bound.arguments.get("group")
        group = dist.group.WORLD if group is None else group
        async_op = bound.arguments.get("async_op", False)
        if "async_op" in signature.parameters:
            bound.arguments["async_op"] = False  # the stream runs it to its end before the next item
        work = stream().call(group, functools.partial(real, *bound.args, **bound.kwargs))
        if async_op:
            return work
        work.wait()
        return None
    return collective


def install() -> None:
    """Replace the point-to-point calls and the collectives in torch.distributed and in its c10d module (P2POp checks
    the latter's; the object collectives call the latter's)."""
    for fn in (isend, irecv, send, recv, batch_isend_irecv, *(in_the_stream(getattr(c10d, n)) for n in COLLECTIVES)):
        setattr(c10d, fn.__name__, fn)
        setattr(dist, fn.__name__, fn)


def _report_at_exit() -> None:
    """At exit (by os._exit, as the stages leave, or normally), one line on stderr: how many messages and collectives
    this process ran through the stream. A test reads it to know the emulation was in the way, not bypassed."""
    real_exit = os._exit
    reported = []

    def report() -> None:
        if not reported:
            reported.append(True)
            messages, collectives = (_stream.messages, _stream.collectives) if _stream is not None else (0, 0)
            rank = os.environ.get("RANK", 0)
            line = (f"sync_sends: rank {rank}: {messages} messages, each taken before the next began, and "
                    f"{collectives} collectives in the same stream")
            sys.stderr.flush()
            os.write(2, f"{line}\n".encode())  # one write: the ranks share stderr, and unbuffered print() writes the
            # line's end apart, so another rank's line could land in between

    def exit_(status: int) -> None:
        report()
        real_exit(status)
    os._exit = exit_
    atexit.register(report)


def wrapped(cmds: list[list[str]], script: Path) -> list[list[str]]:
    """The same launch with `script` run through this file: tests use it on tour.Step.commands()."""
    here = str(Path(__file__).resolve())
    return [[*cmd[:cmd.index(str(script))], here, *cmd[cmd.index(str(script)):]] for cmd in cmds]


REPORT = re.compile(r"^sync_sends: rank (\d+): (\d+) messages, .* and (\d+) collectives", re.M)


def messages(stderr: str) -> dict[int, int]:
    """{rank: messages it ran through the stream}, from a run's stderr (empty: the emulation was not used)."""
    return {int(rank): int(n) for rank, n, _ in REPORT.findall(stderr)}


def collectives(stderr: str) -> dict[int, int]:
    """{rank: collectives it ran through the stream}, from a run's stderr (empty: the emulation was not used)."""
    return {int(rank): int(n) for rank, _, n in REPORT.findall(stderr)}


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: sync_sends.py SCRIPT [ARGS...]")
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path[0] = str(script.parent)  # as `python SCRIPT` would: its folder first (check.py imports allreduce.py)
    install()
    _report_at_exit()
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
