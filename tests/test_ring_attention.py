"""12_context_parallel/train.py: ring attention and all-gather attention give one process's attention, exactly.

One launch does everything: this file run as a script through tests/sync_sends.py, so that the ring's messages keep
NCCL's rules (a send is done only once it is received; one message at a time, in order) and an order of messages that
waits on itself hangs here instead of passing on gloo. It imports torch once and forks 4 processes (importing torch
costs ~3 s of CPU a process here), which meet in a FileStore (no port); every rank writes a JSON report, and the tests
below read them:

- cp = 2 (two groups at once, ranks [0, 2] and [1, 3]: their ranks within the group are not their global ranks),
  cp = 3 (ranks [1, 2, 3]) and cp = 4 (all): causal or not, zigzag or not, float64, batch 2, 3 heads of size 5, on
  inputs drawn from a seed chosen per run: the output and the gradients of q, k and v, reassembled from every rank's
  share, equal F.scaled_dot_product_attention of the whole sequence in one process to 1e-12 (seen: ~1e-15);
- planted bugs, each the stage's source with one edit, run at cp = 4 on the very inputs where it passes: each must
  be off by more than 1e-3;
- the negative control of the message order: each hop's send and receive posted in turn instead of as one batch
  hangs (until a group timeout of HANG seconds), where plain gloo would run it;
- the bytes each call hands to torch.distributed (tools.cli.SentBytes counts them at the calls), against what its
  algorithm must send;
- each rank's compute time at cp = 4, causal, with and without zigzag: printed, never asserted (a test is no
  benchmark: benchmarks/cp_balance.py is).

Rerun with a failing seed: RING_ATTENTION_SEED=<seed> pytest tests/test_ring_attention.py
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path

import pytest

from harness import ROOT, Run, check, edited, launch_commands

RING = ROOT / "12_context_parallel" / "train.py"  # ring attention is in its lesson
SYNC_SENDS = ROOT / "tests" / "sync_sends.py"
WORLD = 4
GROUPS = {2: [[0, 2], [1, 3]], 3: [[1, 2, 3]], 4: [[0, 1, 2, 3]]}  # cp -> its groups (every rank creates all of them)
SHAPE = (2, 3, 24, 5)  # batch, heads, time (divisible by 2 * cp for cp = 2, 3, 4), head size
EXACT, WRONG = 1e-12, 1e-3
FUNCTIONS = ("ring_attention", "allgather_attention")

# Planted bugs: (name, the function they break, [(text of train.py, its replacement)]). Each must be caught. They are
# edits of the source, so the stage carries no switch for them (the lesson's code stays as a reader reads it).
MUTATIONS = [
    ("old sums not rescaled to the new maximum", "ring_attention",
     [("acc[..., rows, :] = acc[..., rows, :] * alpha[..., None] + p @",
       "acc[..., rows, :] = acc[..., rows, :] + p @")]),
    ("the diagonal block left unmasked", "ring_attention",
     [("mask = None if kp.max() <= qp.min() else kp[None, :] <= qp[:, None]", "mask = None")]),
    ("the skip reversed: visible blocks skipped, hidden ones computed", "ring_attention",
     [("if kp.min() > qp.max():", "if kp.max() < qp.min():")]),
    ("the ring one hop short (cp - 1 steps)", "ring_attention",
     [("one receive per hop\n        for step in range(cp):",
       "one receive per hop\n        for step in range(cp - 1):")]),
    ("backward without the rowsum(dO * O) term", "ring_attention",
     [("ds = p * (dp - delta[..., rows, None])", "ds = p * dp")]),
    ("dk, dv kept by the last rank instead of sent home", "ring_attention",
     [("dk, dv = dkv  #", "dk, dv = mine  #")]),
    ("all-gather's backward without the reduction", "allgather_attention",
     [("dist.reduce_scatter(mine, parts, group=ctx.group)",
       "mine.copy_(parts[dist.get_rank(ctx.group)])")]),
]
# The negative control of the message order (the end of worker()): ring_hop's send and receive posted one after the
# other, in the batch's order (the send first), instead of together.
IN_TURN = ("dist.batch_isend_irecv(", "(lambda ops: [op.op(op.tensor, op.peer, op.group) for op in ops])(")
HANG = 2  # seconds that group waits for a message before it fails
TIMING = {"shape": (1, 4, 1024, 32), "repeats": 5}  # cp = 4, causal, float32: each rank holds 256 tokens


# ─── The tests: read the reports of the one launch ────────────────────────────────────────────────────────────────

def draw_seed() -> int:
    return int(os.environ.get("RING_ATTENTION_SEED") or random.SystemRandom().randrange(2**31))


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, list[dict], int]:
    out, seed = tmp_path_factory.mktemp("ring_attention"), draw_seed()
    cmd = [sys.executable, str(SYNC_SENDS), __file__, "--seed", str(seed), "--store", str(out / "store"), "--out",
           str(out)]
    run = check(launch_commands([cmd], out, timeout=300))
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    return run, reports, seed


def cases(reports: list[dict], function: str) -> list[dict]:
    return [case for report in reports for case in report["cases"] if case["function"] == function]


@pytest.mark.parametrize("function", FUNCTIONS)
def test_equals_one_process_attention(launched, function):
    _, reports, seed = launched
    found = cases(reports, function)
    assert {(c["cp"], c["causal"], c["zigzag"]) for c in found} == \
        {(cp, causal, zigzag) for cp in GROUPS for causal in (False, True) for zigzag in (False, True)}
    bad = [c for c in found if not max(c["errors"].values()) <= EXACT]
    assert not bad, f"seed {seed} (RING_ATTENTION_SEED={seed} reruns it): {len(bad)} of {len(found)} " \
                    f"(case, rank) results off, e.g. {bad[:3]}"


def test_positions_cover_the_sequence_once(launched):
    _, reports, _ = launched
    assert all(report["positions_ok"] for report in reports), [r["positions_ok"] for r in reports]


def test_planted_bugs_are_caught(launched):
    _, reports, seed = launched
    correct = {(c["function"], c["zigzag"]): max(c["errors"].values())
               for c in cases(reports, "ring_attention") + cases(reports, "allgather_attention")
               if c["cp"] == 4 and c["causal"]}
    for report in reports:
        assert [m["name"] for m in report["mutations"]] == [name for name, _, _ in MUTATIONS for _ in (False, True)]
        for m in report["mutations"]:
            assert "missing" not in m, f"planted bug {m['name']!r}: {m['missing']}"
            assert correct[(m["function"], m["zigzag"])] <= EXACT, f"seed {seed}: the stage fails on these inputs"
            error = max(m["errors"].values())
            assert not error <= WRONG, f"seed {seed}, rank {report['rank']}: {m['name']} (zigzag {m['zigzag']}) " \
                                       f"is off by only {error:.1e}: {m['errors']}"


def test_bytes_sent_per_call(launched):
    """The ring sends k and v cp - 1 times forward; backward, k and v cp - 1 times and dk, dv cp times (the last hop
    takes them home): 2 cp - 1 hops, 7 at cp = 4 against 3. The all-gather sends cp - 1 shares of k and v each way
    (counted as a ring all-gather and reduce-scatter send them)."""
    _, reports, _ = launched
    for report in reports:
        sent, share = report["bytes"], report["bytes"]["share"]  # one rank's k (or v) in bytes
        cp = WORLD
        assert sent["ring_forward"] == 2 * (cp - 1) * share and sent["ring_backward"] == 2 * (2 * cp - 1) * share
        assert sent["allgather_forward"] == sent["allgather_backward"] == 2 * (cp - 1) * share


def test_every_rank_ran_its_messages_through_the_nccl_rules(launched):
    import sync_sends  # here, not at the top: it imports torch, which collecting this module does not need
    run, _, _ = launched
    counts = sync_sends.messages(run.stderr)
    assert sorted(counts) == list(range(WORLD)) and all(counts.values()), run.describe()


def test_sends_then_receives_in_turn_hang_under_nccls_rules(launched):
    """The negative control: the hop's send and receive posted apart, the send first, waits for ever on every rank
    (gloo alone would run it: a send there returns before it is received). So the batch in ring_hop is needed, and
    the emulation was in the way of the ring's messages."""
    _, reports, _ = launched
    for report in reports:
        assert report["serial_hop"].startswith("failed") and "was never taken" in report["serial_hop"], \
            report["serial_hop"]


