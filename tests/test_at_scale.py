"""at_scale/simulate.py: the simulation is the code.

One rank of a job, simulated in this process (the fake process group, fake tensors, the shims its output lists), is
what the same rank measures in a real gloo job of the same stage and layout, with the same counting
(simulate.measure on real tensors): the bytes of its parameters, gradients and AdamW's moments exactly, the bytes it
sends per collective and per dimension of the grid exactly (calls too), the FLOPs of its step exactly, and its
activation peak (torch's MemTracker, FSDPMemTracker for FSDP2, on real tensors there) within 5%. Layouts: DDP,
FSDP2, pp 2 (GPipe), pp 2 x dp 2 with 2 stages a rank (interleaved 1F1B, FSDP2), cp 2, tp 2 with sequence parallelism
(--sp), and pp 2 x cp 2 x tp 2 (1F1B, FSDP2) on 8 ranks; stage 14's experts over ep 2 of 4 ranks, whose real job
runs under the simulation's even load (compared exactly) and again under its router's own (compared where the load
does not matter: test_the_router_load).

The counting itself is checked against what the stage's design says, independently of the simulation: DDP's
all-reduce hands over every gradient once (at W = 2, as many bytes as the weights), its state is 16 bytes a weight
(weights, gradients, AdamW's two moments) plus AdamW's step counters, and tensor parallelism all-reduces six
activations a block a micro-batch (TP_PLAN: two forward, four backward), the rest being the gradient norm's scalars;
experts.py's all-to-alls carry each rank's share of an even load; interleaving sends across every boundary of the
2 pp stages of a rank.

The real jobs are one forked launch per layout (tests/harness.py forked_ranks); the simulations run in worker processes
of their own before the tests ask (harness.Early), at the lowest priority until a test wants them.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from harness import ROOT, check, forked_ranks, launch_commands, load_copy, time_limit

SIMULATE = ROOT / "at_scale" / "simulate.py"
MODEL = ("--layers", "2", "--width", "64", "--heads", "4", "--context", "32", "--vocab", "65")
LAYOUTS = {
    "ddp": ("--world", "2", "--accumulate", "2"),
    "fsdp": ("--world", "2", "--parallel", "fsdp"),
    "tp": ("--world", "2", "--parallel", "fsdp", "--tp", "2"),
    "pp": ("--world", "2", "--parallel", "fsdp", "--pp", "2", "--pp-schedule", "gpipe", "--accumulate", "3"),
    "cp": ("--world", "2", "--cp", "2"),
    "sp": ("--world", "2", "--parallel", "fsdp", "--tp", "2", "--sp"),  # --sp: SP_PLAN, SP_AROUND, loss_parallel
    # Interleaved 1F1B (Megatron's, Llama 3's): 4 stages of a block each, 2 a rank (pp rank p: stages p and p + 2),
    # over dp 2, so that FSDP2's gathers and reduce-scatters under torch's interleaved runtime are compared too; 8
    # micro-batches, so that the gradients a rank has sent back and still holds (the shim p2p_held) are more than 5% of
    # its peak (4: 2.3%, a simulation without the shim would pass).
    "interleaved": ("--world", "4", "--parallel", "fsdp", "--layers", "4", "--pp", "2", "--pp-schedule",
                    "interleaved1f1b", "--stages-per-rank", "2", "--accumulate", "8"),
    "pp_cp_tp": ("--world", "8", "--parallel", "fsdp", "--pp", "2", "--cp", "2", "--tp", "2", "--accumulate", "2"),
    # Stage 14: 4 experts, k = 2, shared out over ep 2 of the 4 dp ranks (two ep groups, each expert on two replicas).
    # 33 positions: 66 routed rows a micro-batch, which 4 experts cannot share evenly (17, 17, 16, 16), so that the two
    # ranks of an ep group exchange different shares and their counts' all-to-all matters.
    "ep": ("--world", "4", "--parallel", "fsdp", "--experts", "4", "--top-k", "2", "--ep", "2", "--accumulate", "2",
           "--context", "33"),
}
ACTIVATION_TOLERANCE = 0.05


def world_of(layout: str) -> int:
    flags = LAYOUTS[layout]
    return int(flags[flags.index("--world") + 1])


def checked_ranks(layout: str) -> list[int]:
    """Every rank of a 2-rank job; of a larger one, the first and last of each pipeline stage (the others differ
    from those only in where they sit in dp, cp and tp: 1.5 s of simulation each)."""
    world = world_of(layout)
    return list(range(world)) if world <= 2 else [0, world // 2 - 1, world // 2, world - 1]


def layout_worker(rank: int, world: int, store: str, out: str) -> None:
    """One rank of the real job: the flags the test wrote (flags.json), the measurement simulate.py makes, on real
    tensors in a gloo group; what it found in rank{R}.json. With experts, measured twice: under the even load the
    simulation assumes (its shim, here on real tensors), then again with the router's own load ("router_load")."""
    import torch.distributed as dist
    torch.set_num_threads(1)  # the ranks share the machine's cores
    simulate = load_copy(SIMULATE)
    flags = json.loads(Path(out, "flags.json").read_text())
    args = simulate.parse_args([*flags, "--rank", str(rank)], scratch=Path(out))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = simulate.measure(args, fake=False)
    if args.experts is not None:
        result["router_load"] = simulate.measure(args, fake=False, even_load=False)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def simulate():  # (the copy the early jobs load where they run here)
    return simulate_copy()


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Each layout's real job, launched once, on first use: every rank's measurement."""
    done: dict[str, list[dict]] = {}

    def of(layout: str) -> list[dict]:
        if layout not in done:
            out = tmp_path_factory.mktemp(layout)
            (out / "flags.json").write_text(json.dumps([*MODEL, *LAYOUTS[layout]]))
            done[layout] = forked_ranks("test_at_scale", "layout_worker", world_of(layout), out)
        return done[layout]
    return of


def simulated(simulate, layout: str, rank: int, tmp: Path | None = None) -> dict:
    return simulate.measure(simulate.parse_args([*MODEL, *LAYOUTS[layout], "--rank", str(rank)], scratch=tmp))


@functools.cache
def simulate_copy():
    return load_copy(SIMULATE)


def early_job(job: tuple[str, int]) -> dict:
    """A layout's rank, simulated (in the session's early workers: conftest.py, harness.Early)."""
    return simulated(simulate_copy(), *job)


@pytest.fixture(scope="module")
def sims(early_results):
    """Each rank's simulation of a layout (EARLY_JOBS, below), simulated once, before the tests ask."""
    done = dict(zip(EARLY_JOBS, early_results, strict=True))
    return lambda layout, rank: done[layout, rank]


