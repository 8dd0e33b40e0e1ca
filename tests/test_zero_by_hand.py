"""zero_by_hand/: ZeRO-1, ZeRO-2 and ZeRO-3 written by hand compute stage 01's training and the library's.

Claims, each with the control that shows it can fail:
- the README's runs (W = 2 and 3, float64) replay every epoch with stage 01's code and torch's AdamW within sqrt(eps);
  zero1 and zero2 end at the same weights bit for bit, and zero3 too at W = 2 (at W = 3 its units are cut apart, so
  gloo adds in another order: within sqrt(eps));
- each rank keeps AdamW's moments for its shard only (ceil(4,996 / W) elements on rank 0), and hands each collective
  the padded bucket or unit: zero3 gathers each unit twice a step (forward, backward);
- at W = 3 (4,996 weights: padded to 4,998) the shards are 1,666, 1,666 and 1,664 elements (zero3: per unit), the
  padding stays zero and never reaches AdamW; between steps zero2 and zero3 keep no whole gradient (every p.grad
  freed, the gradient shards 1/W) and zero3 no whole weight (every parameter empty); zero2's gradient shards are
  zero1's averaged gradient's, bit for bit;
- vs_library.py: at W = 1 and 2 every way is DDP + AdamW's, HandDDP + AdamW's and FSDP2's to the bit; at W = 3,
  ZeroRedundancyOptimizer is DDP's and zero1 and zero2 HandDDP's to the bit, zero3 FSDP2's within sqrt(eps);
- a shard stepped twice (zero1) and a reduce-scatter without the 1/W (zero2) fail the replay; a unit not gathered
  again for its backward (zero3) fails the job, naming the unit;
- memory.py's quick run: every live tensor after a step (gc, each storage once) adds up to the formulas within 5%,
  and so do the weights, the gradients and AdamW's .state apart (a whole gradient kept in a module-level list by
  zero2 or zero3, and an AdamW over the whole bucket in zero1, each failed it once), and the traffic counted from
  outside is; the README's full table is memory.py's from the committed memory.csv;
- DIFF.md's diffs are today's files, the README quotes each script in tagged excerpts; the machinery below each
  lesson is checked in test_repo.py.

The runs are the README's commands (conftest.readme_run: run once, in the background); the W = 3 job and the planted
bugs are forked launches.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import readme_run
from harness import (
    ROOT,
    TORCHRUN,
    check,
    edited,
    forked_ranks,
    launch_commands,
    load_copy,
    replay_error,
    time_limit,
    tolerance,
)
from lesson_diffs import FILE_DIFFS, file_diff, file_diff_block
from readme_blocks import BLOCKS
from tools.cli import read_csv

HERE = ROOT / "zero_by_hand"
COMMON = "--batch-size 32 --dtype float64 --epochs 5"
RUNS = {(script, world): f"torchrun --standalone --nproc_per_node={world} zero_by_hand/{script}.py {COMMON} "
                         f"--out runs/{script}{'' if world == 2 else '_w3'}"
        for script in ("zero1", "zero2", "zero3") for world in (2, 3)}
VS_LIBRARY = "python zero_by_hand/vs_library.py"
MEMORY = "python zero_by_hand/memory.py --hidden 256 --layers 2 --world-sizes 2,3 --out runs/memory_quick"
N_WEIGHTS = 4996  # the stages' Net: 8*64 + 64 + 64*64 + 64 + 64*4 + 4
UNITS = (8 * 64 + 64, 64 * 64 + 64 + 64 * 4 + 4)  # zero3's, as stage 08's: body, head


def padded(n: int, world: int) -> int:
    return -(-n // world) * world


@pytest.fixture(scope="module")
def trained(readme_runs) -> dict:
    return {key: readme_run(readme_runs, command) for key, command in RUNS.items()}


# --- the README's runs ----------------------------------------------------------------------------------------------

@pytest.mark.readme_run(*RUNS.values())
def test_each_run_computes_stage_01s_training_with_adamw(trained):
    for (script, world), run in trained.items():
        s = run.summary
        assert (s["stage"], s["world_size"], s["dtype"], s["optimizer"]) == (f"zero_by_hand/{script}", world,
                                                                             "float64", "AdamW")
        assert s["replica_max_abs_diff"] == (None if script == "zero3" else 0.0)  # zero3 has no replicas
        assert s["losses"][-1] < s["losses"][0] / 2, s["losses"]
        replay = replay_error(s, run.trajectory)
        assert replay <= tolerance("float64"), f"{script} at W = {world}: epoch replay {replay:.2e}"
        assert run.trajectory[-1]["step"] == s["steps"]
    for world in (2, 3):  # sharding changes nothing in the arithmetic, where the sums are the same
        pairs = [("zero1", "zero2")] + [("zero2", "zero3")] * (world == 2)
        for first, second in pairs:
            for a, b in zip(trained[first, world].trajectory, trained[second, world].trajectory, strict=True):
                assert all(x is y is None or torch.equal(x, y) for key in ("params", "exp_avg", "exp_avg_sq")
                           for x, y in zip(a[key], b[key], strict=True)), (first, second, world, a["epoch"])
    final = [trained[name, 3].trajectory[-1]["params"] for name in ("zero2", "zero3")]
    assert max((x - y).abs().max().item() for x, y in zip(*final, strict=True)) <= tolerance("float64")


@pytest.mark.readme_run(*RUNS.values())
def test_each_rank_keeps_adamws_state_for_its_shard_and_sends_the_padded_buckets(trained):
    for (script, world), run in trained.items():
        s = run.summary
        parts = UNITS if script == "zero3" else (N_WEIGHTS,)  # zero3 pads each unit, the others their one bucket
        elements = sum(padded(n, world) for n in parts)
        assert s["state_elements"] == elements // world == -(-N_WEIGHTS // world), (script, world)
        sent = "allreduce" if script == "zero1" else "reducescatter"
        gathers = 2 if script == "zero3" else 1  # zero3 gathers each unit for its forward and again for its backward
        assert s[f"{sent}_bytes_per_step"] * gathers == s["allgather_bytes_per_step"] == gathers * elements * 8, \
            (script, world, s)
        assert s[f"{sent}_calls_per_step"] * gathers == s["allgather_calls_per_step"] == gathers * len(parts)
        assert f"AdamW's state on rank 0: {elements // world:,} elements per moment" in run.stdout


@pytest.mark.readme_run(VS_LIBRARY)
def test_the_hand_built_sharding_is_the_librarys_where_the_sums_are(readme_runs):
    out = readme_run(readme_runs, VS_LIBRARY).stdout
    refs = ("DDP", "HandDDP", "FSDP2")
    rows = {}
    for line in out.splitlines():
        if m := re.match(r"(\d) +(\S.*?\S) +((?:(?:0|\d\.\de-\d\d) *){6})$", line):
            cells = [float(c) for c in m.group(3).split()]
            rows[int(m.group(1)), m.group(2)] = {ref: cells[2 * i:2 * i + 2] for i, ref in enumerate(refs)}
    ways = ("DDP + ZeroRedundancyOptimizer", "zero1.py", "zero2.py", "zero3.py", "HandDDP + AdamW", "FSDP2 + AdamW")
    assert set(rows) == {(w, way) for w in (1, 2, 3) for way in ways}, out
    # (W = 1: one process each way; a difference there is the comparison's own, as a weight kept uncopied)
    assert all(cell == 0 for (w, _), row in rows.items() if w < 3 for cells in row.values() for cell in cells), out
    # At W = 3, each family exact within itself: torch's ZeRO-1 is DDP + AdamW; sharding changes nothing in
    # HandDDP's sums (gloo's reduce-scatter adds in its all-reduce's order); zero3 and FSDP2 cut their units apart
    # (a unit's flat tensor, each parameter), so gloo adds in another order: within sqrt(eps), not to the bit.
    assert rows[3, "DDP + ZeroRedundancyOptimizer"]["DDP"] == [0, 0], out
    assert all(rows[3, way]["HandDDP"] == [0, 0] for way in ("zero1.py", "zero2.py")), out
    assert max(rows[3, "zero3.py"]["FSDP2"]) <= tolerance("float64"), out


# --- at W = 3, in a job of its own: the padding and what each rank keeps --------------------------------------------

def three_ranks_worker(rank: int, world: int, store: str, out: str) -> None:
    """One rank of the W = 3 job: two steps of each script on each rank's own batch; what rank{R}.json holds."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    found: dict = {}
    averaged = None
    for name in ("zero1", "zero2", "zero3"):
        script = load_copy(HERE / f"{name}.py")
        torch.manual_seed(0)
        net = script.Net().double()
        model = script.HandFSDP(net, [net.body, net.head]) if name == "zero3" else script.HandDDP(net)
        optimizer = script.ShardedOptimizer(model, torch.optim.AdamW, lr=0.01)
        events = record_events(script, model, net) if name == "zero3" else []
        for step in range(2):
            events.clear()  # the last step's
            g = torch.Generator().manual_seed(10 * step + rank)
            optimizer.zero_grad()
            F.cross_entropy(model(torch.randn(16, 8, generator=g, dtype=torch.float64)),
                            torch.randint(0, 4, (16,), generator=g)).backward()
            model.sync_gradients()
            if name == "zero1":  # this rank's part of the averaged gradient, whole on every rank in zero1
                averaged = [shard.grad.clone() for shard in optimizer.shards]
            elif name == "zero2":
                found["zero2_grad_shard_is_zero1s_part"] = all(torch.equal(a, s.grad) for a, s in
                                                                zip(averaged, optimizer.shards, strict=True))
            optimizer.step()
        state = [optimizer.optimizer.state[shard] for shard in optimizer.shards]
        kept = model.param_shards if name == "zero3" else model.flat_params  # what holds the weights between steps
        found[name] = {
            "shard_elements": [shard.numel() for shard in optimizer.shards],
            "moment_elements": [s[k].numel() for s in state for k in ("exp_avg", "exp_avg_sq")],
            # past each shard's real elements (zero3) or each bucket's (zero1, zero2): the padding
            "padding": [w[n:].tolist() for w, n in zip(kept, [s.numel() for s in optimizer.shards] if name == "zero3"
                                                       else model.sizes, strict=True)],
            "params_in_buckets": all(any(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                                         for flat in model.flat_params if flat is not None) for p in net.parameters()),
            "whole_weights": [p.numel() for p in net.parameters()],
            "whole_grads_kept": [p.grad is not None for p in net.parameters()],
            "grad_shard_elements": [g.numel() for g in getattr(model, "grad_shards", [])],
            "events": list(events),
        }
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def record_events(script, model, net) -> list[str]:
    """zero3's step as a list of events: each all-gather posted (by unit), each Linear's forward, each gradient."""
    events: list[str] = []
    real = script.dist.all_gather_single

    def gather(output, shard, *args, **kwargs):
        events.append(f"gather {[s is shard for s in model.param_shards].index(True)}")
        return real(output, shard, *args, **kwargs)
    script.dist = type("Dist", (), {"__getattr__": lambda self, name: getattr(torch.distributed, name),
                                    "all_gather_single": staticmethod(gather)})()  # this copy of zero3 only
    for name, module in net.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda m, args, name=name: events.append(f"forward {name}"))
    for name, param in net.named_parameters():
        param.register_post_accumulate_grad_hook(lambda p, name=name: events.append(f"gradient {name}"))
    return events


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory) -> list[dict]:
    """What each rank of the W = 3 job found (three_ranks_worker)."""
    return forked_ranks("test_zero_by_hand", "three_ranks_worker", 3, tmp_path_factory.mktemp("three_ranks"))


