"""12_context_parallel/train.py: ring attention and all-gather attention give one process's attention, exactly; in
bfloat16 as closely as torch's own attention; with the same work on every rank under the zigzag split; and a step
that makes nothing on the host.

One launch does most of it: this file run as a script through tests/sync_sends.py, so that the ring's messages keep
NCCL's rules (a send is done only once it is received; one message at a time, in order) and an order of messages that
waits on itself hangs here instead of passing on gloo. It imports torch once and forks 4 processes (importing torch
costs ~3 s of CPU a process here), which meet in a FileStore (no port); every rank writes a JSON report, and the tests
below read them:

- cp = 2 (two groups at once, ranks [0, 2] and [1, 3]: their ranks within the group are not their global ranks),
  cp = 3 (ranks [1, 2, 3]) and cp = 4 (all): causal or not, zigzag or not, float64, batch 2, 3 heads of size 5, on
  inputs drawn from a seed chosen per run: the output and the gradients of q, k and v, reassembled from every rank's
  share, equal F.scaled_dot_product_attention of the whole sequence in one process to 1e-12;
- planted bugs, each the stage's source with one edit, run at cp = 4 on the very inputs where it passes: each must
  be off by more than 1e-3;
- bfloat16 inputs at cp = 2 and 4, [1, 2, 2048, 64]: the relative error of the output and of the three gradients
  against float64 no worse than F.scaled_dot_product_attention's in bfloat16 on the same inputs (x 1.25), the ring
  also under torch.autocast, as --amp bf16 runs it; planted, the ring computing and summing in bfloat16 (as it did
  before 2026-11-27) fails it;
- the work of each rank, counted (torch's FlopCounterMode: the multiply-adds of its matrix products, forward and
  backward apart), at cp 2, 3 and 4: equal under zigzag, rank r doing r + 1 times rank 0's without; planted, a
  zigzag that gives rank r chunks r and r + cp (attention still exact) fails it;
- the negative control of the message order: each hop's send and receive posted in turn instead of as one batch
  hangs (until a group timeout of HANG seconds), where plain gloo would run it;
- the bytes each call hands to torch.distributed (tools.cli.SentBytes counts them at the calls), against what its
  algorithm must send, in float64 and in bfloat16 (whose gradients travel in float32).

And one more process, tests/host_copies.py: a step of 11's and 12's GPT on the meta device makes no tensor on the
host and copies none from it (not even a scalar), and 12's masks are built once per shape; its planted controls
are seen as what they plant.

    pytest tests/test_ring_attention.py -s      also prints what was seen (errors, counts)

Rerun with a failing seed: RING_ATTENTION_SEED=<seed> pytest tests/test_ring_attention.py
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
import traceback
import types
from datetime import timedelta
from pathlib import Path

import pytest

from harness import ROOT, Run, check, edited, launch_commands, run_command, time_limit

RING = ROOT / "12_context_parallel" / "context_parallel.py"  # ring attention: its own file, torch alone
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
     [("yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), causal and kc == qc",
       "yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), False")]),
    ("the skip reversed: visible blocks skipped, hidden ones computed", "ring_attention",
     [("if not causal or kc <= qc:", "if not causal or kc >= qc:")]),
    ("the ring one hop short (cp - 1 steps)", "ring_attention",
     [("one send and receive a hop\n        for step in range(cp):",
       "one send and receive a hop\n        for step in range(cp - 1):")]),
    ("backward without the rowsum(dO * O) term", "ring_attention",
     [("ds = p * (dp - delta[..., rows, None])", "ds = p * dp")]),
    ("dk, dv kept by the last rank instead of sent home", "ring_attention",
     [("dk, dv = dkv  #", "dk, dv = part  #")]),
    ("all-gather's backward without the reduction", "allgather_attention",
     [("dist.reduce_scatter(shard, parts, group=ctx.group)",
       "shard.copy_(parts[dist.get_rank(ctx.group)])")]),
]
# bfloat16: the ring as it was before 2026-11-27, computing and summing in the inputs' dtype (the control).
NARROW = [("return torch.promote_types(dtype, torch.float32)", "return dtype")]
BF16 = {"shape": (1, 2, 2048, 64), "groups": (2, 4), "margin": 1.25}  # the shape; cp 2 and 4
# The balance: a zigzag that gives rank r chunks r and r + cp, one early and one in the middle: still every chunk
# once, so attention stays exact, but rank r's queries see 2r + cp + 2 chunks' keys instead of 2 cp + 1.
UNEVEN = [("return rank, 2 * cp - 1 - rank", "return rank, rank + cp")]
# The negative control of the message order (the end of worker()): ring_hop's send and receive posted one after the
# other, in the batch's order (the send first), instead of together.
IN_TURN = ("dist.batch_isend_irecv(", "(lambda ops: [op.op(op.tensor, op.peer, op.group) for op in ops])(")
HANG = 2  # seconds that group waits for a message before it fails


# ─── The tests: read the reports of the one launch ────────────────────────────────────────────────────────────────

def draw_seed() -> int:
    return int(os.environ.get("RING_ATTENTION_SEED") or random.SystemRandom().randrange(2**31))


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, list[dict], int]:
    out, seed = tmp_path_factory.mktemp("ring_attention"), draw_seed()
    cmd = [sys.executable, str(SYNC_SENDS), __file__, "--seed", str(seed), "--store", str(out / "store"), "--out",
           str(out)]
    run = check(launch_commands([cmd], out, timeout=time_limit(programs=WORLD, waits=HANG)))  # the control waits HANG s
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
    print(f"\n{function}, float64, seed {seed}: the largest |difference| from one process over {len(found)} "
          f"(case, rank) results: {max(max(c['errors'].values()) for c in found):.1e}")


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
    errors = [max(m["errors"].values()) for report in reports for m in report["mutations"]]
    print(f"\n{len(MUTATIONS)} planted bugs, cp 4, zigzag and not, every rank: off by {min(errors):.1f} to "
          f"{max(errors):.1f}")


def bf16_failures(precision: dict) -> list[str]:
    """Where a method's relative error in bfloat16 exceeds scaled_dot_product_attention's (x margin)."""
    sdpa = precision["sdpa"]
    return [f"{method} {name}: {error:.1e} > {BF16['margin']} x {sdpa[name]:.1e}"
            for method, errors in precision.items() if method != "sdpa"
            for name, error in errors.items() if not error <= BF16["margin"] * sdpa[name]]


def test_bfloat16_is_as_close_as_torchs_attention(launched):
    """bfloat16 inputs, the same inputs in float64 as the truth: the ring keeps its softmax statistics, sums and
    travelling gradients in float32, so its output and gradients are as close to the truth as one process's fused
    attention in bfloat16; the all-gather, which calls that attention, likewise. The control, the ring as it was
    (everything in bfloat16), is not."""
    _, reports, seed = launched
    assert not any(report["narrow_missing"] for report in reports), reports[0]["narrow_missing"]
    seen = [(report["rank"], p) for report in reports for p in report["bf16"]]
    assert sorted({p["cp"] for _, p in seen}) == list(BF16["groups"]) and len(seen) == 2 * WORLD, seen
    print(f"\nbfloat16 against float64, relative Frobenius error, {list(BF16['shape'])}, zigzag, seed {seed}")
    for rank, p in seen:
        assert not bf16_failures(p["correct"]), (seed, rank, p["cp"], bf16_failures(p["correct"]))
        assert bf16_failures(p["narrow"]), f"seed {seed}, rank {rank}, cp {p['cp']}: the bfloat16 ring passes"
        if rank == 0:  # (the other ranks of its groups saw the same)
            for method, errors in {**p["correct"], "ring, all in bf16": p["narrow"]["ring_attention"]}.items():
                print(f"  cp {p['cp']} {method:30} " + "  ".join(f"{k} {v:.1e}" for k, v in errors.items()))


def unbalanced(work: dict) -> list[str]:
    """Where the zigzag split's ranks of one group do different work, or the contiguous split's rank r does other
    than r + 1 times rank 0's (forward and backward apart)."""
    wrong = []
    for (cp, zigzag), by_rank in work.items():
        first = by_rank[0]
        for r, flops in by_rank.items():
            expected = [f if zigzag else (r + 1) * f for f in first]
            if flops != expected:
                wrong.append(f"cp {cp}, zigzag {zigzag}, rank {r}: {flops} against {expected}")
    return wrong