def differences(sim: dict, real: dict) -> list[str]:
    """What the simulation says differently from the real run, in words (empty: they agree)."""
    found = []
    for key in ("state_bytes", "sent", "flops", "coords", "stages", "held_micro_batches"):
        if sim[key] != real[key]:
            found.append(f"{key}: simulated {sim[key]} | real {real[key]}")
    a, b = sim["activation_peak_bytes"], real["activation_peak_bytes"]
    if abs(a - b) > ACTIVATION_TOLERANCE * b:
        found.append(f"activation peak: simulated {a:,} | real {b:,} bytes ({a / b - 1:+.1%}); held then, simulated "
                     f"{sim['at_activation_peak']} | real {real['at_activation_peak']}")
    return found


# tp alone is simulated (test_tensor_parallel_all_reduces_six_activations_a_block), its real job left to pp_cp_tp's,
# whose ranks split every block over tp 2 as well: one launch fewer (the suite's time).
REAL = [layout for layout in LAYOUTS if layout != "tp"]
# The ranks simulated: those compared with a real job, every rank of the experts' (test_the_router_load), tp's first
EARLY_JOBS = [(layout, rank) for layout in REAL for rank in (range(world_of(layout)) if layout == "ep"
                                                               else checked_ranks(layout))] + [("tp", 0)]


