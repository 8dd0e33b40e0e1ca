"""Stage 10's pipeline schedules as tables: the order in which each rank runs its forwards (F) and backwards (B, and
under ZB-H1 the weights' gradients W) of every micro-batch, and a clock to play a table out on.

GPipe and 1F1B are by_hand.py's, with the stage named; interleaved 1F1B and ZB-H1 are new (schedules.py runs them).
The clock gives each computation its slots (F 1, a whole backward 2, B and W 1 each) and makes it wait for its input:
what p even stages on p devices would do. schedules.py plans its messages on it; the tests check the bubble on it.
"""
from __future__ import annotations

Action = tuple[str, int, int]  # (kind, stage, micro-batch): kind F (forward), B (backward; ZB-H1: input only), W


def stages_of(rank: int, p: int, v: int) -> list[int]:
    """The stages a rank holds: round-robin, rank r holds r, r + p, r + 2p, ... so that stage s + 1 is on the next
    rank, and the last rank's output goes round to rank 0."""
    return [rank + chunk * p for chunk in range(v)]


def gpipe(m: int, rank: int, p: int, v: int = 1) -> list[Action]:
    return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]


def one_f_one_b(m: int, rank: int, p: int, v: int = 1) -> list[Action]:
    warmup = min(p - rank - 1, m)
    order = [("F", rank, i) for i in range(warmup)]
    for i in range(warmup, m):
        order += [("F", rank, i), ("B", rank, i - warmup)]
    return order + [("B", rank, i) for i in range(m - warmup, m)]


def interleaved(m: int, rank: int, p: int, v: int) -> list[Action]:
    """Megatron's order, as torch's ScheduleInterleaved1F1B gives it: the micro-batches in rounds of p, each round
    forward through this rank's stages in turn (backward: the last stage first). The warm-up fills the whole ring once
    (v - 1 rounds) and two more per rank downstream, then one forward and one backward in turn."""
    mine, total = stages_of(rank, p, v), v * m
    warmup = min((v - 1) * p + 2 * (p - 1 - rank), total)
    done = {"F": dict.fromkeys(mine, 0), "B": dict.fromkeys(mine, 0)}  # micro-batches each stage has run

    def next_one(kind: str, k: int) -> Action:  # the k-th forward, or backward, of this rank
        chunk = (k // p) % v
        stage = mine[chunk if kind == "F" else v - 1 - chunk]
        done[kind][stage] += 1
        return kind, stage, done[kind][stage] - 1
    order = [next_one("F", k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [next_one("F", k), next_one("B", k - warmup)]
    return order + [next_one("B", k) for k in range(total - warmup, total)]


def zb_h1(m: int, rank: int, p: int, v: int = 1) -> list[Action]:
    """1F1B with each backward split: B at once, its W `rank` backwards later (ZB-H1; torch's zero-bubble order at
    v = 1). Rank r holds r more micro-batches than in 1F1B: p on every rank, as 1F1B's rank 0."""
    warmup = min(p - rank - 1, m)
    order = [("F", rank, i) for i in range(warmup)]

    def backward(j: int) -> list[Action]:
        return [("B", rank, j)] + ([("W", rank, j - rank)] if j >= rank else [])
    for i in range(warmup, m):
        order += [("F", rank, i), *backward(i - warmup)]
    for j in range(m - warmup, m):
        order += backward(j)
    return order + [("W", rank, j) for j in range(max(m - rank, 0), m)]  # the deferred ones, in the cool-down


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zbh1": zb_h1}


def slot_clock(orders: list[list[Action]], n_stages: int) -> dict[Action, tuple[float, float]]:
    """Every rank's order played out with a forward taking 1 slot, a whole backward 2, B and W 1 each, each waiting
    for its input: (start, end) of every action. Every rank computes it for all, so all agree when messages travel."""
    split = any(kind == "W" for order in orders for kind, _, _ in order)
    slots = {"F": 1.0, "B": 1.0 if split else 2.0, "W": 1.0}
    when: dict[Action, tuple[float, float]] = {}
    free, position = [0.0] * len(orders), [0] * len(orders)
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            if position[r] == len(order):
                continue
            kind, s, m = order[position[r]]
            needs = {"F": ("F", s - 1, m) if s > 0 else None, "W": ("B", s, m),
                     "B": ("B", s + 1, m) if s < n_stages - 1 else ("F", s, m)}[kind]
            if needs is not None and needs not in when:
                continue
            start = max(free[r], when[needs][1] if needs else 0.0)
            when[kind, s, m] = (start, start + slots[kind])
            free[r], position[r], progressed = start + slots[kind], position[r] + 1, True
        if not progressed:
            raise ValueError(f"the schedule waits on itself: rank {r} at {order[position[r]]}")
    return when