def test_uneven_shards_pad_the_buckets_and_the_padding_reaches_neither_model_nor_adamw(three_ranks):
    weights = [8 * 64, 64, 64 * 64, 64, 64 * 4, 4]
    for name in ("zero1", "zero2"):
        shards = [found[name]["shard_elements"] for found in three_ranks]
        assert shards == [[1666], [1666], [1664]], shards  # 4,996 = 1,666 + 1,666 + 1,664, two zeros of padding
        for found in three_ranks:
            mine = found[name]
            assert mine["moment_elements"] == [n for n in mine["shard_elements"] for _ in range(2)], mine
            assert mine["padding"] == [[0.0, 0.0]] and mine["whole_weights"] == weights, mine
            assert mine["params_in_buckets"], "each parameter a view of its bucket"
    # zero3: each unit padded apart (body's 576 divide by 3; head's 4,420 become 4,422), rank 2's head shard short
    shards = [found["zero3"]["shard_elements"] for found in three_ranks]
    assert shards == [[192, 1474], [192, 1474], [192, 1472]], shards
    assert [found["zero3"]["padding"] for found in three_ranks] == [[[], []], [[], []], [[], [0.0, 0.0]]]
    for found in three_ranks:  # AdamW's two moments, shard-sized
        mine = found["zero3"]
        assert mine["moment_elements"] == [n for n in mine["shard_elements"] for _ in range(2)], mine