def test_zigzag_balance_is_printed(launched):
    """Compute time (CPU time of each rank's main thread: waiting on messages is not counted) of a forward at cp = 4,
    causal: printed for the reader of the log. Without zigzag the last rank computes 4 blocks to the first rank's 1
    (it measures less than 4x: each step's fixed costs); with it, every rank computes half a block a step."""
    _, reports, _ = launched
    print(f"\nring attention forward, cp = {WORLD}, causal, [b, h, t, d] = {list(TIMING['shape'])}, float32, "
          f"median of {TIMING['repeats']} (ms of CPU per rank)")
    for zigzag in (False, True):
        ms = [report["timing"][str(zigzag)] * 1e3 for report in reports]
        print(f"  zigzag {str(zigzag):5}: " + "  ".join(f"rank {r} {t:6.2f}" for r, t in enumerate(ms)) +
              f"   max/min {max(ms) / min(ms):.2f}")
        assert all(t > 0 for t in ms)


# ─── The worker: one of the 4 processes ───────────────────────────────────────────────────────────────────────────

def load_ring(edits: list[tuple[str, str]] = ()) -> types.ModuleType | str:
    """The stage's train.py as a fresh module, with `edits` made to its source (a planted bug); or why an edit could
    not be made. Its ring attention is written out in its lesson; importing it trains nothing (main() is not called)."""
    try:
        text = edited(RING, edits)
    except AssertionError as e:  # reported by the test that planted it
        return str(e)
    module = types.ModuleType("ring_variant")
    module.__file__ = str(RING)
    exec(compile(text, str(RING), "exec"), module.__dict__)
    return module