def work_by_group(reports: list[dict], key: str) -> dict:
    """{(cp, zigzag): {rank in the group: [forward, backward] FLOPs}} from the reports' `key` list."""
    work: dict = {}
    for report in reports:
        for w in report[key]:
            work.setdefault((w["cp"], w["zigzag"]), {})[w["group_rank"]] = [w["forward"], w["backward"]]
    return work


def test_zigzag_gives_every_rank_the_same_work(launched):
    """The work counted, not timed: the FLOPs of every matrix product a rank's attention runs (torch's
    FlopCounterMode), forward and backward. Zigzag, every rank of a group the same count, at cp 2, 3 and 4;
    contiguous, rank r computes r + 1 blocks of scores to rank 0's one. The control, a zigzag that gives rank r
    chunks r and r + cp, is exact (a planted bug above would say otherwise) and unbalanced."""
    _, reports, _ = launched
    work = work_by_group(reports, "work")
    assert sorted(work) == [(cp, z) for cp in GROUPS for z in (False, True)], sorted(work)
    assert all(len(by_rank) == cp for (cp, _), by_rank in work.items()), work
    assert not unbalanced(work), unbalanced(work)
    assert not any(report["uneven_missing"] for report in reports), reports[0]["uneven_missing"]
    planted = work_by_group(reports, "uneven_work")
    assert list(planted) == [(3, True)] and unbalanced(planted), planted
    assert all(report["uneven_error"] <= EXACT for report in reports if "uneven_error" in report), reports
    d, t = SHAPE[3], SHAPE[2]
    print(f"\nscore elements per rank and (batch, head), forward (FLOPs / 4d), t = {t}:")
    rows = [(f"cp {cp}, {'zigzag' if z else 'contiguous'}", w) for (cp, z), w in sorted(work.items())]
    for label, by_rank in [*rows, ("cp 3, planted: chunks r and r + cp", planted[3, True])]:
        per_pair = d * SHAPE[0] * SHAPE[1] * 4  # FLOPs per score element of one (batch, head) pair, forward
        print(f"  {label:36}: " + " / ".join(str(by_rank[r][0] // per_pair) for r in sorted(by_rank)))


def test_bytes_sent_per_call(launched):
    """The ring sends k and v cp - 1 times forward; backward, k and v cp - 1 times and dk, dv cp times (the last hop
    takes them home): 3 cp - 2 hops a step, 10 at cp = 4. In bfloat16 the keys and values travel in bfloat16, their
    gradients in float32 (twice the bytes). The all-gather sends cp - 1 shares of k and v each way (counted as a ring
    all-gather and reduce-scatter send them), the gradients likewise in float32."""
    _, reports, _ = launched
    cp = WORLD
    for report in reports:
        for dtype, sent in report["bytes"].items():
            share = sent["share"]  # one rank's k (or v) in bytes
            grad = share * (2 if dtype == "bfloat16" else 1)  # its gradient's, in float32 at least
            assert sent["ring_forward"] == 2 * (cp - 1) * share, (dtype, sent)
            assert sent["ring_backward"] == 2 * (cp - 1) * share + 2 * cp * grad, (dtype, sent)
            assert sent["allgather_forward"] == 2 * (cp - 1) * share, (dtype, sent)
            assert sent["allgather_backward"] == 2 * (cp - 1) * grad, (dtype, sent)


def test_every_rank_ran_its_messages_through_the_nccl_rules(launched):
    import sync_sends  # here, not at the top: it imports torch, which collecting this module does not need
    run, _, _ = launched
    counts = sync_sends.messages(run.stderr)
    assert sorted(counts) == list(range(WORLD)) and all(counts.values()), run.describe()


def test_sends_then_receives_in_turn_hang_under_nccls_rules(launched):
    """The negative control: the hop's send and receive posted apart, the send first, waits for ever on every rank
    (gloo alone would run it: a send there returns before it is received). So the batch in ring_hop is needed, and
    the emulation was in the way of the ring's messages. Each rank fails once its group's timeout, HANG, has passed
    (a hang, not a crash; its own clock). HANG is a configured wait, not a pace: a deadlock ends at any length, and
    the launch's time limit counts it (waits=HANG)."""
    _, reports, _ = launched
    for report in reports:
        assert report["serial_hop"].startswith("failed") and "was never taken" in report["serial_hop"], \
            report["serial_hop"]
        waited = float(report["serial_hop"].removeprefix("failed after ").split("s:", 1)[0])
        assert waited >= HANG - 0.05, report["serial_hop"]  # printed to 0.1 s


@pytest.fixture(scope="module")
def host_copies() -> dict:
    run = check(run_command([sys.executable, str(ROOT / "tests" / "host_copies.py"), "--device", "meta"],
                            timeout=time_limit()))
    return json.loads(run.stdout)


def test_a_step_makes_nothing_on_the_host(host_copies):
    """Two steps (forward, loss, backward) of 11's GPT, and of 12's at cp 2 with each attention and each split, on
    the meta device: no operation on a tensor on the CPU (a copy from the host, a mask or positions made there), and
    12's second step builds no mask (made once per shape). The planted controls, as the code was before: positions
    made on the host and copied every forward, the diagonal's mask made on the host and copied every layer, the
    mask made on the device but again every layer; and a scalar made on the host and copied every layer (two ways):
    each is seen in both steps as what it plants (its copy, or its masks), a step that merely fails does not count.
    A CPU scalar taken by value (as SDPA's seed on a GPU) is allowed."""
    from host_copies import problems  # here: it imports torch, which collecting this module does not need
    assert not problems(host_copies), problems(host_copies)
    print("\nops on host tensors per step: 0 in every case; planted: " +
          ", ".join(f"{name} {[len(s['host']) for s in steps]} (masks built {[s['tril'] for s in steps]})"
                    for name, steps in host_copies["planted"].items()))


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

    def one_process(q, k, v, dout, causal: bool) -> list[torch.Tensor]:
        """F.scaled_dot_product_attention of the whole sequence in this process: [out, dq, dk, dv]."""
        whole = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*whole, is_causal=causal)
        out.backward(dout)
        return [out.detach(), *(x.grad for x in whole)]

    def split(module: types.ModuleType, function: str, group, cp: int, causal: bool, zigzag: bool, q, k, v, dout,
              autocast: bool = False) -> list[torch.Tensor]:
        """The same through `module`'s `function` (ring_attention, allgather_attention), each rank on its share;
        every rank's results put back at their tokens' places, in float64: [out, dq, dk, dv], whole."""
        me = dist.get_rank(group)
        share = [module.split_sequence(x, cp, me, zigzag, dim=2).requires_grad_() for x in (q, k, v)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # as the stage runs --amp bf16
            out = getattr(module, function)(*share, group, causal, zigzag)
        out.backward(module.split_sequence(dout, cp, me, zigzag, dim=2))
        joined = []
        for mine in [out.detach(), *(x.grad for x in share)]:
            shares = [torch.empty_like(mine) for _ in range(cp)]
            dist.all_gather(shares, mine.contiguous(), group=group)
            whole = torch.empty(q.shape, dtype=torch.float64)
            for r, part in enumerate(shares):
                whole[..., module.local_positions(q.shape[2], cp, r, zigzag), :] = part.double()
            joined.append(whole)
        return joined

    def errors(module: types.ModuleType, function: str, group, cp: int, causal: bool, zigzag: bool) -> dict:
        """Max |difference| of the output and of q, k, v's gradients, reassembled, from one process's attention."""
        q, k, v, dout = inputs(cp, causal, zigzag)
        found = {}
        for name, got, expected in zip(("out", "dq", "dk", "dv"),
                                       split(module, function, group, cp, causal, zigzag, q, k, v, dout),
                                       one_process(q, k, v, dout, causal), strict=True):
            error = (got - expected).abs().max().item()
            found[name] = error if math.isfinite(error) else math.inf  # NaN compares as "small": make it large
        return found

    def flops(module: types.ModuleType, group, cp: int, zigzag: bool, whole: list[torch.Tensor]) -> dict:
        """This rank's FLOPs of causal ring attention on its share of `whole` (q, k, v), forward and backward."""
        from torch.utils.flop_counter import FlopCounterMode
        me = dist.get_rank(group)
        share = [module.split_sequence(x, cp, me, zigzag, dim=2).requires_grad_() for x in whole]
        with FlopCounterMode(display=False) as forward:
            out = module.ring_attention(*share, group, True, zigzag)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
        return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}

    def bf16_errors(module: types.ModuleType, control: types.ModuleType, group, cp: int, seed: int) -> dict:
        """Relative Frobenius errors (out, dq, dk, dv) against float64 of: one process's fused attention in bfloat16,
        `module`'s two methods in bfloat16 (correct) and `control`'s ring (narrow)."""
        g = torch.Generator().manual_seed(seed * 10 + cp)
        q, k, v, dout = (torch.randn(BF16["shape"], generator=g, dtype=torch.float64) for _ in range(4))

        def relative(results: list[torch.Tensor], truth: list[torch.Tensor]) -> dict:
            return {name: ((a.double() - b).norm() / b.norm()).item()
                    for name, a, b in zip(("out", "dq", "dk", "dv"), results, truth, strict=True)}

        truth = one_process(q, k, v, dout, True)
        low = [x.bfloat16() for x in (q, k, v, dout)]

        def ours(mod: types.ModuleType, function: str, autocast: bool = False) -> dict:
            return relative(split(mod, function, group, cp, True, True, *low, autocast=autocast), truth)

        sdpa = relative(one_process(*low, True), truth)
        correct = {"sdpa": sdpa, **{function: ours(module, function) for function in FUNCTIONS},
                   "ring_attention under autocast": ours(module, "ring_attention", autocast=True)}
        return {"correct": correct, "narrow": {"sdpa": sdpa, "ring_attention": ours(control, "ring_attention")}}

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

    # bfloat16: the same inputs in float64 (the truth), in bfloat16 through one process's fused attention, through
    # the ring and the all-gather, and through the ring computing in bfloat16 (the control).
    narrow = load_ring(NARROW)
    report["bf16"], report["narrow_missing"] = [], narrow if isinstance(narrow, str) else None
    for cp in BF16["groups"]:
        for ranks, group in groups[cp]:
            if rank in ranks and report["narrow_missing"] is None:
                report["bf16"].append({"cp": cp, **bf16_errors(ring, narrow, group, cp, args.seed)})

    # The work of each rank, counted: forward and backward FLOPs of the matrix products, at every cp and split; and
    # the planted uneven zigzag at cp 3 (its attention must stay exact: the imbalance is all it changes).
    report["work"] = [{"cp": cp, "zigzag": zigzag, "group_rank": dist.get_rank(group),
                       **flops(ring, group, cp, zigzag, inputs(cp, True, zigzag)[:3])}
                      for cp in GROUPS for ranks, group in groups[cp] if rank in ranks for zigzag in (False, True)]
    uneven, report["uneven_work"] = load_ring(UNEVEN), []
    report["uneven_missing"] = uneven if isinstance(uneven, str) else None
    for ranks, group in groups[3]:
        if rank in ranks and report["uneven_missing"] is None:
            report["uneven_work"].append({"cp": 3, "zigzag": True, "group_rank": dist.get_rank(group),
                                          **flops(uneven, group, 3, True, inputs(3, True, True)[:3])})
            report["uneven_error"] = max(errors(uneven, "ring_attention", group, 3, True, True).values())

    # Bytes of one call, forward and backward apart, at cp = 4, in float64 and bfloat16: counted where the module
    # calls torch.distributed.
    from tools.cli import SentBytes
    counted = load_ring()
    counted.dist = counter = SentBytes()
    report["bytes"] = {}
    for dtype in (torch.float64, torch.bfloat16):
        q, k, v = (ring.split_sequence(x.to(dtype), WORLD, rank, True, dim=2).requires_grad_()
                   for x in inputs(WORLD, True, True)[:3])
        sent = report["bytes"][str(dtype).removeprefix("torch.")] = {"share": k.numel() * k.element_size()}
        for function in FUNCTIONS:
            before = counter.sent
            out = getattr(counted, function)(q, k, v, world, True, True)
            middle = counter.sent
            out.sum().backward()
            prefix = function.split("_")[0]
            sent[f"{prefix}_forward"], sent[f"{prefix}_backward"] = middle - before, counter.sent - middle

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