def test_between_steps_zero2_keeps_no_whole_gradient_and_zero3_no_whole_weight(three_ranks):
    for found in three_ranks:
        assert found["zero1"]["whole_grads_kept"] == [True] * 6  # zero1: the whole averaged gradient stays
        for name in ("zero2", "zero3"):
            assert found[name]["whole_grads_kept"] == [False] * 6, (name, found[name])
        assert found["zero2"]["grad_shard_elements"] == [1666]
        assert found["zero3"]["grad_shard_elements"] == [192, 1474]
        assert found["zero3"]["whole_weights"] == [0] * 6, "zero3 keeps each parameter empty until it is gathered"
        assert found["zero2_grad_shard_is_zero1s_part"]


def test_zero3_posts_the_next_units_gather_before_the_current_unit_computes(three_ranks):
    """Prefetch, as an order of events (no clock): body's forward starts with head's gather already posted, and
    head's backward (its first gradient) with body's; without prefetch each gather would come just before its unit."""
    events = three_ranks[0]["zero3"]["events"]
    forward, backward = events[:events.index("forward head.2") + 1], events[events.index("forward head.2") + 1:]
    assert forward == ["gather 0", "gather 1", "forward body.0", "forward head.0", "forward head.2"], events
    assert backward[:2] == ["gather 1", "gather 0"] and backward[2].startswith("gradient head.2"), events
    assert "gather" not in " ".join(backward[2:]), "each unit gathered once for its backward"