@pytest.mark.parametrize("layout", REAL)
def test_the_simulation_measures_what_the_real_job_measures(simulate, real, sims, layout):
    """With experts, the real job runs under the even load too (the simulation's shim on real tensors: torch's own
    all-to-alls then carry its counts), so that everything is compared exactly, as on the other layouts: the shim's
    counting through fake tensors is torch's on real ones. What the even load changes is test_the_router_load's."""
    reals = real(layout)
    for rank in checked_ranks(layout):
        measured, sim = reals[rank], sims(layout, rank)
        assert not differences(sim, measured), f"{layout}, rank {rank}:\n" + "\n".join(differences(sim, measured))
        assert sim["assumed"] and measured["assumed"] == ([simulate.ASSUMED["even_load"]] if "--ep" in LAYOUTS[layout]
                                                          else [])
        if "fsdp" in LAYOUTS[layout]:  # FSDP2's gathered weights counted apart from its shards: every stage's too
            assert sim["memory_tracker"] == "FSDPMemTracker", (layout, sim["memory_tracker"])
        if "--sp" in LAYOUTS[layout]:  # the stage ran SP_PLAN: all-gathers and reduce-scatters over tp
            assert sim["sp"] and {"all_gather", "reduce_scatter"} <= {r["kind"] for r in sim["sent"]
                                                                      if r["dimension"] == "tp"}, sim["sent"]


def step_flops(sim: dict, tp: int = 1, expert_rows: int = 0) -> int:
    """The FLOPs of a rank's step as torch's FlopCounterMode counts them, from the model's shape: 2 a multiply-add,
    a matmul's backward twice its forward (6 per weight and token; the blocks' 12 w^2 weights split over tp, the head's
    w x vocab whole, the embeddings looked up), and the attention's scores and weighted sum 4 b t^2 w forward and 10
    backward (which computes the scores again), its heads split over tp. With experts (stage 14, tp 1 here), a block's
    MLP is a router (w x E) a token, and an expert's MLP (8 w^2) for each of the `expert_rows` rows this rank's experts
    take a micro-batch."""
    m, b = sim["model"], sim["micro_batch"]
    tokens = b * m["context"] * sim["accumulate"]
    block = 12 * m["width"] ** 2 if "experts" not in m else 4 * m["width"] ** 2 + m["width"] * m["experts"]
    matmul_weights = m["layers"] * block // tp + m["width"] * m["vocab"]
    experts = 6 * m["layers"] * sim["accumulate"] * expert_rows * 8 * m["width"] ** 2
    attention = 14 * m["layers"] * sim["accumulate"] * b * m["context"] ** 2 * m["width"] // tp
    return 6 * matmul_weights * tokens + attention + experts


def test_ddp_hands_over_every_gradient_once_and_holds_16_bytes_a_weight(simulate, sims):
    """Independent of the simulation: at W = 2 a ring all-reduce sends 2 (W - 1) / W = 1 times the gradients' bytes,
    and a DDP rank holds the weights, their gradients and AdamW's two moments, 4 bytes each a weight (float32), plus
    AdamW's step counter for every parameter tensor (a float32 scalar); its FLOPs are the model's (step_flops)."""
    sim = sims("ddp", 0)
    weights, tensors = sim["parameters"], len(simulate.stage().GPT(simulate.stage().Config(**sim["model"]))
                                                   .state_dict())
    assert sim["sent_bytes_by_dimension"] == {"dp_cp": 4 * weights}, sim["sent"]
    assert sim["state_bytes"] == {"parameters": 4 * weights, "gradients": 4 * weights,
                                  "optimizer": 8 * weights + 4 * tensors, "total": 16 * weights + 4 * tensors}
    assert sim["flops"] == step_flops(sim)


