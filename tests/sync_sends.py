"""Run a script with torch.distributed's point-to-point messages made synchronous and in order, as NCCL runs them.

    torchrun --standalone --nproc_per_node=2 tests/sync_sends.py 10_pipeline_parallel/by_hand.py --schedule 1f1b
    python tests/sync_sends.py SCRIPT [ARGS...]

gloo buffers a send: the bytes leave at once and wait at the receiver until it posts its receive, so an order of
messages that waits on itself runs on gloo and hangs on NCCL. There, above its eager size (a few hundred KiB), a send
completes only once the receiver has posted the matching receive, and the point-to-point messages of a communicator run
one after another, in the order they were posted, on one stream. Before running SCRIPT (runpy, as __main__), this
replaces dist.isend, irecv, send, recv and batch_isend_irecv with versions on top of gloo that keep those rules:

- each process has one stream, a thread that runs its messages one at a time in the order they were posted; isend
  and irecv return at once, and their work is done when the stream has run them;
- a send is done only once the receiver has taken it: the receiver answers with an acknowledgement (a message on a
  tag of its own), and the stream waits for it before it starts the next message;
- a batch_isend_irecv is one item of the stream: its messages run at once, and it is done when all of them are (a
  receive is acknowledged as soon as it arrives), so a send and a receive of one batch never wait on each other;
- the messages from one process to another are matched in the order they were posted, whatever their tags (NCCL
  ignores tags); collectives (all_reduce, all_gather_object, ...) are left alone.

So an order that can wait on itself waits here until the process group's timeout, and fails with gloo's "Timed out"
error, prefixed with "sync_sends:" and the message that was never taken. At exit each process says on stderr how
many messages it ran this way ("sync_sends: rank R: N messages"), so a test can see the emulation was in the way.
One stream for all of a process's messages, whatever their group or peer, is at least as strict as NCCL's stream per
communicator. CPU tensors only (gloo).
"""
from __future__ import annotations

import atexit
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


class Work:
    """What the emulated isend, irecv and batch_isend_irecv return: done when the stream has run the message(s)."""

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
    """This process's point-to-point messages, run one item at a time in the order they were posted."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()
        self.numbers: defaultdict = defaultdict(count)  # (group, peer, "send" or "recv") -> the next message's number
        self.error: str | None = None  # the first failure: every later item fails with it, as a broken stream does
        self.messages = 0
        threading.Thread(target=self._loop, name="sync_sends", daemon=True).start()

    def post(self, ops: list[tuple[str, torch.Tensor, int, object]]) -> Work:
        """ops: (send or recv, tensor, peer's global rank, group), run at once as one item; returns its work."""
        work = Work()
        self.items.put((ops, work))
        return work

    def _loop(self) -> None:
        while True:
            ops, work = self.items.get()
            if self.error is None:
                try:
                    self._run_together(ops)
                except Exception as e:  # gloo's timeout, mostly
                    self.error = f"sync_sends: rank {dist.get_rank()}: {e}"
            work.error = self.error
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


def install() -> None:
    """Replace the point-to-point calls in torch.distributed and in its c10d module (P2POp checks the latter's)."""
    for fn in (isend, irecv, send, recv, batch_isend_irecv):
        setattr(c10d, fn.__name__, fn)
        setattr(dist, fn.__name__, fn)


def _report_at_exit() -> None:
    """At exit (by os._exit, as the stages leave, or normally), one line on stderr: how many messages this process ran
    through the stream. A test reads it to know the emulation was in the way, not bypassed."""
    real_exit = os._exit
    reported = []

    def report() -> None:
        if not reported:
            reported.append(True)
            messages = _stream.messages if _stream is not None else 0
            rank = os.environ.get("RANK", 0)
            line = f"sync_sends: rank {rank}: {messages} messages, each taken before the next began"
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


REPORT = re.compile(r"^sync_sends: rank (\d+): (\d+) messages", re.M)


def messages(stderr: str) -> dict[int, int]:
    """{rank: messages it ran through the stream}, from a run's stderr (empty: the emulation was not used)."""
    return {int(rank): int(n) for rank, n in REPORT.findall(stderr)}


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