# --- planted bugs: the replay catches a wrong shard ------------------------------------------------------------------

def launch_mutated(script: str, old: str, new: str, tmp: Path):
    (tmp / script).write_text(edited(HERE / script, [(old, new)]))
    return launch_commands([[*TORCHRUN, "--standalone", "--nproc_per_node=2", str(tmp / script), "--batch-size",
                             "32", "--dtype", "float64", "--epochs", "2", "--out", str(tmp / "out")]], tmp / "out",
                           timeout=time_limit(programs=3))  # torchrun's agent and 2 ranks


@pytest.mark.parametrize("script,old,new", [
    ("zero1.py", "        self.optimizer.step()  # AdamW",  # every rank steps its shard twice: still equal replicas
     "        self.optimizer.step()\n        self.optimizer.step()  # AdamW"),
    # the sum of the ranks' gradients, not their mean
    ("zero2.py", "            self.grad_shards[i] /= dist.get_world_size()\n", ""),
], ids=["zero1-shard-stepped-twice", "zero2-reduce-scatter-without-1/W"])
def test_a_wrong_shard_fails_the_replay(tmp_path, script, old, new):
    run = check(launch_mutated(script, old, new, tmp_path))
    assert run.summary["replica_max_abs_diff"] == 0.0  # every rank made the same mistake: only the replay sees it
    assert replay_error(run.summary, run.trajectory) > 1e-3


def test_a_unit_not_gathered_again_for_its_backward_fails_the_job_naming_it(tmp_path):
    """Without the gather before backward, autograd would compute with whatever the unit's parameters hold (empty
    tensors, or a stale buffer): the saved-tensor hook refuses, naming the unit."""
    run = launch_mutated("zero3.py", "        self._unshard(i, prefetch=i - 1)  # backward", "        pass  # backward",
                         tmp_path)
    assert run.returncode == 1 and "is not whole: it was not gathered again for its backward" in run.stderr, \
        run.describe()