def launcher(args: argparse.Namespace) -> None:
    """Import torch, then fork ranks 1..3 (this process is rank 0); exit 1 if any rank failed."""
    import torch  # noqa: F401 (imported once, here: the forked ranks have it)

    rank, children = 0, []
    for r in range(1, WORLD):
        pid = os.fork()
        if pid == 0:
            rank, children = r, []
            break
        children.append(pid)
    os.environ["RANK"] = str(rank)  # sync_sends's report at exit names the process by it
    failed = False
    try:
        worker(rank, args)
    except BaseException:
        traceback.print_exc()
        failed = True
    for pid in children:
        failed |= os.waitpid(pid, 0)[1] != 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)  # no interpreter teardown: it can abort gloo's threads (03_ddp_spawn/README.md)


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(1)  # 4 processes on the machine's cores: one thread each
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    ring = load_ring()
    groups = {cp: [(ranks, dist.new_group(ranks)) for ranks in GROUPS[cp]] for cp in GROUPS}  # all, in one order
    report: dict = {"rank": rank, "seed": args.seed, "cases": [], "mutations": []}

    def inputs(cp: int, causal: bool, zigzag: bool) -> list[torch.Tensor]:
        """q, k, v and the output's gradient, whole: the same on every rank (and for every function)."""
        g = torch.Generator().manual_seed(args.seed * 100 + cp * 4 + causal * 2 + zigzag)
        return [torch.randn(SHAPE, generator=g, dtype=torch.float64) for _ in range(4)]

    def errors(module: types.ModuleType, function: str, group, cp: int, causal: bool, zigzag: bool) -> dict:
        """Max |difference| of the output and of q, k, v's gradients, reassembled, from one process's attention."""
        q, k, v, dout = inputs(cp, causal, zigzag)
        whole = [x.clone().requires_grad_() for x in (q, k, v)]
        reference = F.scaled_dot_product_attention(*whole, is_causal=causal)
        reference.backward(dout)
        me = dist.get_rank(group)
        share = [module.split_sequence(x, cp, me, zigzag, dim=2).requires_grad_() for x in (q, k, v)]
        out = getattr(module, function)(*share, group, causal, zigzag)
        out.backward(module.split_sequence(dout, cp, me, zigzag, dim=2))
        found = {}
        for name, mine, expected in zip(("out", "dq", "dk", "dv"), [out.detach(), *(x.grad for x in share)],
                                        [reference.detach(), *(x.grad for x in whole)], strict=True):
            shares = [torch.empty_like(mine) for _ in range(cp)]
            dist.all_gather(shares, mine.contiguous(), group=group)
            joined = torch.empty_like(expected)
            for r, part in enumerate(shares):  # every rank's share back at its tokens' places
                joined[..., module.local_positions(SHAPE[2], cp, r, zigzag), :] = part
            error = (joined - expected).abs().max().item()
            found[name] = error if math.isfinite(error) else math.inf  # NaN compares as "small": make it large
        return found

    for cp, members in groups.items():
        for ranks, group in members:
            if rank in ranks:
                for causal in (False, True):
                    for zigzag in (False, True):
                        for function in FUNCTIONS:
                            report["cases"].append({"cp": cp, "causal": causal, "zigzag": zigzag, "function": function,
                                                    "errors": errors(ring, function, group, cp, causal, zigzag)})
    report["positions_ok"] = all(
        torch.equal(torch.cat([ring.local_positions(SHAPE[2], cp, r, z) for r in range(cp)]).sort().values,
                    torch.arange(SHAPE[2])) and
        torch.equal(ring.split_sequence(torch.arange(SHAPE[2]).expand(2, -1), cp, r, z),
                    ring.local_positions(SHAPE[2], cp, r, z).expand(2, -1))
        for cp in GROUPS for z in (False, True) for r in range(cp))

    world = dist.group.WORLD
    for name, function, edits in MUTATIONS:
        variant = load_ring(edits)
        for zigzag in (False, True):
            found = {"missing": variant} if isinstance(variant, str) else \
                {"errors": errors(variant, function, world, WORLD, True, zigzag)}
            report["mutations"].append({"name": name, "function": function, "zigzag": zigzag, **found})

    # Bytes of one call, forward and backward apart, at cp = 4: counted where the module calls torch.distributed.
    from tools.cli import SentBytes
    counted = load_ring()
    counted.dist = counter = SentBytes()
    q, k, v = (ring.split_sequence(x, WORLD, rank, True, dim=2).requires_grad_() for x in inputs(WORLD, True, True)[:3])
    sent = report["bytes"] = {"share": k.numel() * k.element_size()}
    for function in FUNCTIONS:
        before = counter.sent
        out = getattr(counted, function)(q, k, v, world, True, True)
        middle = counter.sent
        out.sum().backward()
        prefix = function.split("_")[0]
        sent[f"{prefix}_forward"], sent[f"{prefix}_backward"] = middle - before, counter.sent - middle

    # Each rank's compute, with and without zigzag (printed by the test, not asserted).
    g = torch.Generator().manual_seed(args.seed)
    whole = [torch.randn(TIMING["shape"], generator=g) for _ in range(3)]
    report["timing"] = {}
    for zigzag in (False, True):
        local = [ring.split_sequence(x, WORLD, rank, zigzag, dim=2) for x in whole]
        times = []
        for _ in range(1 + TIMING["repeats"]):  # the first one warms up
            start = time.thread_time()
            ring.ring_attention(*local, world, True, zigzag)
            times.append(time.thread_time() - start)
        report["timing"][str(zigzag)] = statistics.median(times[1:])

    # Last (a message that times out breaks sync_sends's stream for good): each hop's send and receive posted one
    # after the other, the send first, as NCCL must not see them. gloo would run it; here every rank's send waits for
    # a receive its neighbour never posts, until the group's short timeout.
    serial = load_ring([IN_TURN])
    impatient = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=HANG))
    q = ring.split_sequence(inputs(WORLD, True, True)[0], WORLD, rank, True, dim=2)
    start = time.monotonic()
    try:
        if isinstance(serial, str):
            raise RuntimeError(f"train.py no longer has {serial!r} (once)")
        serial.ring_attention(q, q, q, impatient, True, True)
        report["serial_hop"] = "ran"
    except RuntimeError as e:
        report["serial_hop"] = f"failed after {time.monotonic() - start:.1f}s: {e}"

    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    launcher(parser.parse_args())