def test_tensor_parallel_all_reduces_six_activations_a_block(simulate, sims):
    """TP_PLAN (13_pipeline_4d/parallelize.py): per block and micro-batch, two all-reduces forward and four backward,
    each of an activation [micro-batch, context, width] in float32; at tp = 2 a ring sends its bytes once. One more
    all-reduce over tp, the gradient norm's: a float32 square norm for each weight and bias the plan splits. And the
    rank computes its share of the blocks: its FLOPs are of its pieces, not of the whole tensors."""
    sim = sims("tp", 0)
    m, split = sim["model"], len(simulate.stage().parallelize.__globals__["TP_PLAN"]) * 2  # a weight and a bias each
    (row,) = [r for r in sim["sent"] if r["dimension"] == "tp"]
    activations = 6 * m["layers"] * sim["accumulate"]
    expected = activations * sim["micro_batch"] * m["context"] * m["width"] * 4 + 4 * split * m["layers"]
    assert (row["kind"], row["calls"]) == ("all_reduce", activations + 1), row
    assert row["tensor_bytes"] == row["sent_bytes"] == expected, row
    assert sim["flops"] == step_flops(sim, tp=2)  # this rank's halves of the blocks' matmuls and heads


def test_the_experts_all_to_alls_carry_an_even_share(sims):
    """experts.py's exchange under ep, from the even load alone, independent of the simulation's shim. A micro-batch's
    R = tokens x k rows are shared out over the E experts as evenly as can be (the first ones one more); ep rank r
    holds experts r E/ep onwards, whose share is S_r rows, and every rank of its group sends it as many: it computes
    ep S_r rows. Per block and micro-batch, five all-to-alls over ep: the counts (E int64, (ep - 1) / ep of them
    leave), the rows to the experts (R handed over, R - S_r leave) and back (ep S_r, (ep - 1) S_r leave), and the same
    two again backward; a row is w float32. Each rank of both ep groups is checked (ranks 0, 2 hold the first
    experts, 1, 3 the others): a shim that loads one expert more, or fills the exchanged counts as another rank's,
    fails here."""
    for rank in range(world_of("ep")):
        sim = sims("ep", rank)
        m, ep = sim["model"], sim["ep"]
        rows = sim["micro_batch"] * m["context"] * m["top_k"]
        share, extra = divmod(rows, m["experts"])
        mine = range(rank % ep * m["experts"] // ep, (rank % ep + 1) * m["experts"] // ep)
        own = sum(share + (e < extra) for e in mine)  # S_r
        calls, row_bytes = m["layers"] * sim["accumulate"], m["width"] * 4
        tensor = calls * (8 * m["experts"] + 2 * (rows + ep * own) * row_bytes)
        sent = calls * (8 * m["experts"] * (ep - 1) / ep + 2 * (rows - own + (ep - 1) * own) * row_bytes)
        (row,) = [r for r in sim["sent"] if r["kind"] == "all_to_all"]
        assert sim["stage"] == "14_experts" and ep == 2 and extra, sim["model"]  # (and the load not quite even)
        assert (row["dimension"], row["calls"], row["tensor_bytes"], row["sent_bytes"]) == \
            ("ep", 5 * calls, tensor, sent), (rank, row)
        assert sim["flops"] == step_flops(sim, expert_rows=ep * own), rank


def test_interleaving_sends_across_every_stage_boundary(sims):
    """Independent of the simulation: under --stages-per-rank v, round-robin, every stage but the last sends each of
    the m micro-batches' activations on to the next stage's rank, and every stage but the first their gradients back
    (a [micro-batch, context, width] float32 tensor each). At pp 2 each rank holds one end of the pipeline, stage 0
    or stage 2v - 1: m (2v - 1) sends, and as many receives; one stage a rank (1F1B) would send m."""
    for rank in checked_ranks("interleaved"):
        sim = sims("interleaved", rank)
        m, v, pp, p = sim["accumulate"], sim["stages_per_rank"], sim["sizes"]["pp"], sim["coords"]["pp"]
        calls, each = m * (2 * v - 1), sim["micro_batch"] * sim["model"]["context"] * sim["model"]["width"] * 4
        assert (sim["pp_schedule"], v, sim["stages"]) == ("interleaved1f1b", 2, [p, p + pp]), sim["stages"]
        rows = {r["kind"]: r for r in sim["sent"] if r["dimension"] == "pp" and r["kind"] in ("send", "recv")}
        assert [(r["calls"], r["tensor_bytes"]) for r in rows.values()] == [(calls, calls * each)] * 2, (rank, rows)
        assert rows["send"]["sent_bytes"] == calls * each and rows["recv"]["sent_bytes"] == 0, rows


def test_the_router_load(simulate, real, sims):
    """The real router's load is not even, so the simulation cannot equal the real job in what depends on it: the
    bytes of the rows that leave a rank, its FLOPs and activation peak. The same real job measured again with its
    router's own counts (layout_worker's router_load) must still equal the simulation in all that does not: the state
    bytes, every collective but the all-to-alls (calls and bytes), the all-to-alls' calls; and summed over the job's
    ranks, the bytes the all-to-alls hand over and the FLOPs (dropless, every routed row reaches one expert, whichever
    and wherever: an MLP's FLOPs). The load-dependent parts are checked against the even-load formula instead
    (test_the_experts_all_to_alls_carry_an_even_share). And the router's load is seen not to be even: a real run
    that happened to be even would prove nothing here."""
    reals = [r["router_load"] for r in real("ep")]
    simulations = [sims("ep", rank) for rank in range(world_of("ep"))]

    def split(result: dict) -> tuple[list, list]:
        sent = result["sent"]
        return [r for r in sent if r["kind"] != "all_to_all"], [r for r in sent if r["kind"] == "all_to_all"]

    for rank, (sim, measured) in enumerate(zip(simulations, reals, strict=True)):
        (others, (exchange,)), (real_others, (real_exchange,)) = split(sim), split(measured)
        assert sim["state_bytes"] == measured["state_bytes"], rank
        assert others == real_others, rank
        assert (exchange["dimension"], exchange["calls"]) == (real_exchange["dimension"], real_exchange["calls"])
    for key in ("tensor_bytes", "sent_bytes"):
        assert [split(r)[1][0][key] for r in reals] != [split(r)[1][0][key] for r in simulations], key  # not even
    assert sum(split(r)[1][0]["tensor_bytes"] for r in reals) == sum(split(r)[1][0]["tensor_bytes"]
                                                                   for r in simulations)
    assert sum(r["flops"] for r in reals) == sum(r["flops"] for r in simulations)


def test_a_wrong_shim_is_seen(simulate, real, tmp_path):
    """The comparison's own control: a simulation whose DDP comm hook all-reduces half of each bucket runs, and
    disagrees with the real job."""
    text = SIMULATE.read_text()
    old = "dist.all_reduce(buffer, group=group)"
    assert text.count(old) == 1
    copy = tmp_path / "simulate.py"
    copy.write_text(text.replace(old, "dist.all_reduce(buffer[: buffer.numel() // 2], group=group)"))
    wrong = load_copy(copy)
    sim = wrong.measure(wrong.parse_args([*MODEL, *LAYOUTS["ddp"], "--rank", "0"], scratch=tmp_path))
    assert [line.split(":")[0] for line in differences(sim, real("ddp")[0])] == ["sent"]


def test_the_command_writes_its_json_and_table(tmp_path):
    out = tmp_path / "out"
    run = check(launch_commands([[sys.executable, str(SIMULATE), *MODEL, *LAYOUTS["fsdp"], "--rank", "1", "--out",
                                  str(out)]], timeout=time_limit()))
    result = json.loads((out / "simulate.json").read_text())
    assert result["rank"] == 1 and result["coords"]["dp"] == 1 and math.isfinite(result["flops"])
    assert "held by this rank" in run.stdout and "reduce_scatter" in run.stdout