# ZeRO's formulas (Rajbhandari et al., table 1): bytes per weight on each rank with AdamW in float32, (weights,
# gradients, AdamW's two moments), at W ranks. Written here, not read from memory.py: the test holds the paper's.
KEPT = {"DDP": lambda w: (4, 4, 8), "ZeRO-1": lambda w: (4, 4, 8 / w), "ZeRO-2": lambda w: (4, 4 / w, 8 / w),
        **{way: (lambda w: (4 / w, 4 / w, 8 / w)) for way in ("ZeRO-3", "FSDP2", "FSDP2-no-reshard")}}


@pytest.mark.readme_run(MEMORY)
def test_what_each_rank_keeps_and_sends_is_the_formulas(readme_runs):
    """Every live tensor after a step is counted (gc, each storage once), so a whole gradient kept anywhere shows in
    the total; AdamW's moments are read from its .state, so an AdamW over more than this rank's shard shows there."""
    run = readme_run(readme_runs, MEMORY)
    rows = read_csv(run.out / "memory.csv")
    assert {(r["way"], int(r["W"])) for r in rows} == {(way, w) for way in KEPT for w in (2, 3)}
    mib = 2**20
    for r in rows:
        n, w = int(r["weights"]), int(r["W"])
        parts = [b * n / mib for b in KEPT[r["way"]](w)]
        assert abs(float(r["total_MiB"]) / sum(parts) - 1) <= 0.05, r  # every live tensor, against 16Ψ, 8Ψ + 8Ψ/W...
        for kind, formula in zip(("weights", "grads", "state"), parts, strict=True):
            assert abs(float(r[f"{kind}_MiB"]) / formula - 1) <= 0.05, (kind, r)
        assert r["state_keys"] == "exp_avg exp_avg_sq step", r  # AdamW's own, one moment per element of its tensors
        share = n if r["way"] == "DDP" else n / w  # rank 0's: the whole model under DDP, its shard otherwise
        assert share <= int(r["moment_elements"]) <= 1.05 * share, r  # (the padding: FSDP2 pads rows, a bucket its end)
        assert abs(float(r["sent_MiB"]) / float(r["sent_formula_MiB"]) - 1) <= 0.05, r
    by = {(r["way"], int(r["W"])): r for r in rows}
    for w in (2, 3):  # the mapping question: FSDP2 without resharding after forward sends what ZeRO-2 sends
        sent = {way: float(by[way, w]["sent_MiB"]) for way in ("ZeRO-2", "FSDP2-no-reshard", "FSDP2", "ZeRO-3")}
        # (within 5%: FSDP2 pads each parameter's rows to a multiple of W, ZeRO-2 each bucket)
        assert abs(sent["FSDP2-no-reshard"] / sent["ZeRO-2"] - 1) < 0.05 and sent["FSDP2"] > 1.4 * sent["ZeRO-2"], sent
    assert (run.out / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_shows_the_committed_memory_table():
    """The full run's table in the README is what memory.py prints from the committed memory.csv."""
    memory = load_copy(HERE / "memory.py")
    assert memory.readme_table(HERE / "memory.csv") in (HERE / "README.md").read_text(), \
        "run python zero_by_hand/memory.py and paste what it prints"


# --- the files themselves -------------------------------------------------------------------------------------------

def test_the_diff_page_shows_todays_diffs_and_the_readme_quotes_each_script():
    """DIFF.md's diffs are today's; the README's code is excerpts of the three scripts, each tagged with its file
    (test_readme_commands.test_code_excerpts_are_the_code checks that every one is whole lines of today's file)."""
    for old, new in FILE_DIFFS["zero_by_hand/DIFF.md"]:
        shown = file_diff_block("zero_by_hand/DIFF.md", old, new)
        assert shown, f"zero_by_hand/DIFF.md lost its diff of {old} and {new}"
        assert shown.group(1) == file_diff(old, new), "an old diff: run python tests/lesson_diffs.py"
    quoted = {b.marker.get("excerpt") for b in BLOCKS if b.doc == HERE / "README.md" and b.lang == "python"}
    assert quoted == {f"zero_by_hand/{name}.py" for name in ("zero1", "zero2", "zero3")}, quoted
    assert "](DIFF.md)" in (HERE / "README.md").read_text()
