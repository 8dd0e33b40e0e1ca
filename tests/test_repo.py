"""The repository keeps its promises: lint-clean, CI runs the README's command, stages share one vocabulary."""
from __future__ import annotations

import ast
import inspect
import io
import itertools
import operator
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

from harness import FOLDER_STAGES, RECIPES, ROOT, STAGES, load_stage
from lesson_diffs import BLOCK, DEFINITION, DIFF_PAGE, EXTENDS, HUNK, changes, diff

# Pieces of the lesson every stage must carry word for word: the contract (data, model, evaluation), and from
# stage 03 on the distributed pieces. The machinery after the boundary is checked whole (test_machinery_...).
SHARED = ["make_data", "Net", "load_train_objs", "evaluate", "pick_device", "clock"]
SHARED_DDP = ["prepare_dataloader", "padding_note", "evaluate_distributed", "replica_max_abs_diff"]
BOUNDARY = "# ═══ The lesson ends here ═══"
# Stages with a model and data of their own: the contract above is stage 01's task; theirs is proven by their tests.
OWN_MODEL = {"11_gpt": "a GPT on text: tests/test_gpt.py checks its DDP, FSDP, tp and resume against each other",
             "12_context_parallel": "11's GPT with cp: tests/test_context_parallel.py checks its layouts against one "
                                    "process",
             "13_pipeline_4d": "12's GPT with pp too: tests/test_pipeline_4d.py checks its layouts against one process",
             "14_experts": "13's GPT with experts: tests/test_experts.py checks its layouts against one process"}
# Where a stage must differ, and why.
EXPECTED_DIFFERENCES = {("07_model_parallel", "load_train_objs"): "builds the model split over two devices",
                        ("07_model_parallel", "replica_max_abs_diff"): "gathers parameters from two devices",
                        ("08_fsdp", "Net"): "its width is a flag (--hidden), to show what sharding saves",
                        ("08_fsdp", "load_train_objs"): "shards the model before the optimizer takes its parameters",
                        ("09_tensor_parallel", "Net"): "08's: the width is a flag",
                        ("09_tensor_parallel", "load_train_objs"): "splits and shards the model on the mesh given",
                        ("10_pipeline_parallel", "load_train_objs"): "keeps this process's pipeline stage of the model",
                        **{(stage, name): "evaluates the sharded model (evaluate_sharded): no rank holds it whole"
                           for stage in ("08_fsdp", "09_tensor_parallel")
                           for name in ("evaluate", "evaluate_distributed")},
                        **{(stage, "replica_max_abs_diff"): "no replicas: each rank holds other shards of one model"
                           for stage in ("08_fsdp", "09_tensor_parallel")},
                        **{("10_pipeline_parallel", name): "evaluates through the pipeline (evaluate_pipeline)"
                           for name in ("evaluate", "evaluate_distributed")},
                        ("10_pipeline_parallel", "replica_max_abs_diff"):
                            "compares a stage's copies over the dp pipelines: the stages hold different layers",
                        ("recipes/uneven_inputs", "prepare_dataloader"): "an unpadded, uneven sampler: the recipe",
                        ("recipes/uneven_inputs", "padding_note"): "its sampler repeats no sample: ranks stay uneven"}


def test_ruff_is_clean():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- test-command -->\s*```bash\n(.+?)\n```\s*<!-- /test-command -->", readme, re.S)
    assert block, "README.md lost its test-command block"
    printed = subprocess.run(["bash", ".ci/run", "--print-command"], cwd=ROOT, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == block.group(1).strip()
    assert "pytest" in block.group(1)
    # The README starts with what a learner needs; the test command stands under its own heading ("## Run the tests").
    headings, fenced = [], False
    for line in readme[:block.start()].splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            headings.append(line)
    assert headings and "test" in headings[-1].lower(), \
        f"the test command must stand under a heading about the tests, not {headings[-1:]}"


@pytest.mark.parametrize("name,since", [(n, "01") for n in SHARED] + [(n, "03") for n in SHARED_DDP])
def test_stages_share_the_contract_word_for_word(name, since):
    """The recipes (stage 04 plus one technique) keep the contract too."""
    sources = {stage: inspect.getsource(getattr(load_stage(stage), name)) for stage in [*STAGES, *RECIPES]
               if stage >= since and (stage, name) not in EXPECTED_DIFFERENCES and stage not in OWN_MODEL}
    reference = next(iter(sources.values()))
    drifted = [stage for stage, src in sources.items() if src != reference]
    assert len(sources) >= 4 and not drifted, f"{name} differs from {next(iter(sources))} in {drifted}"


def stage_files(script: str) -> list[Path]:
    """A script's files: a stage's or recipe's train.py, or a GPT stage's files (train.py and those beside it), or
    a script elsewhere ("10_pipeline_parallel/by_hand")."""
    if (ROOT / script / "train.py").exists():
        return sorted((ROOT / script).glob("*.py")) if script in FOLDER_STAGES else [ROOT / script / "train.py"]
    return [ROOT / f"{script}.py"]


def split_at_boundary(script: str) -> tuple[str, str]:
    """(the lesson, the machinery common to every stage: from the boundary to the stage's own section or the end,
    without the import lines that follow the boundary, which import what the lesson did not). A GPT stage keeps the
    machinery in a file of its own (checks.py): the rest is its other files (reports.py among them, which must not
    redefine the machinery's names either)."""
    files = stage_files(script)
    (path,) = [f for f in files if BOUNDARY in f.read_text()] or files
    text = path.read_text()
    assert text.count(BOUNDARY) == 1, f"{path.relative_to(ROOT)}: expected one line starting {BOUNDARY!r}"
    lesson, rest = text.split(BOUNDARY)
    lesson = "".join(f.read_text() for f in files if f != path) + lesson
    rest = rest.split("\n# ─── This ")[0].split('\nif __name__ == "__main__":')[0]
    common = "\n".join(line for line in rest.splitlines() if not line.startswith(("import ", "from ")))
    return lesson, re.sub(r"\n{3,}", "\n\n\n", common).strip()


# The machinery's --out files of a stage trained in epochs with SGD; a GPT stage (steps, AdamW) writes its own.
EPOCH_RUN_FILES = ("state_of", "Trajectory", "save_run")


def without_definitions(source: str, names: tuple[str, ...]) -> str:
    """`source` without its top-level definitions of `names` (each from its `def`/`class` line to the next top-level
    line), blank lines folded as split_at_boundary folds them."""
    kept, skipping = [], False
    for line in source.splitlines():
        if line and not line[0].isspace() and not line.startswith((")", "#")):
            skipping = bool(re.match(rf"(?:def|class) (?:{'|'.join(names)})\b", line))
        if not skipping:
            kept.append(line)
    return re.sub(r"\n{3,}", "\n\n\n", "\n".join(kept)).strip()


@pytest.mark.parametrize("script", [*STAGES, *RECIPES, "10_pipeline_parallel/by_hand", "zero_by_hand/zero1",
                                    "zero_by_hand/zero2", "zero_by_hand/zero3"])
def test_machinery_after_the_boundary_is_the_same_in_every_stage(script):
    """A stage's top is the lesson; what only the tour and the tests need comes after one marked line, identical in
    every stage and recipe, so a reader can skip it and a diff of two stages shows the lessons' difference. A GPT
    stage holds only what it uses: its --out files are its own (reports.py), so it leaves out the epochs'."""
    lesson, machinery = split_at_boundary(script)
    expected = split_at_boundary("01_single_gpu")[1]
    if script in FOLDER_STAGES:
        expected = without_definitions(expected, EPOCH_RUN_FILES)
    assert machinery == expected, f"{script}: the machinery differs from stage 01's"
    defined_below = re.findall(r"^(?:def|class) (\w+)", machinery, re.M)
    assert not [name for name in defined_below if re.search(rf"^(?:def|class) {name}\b", lesson, re.M)]


@pytest.mark.parametrize("stage", [stage for stage in STAGES[1:] if stage in EXTENDS or stage not in OWN_MODEL])
def test_each_stage_readme_shows_the_diff_of_its_lesson(stage):
    """The README shows what changed from the stage it extends, as a diff of the two lessons; kept current here."""
    assert stage in EXTENDS, f"{stage}: name the stage it extends in tests/lesson_diffs.py EXTENDS"
    page = ROOT / stage / DIFF_PAGE
    shown = BLOCK.search(page.read_text()) if page.exists() else None
    assert shown, f"{stage}/{DIFF_PAGE} has no diff block: run python tests/lesson_diffs.py"
    assert shown.group(1) == diff(stage), f"{stage}/{DIFF_PAGE} shows an old diff: run python tests/lesson_diffs.py"
    assert f"]({DIFF_PAGE})" in (ROOT / stage / "README.md").read_text(), f"{stage}/README.md links no {DIFF_PAGE}"


@pytest.mark.parametrize("stage", FOLDER_STAGES[1:])
def test_a_folder_diffs_changes_are_where_their_headers_say(stage):
    """A GPT stage's README diff has no context lines: each change's header must say where it is, its lines'
    numbers in the two files themselves (docstrings included) and the definition above it in the new file."""
    before = EXTENDS[stage]
    for name in sorted(p.name for p in (ROOT / stage).glob("*.py") if (ROOT / before / p.name).exists()):
        old, new = ((ROOT / s / name).read_text().splitlines() for s in (before, stage))
        lines = changes(ROOT / before / name, ROOT / stage / name, "a", "b")
        for i, line in enumerate(lines):
            if not (m := HUNK.match(line)):
                continue
            hunk = list(itertools.takewhile(lambda x: not x.startswith("@@"), lines[i + 1:]))
            (o, oc), (n, nc) = ((int(a), int(c[1:]) if c else 1) for a, c in ((m[1], m[2]), (m[3], m[4])))
            # (an empty range's number is the line before it: nothing there to compare)
            assert [x[1:] for x in hunk if x[0] == "-"] == (old[o - 1:o - 1 + oc] if oc else []), (name, line)
            assert [x[1:] for x in hunk if x[0] == "+"] == (new[n - 1:n - 1 + nc] if nc else []), (name, line)
            start = n - 1 if nc else n
            above = [d[1] for x in new[:start] if (d := DEFINITION.match(x))]
            assert line.removeprefix(m[0]).strip() == (above[-1] if above else ""), (name, line)


# Private torch names a script may use, each where torch has no public way to do it; any other is a failure. A name
# (torch.x._y, dist._y) counts wherever the code says it, strings included (a logger's name); an attribute (obj._y)
# counts where the script does not define it itself. Comments do not count.
PRIVATE_ALLOWED = {
    **{(stage, "torch.distributed.tensor._redistribute"):
       "a logger's name, to quiet a warning about a correct two-step gather: a name, not an API"
       for stage in ("09_tensor_parallel", "11_gpt", "12_context_parallel", "13_pipeline_4d", "14_experts")},
    ("14_experts", "._set_params_and_buffers_to_ignore_for_model"):
        "DDP's one way to leave parameters out of its all-reduce (a rank's experts are its own); no public one",
    ("recipes/comm_hooks", "torch.utils._python_dispatch"):
        "counts the bytes each hook hands to gloo; CommDebugMode counts calls, not their tensors' bytes",
    ("recipes/comm_hooks", "torch.utils._pytree"): "walks the arguments of what the counter above sees",
    ("recipes/compile", "torch._dynamo"): "the count of compiled graphs: how the recipe shows DDPOptimizer split it",
    ("recipes/compile", "dist._DEFAULT_FIRST_BUCKET_BYTES"):
        "DDPOptimizer reads its first bucket's size only from there (1 MiB), and refuses one above --bucket-cap-mb",
    **{(script, "._get_ddp_logging_data"):
       "DDP's bucket sizes as DDP built them: public only to a comm hook (GradBucket), and registering one would "
       "replace the built-in all-reduce that the script measures or shows"
       for script in ("recipes/compile", "recipes/ddp_options", "ddp_by_hand/overlap")},
    # at_scale/simulate.py runs stage 13's code on torch's fake process group and fake tensors: torch's own tools for
    # that are private, and so are the few places where the fake group cannot carry the code (each said in its output).
    ("at_scale/simulate", "torch._subclasses"): "FakeTensorMode (tensors with a shape and no memory) and "
                                                "unset_fake_temporarily: no public module has them",
    ("at_scale/simulate", "torch.testing._internal"): "FakeStore, whose import registers the \"fake\" backend: the "
                                                      "fake process group has no public module",
    ("at_scale/simulate", "torch.distributed._tools"): "MemTracker and FSDPMemTracker (memory by kind, fake tensors "
                                                       "too) and the table of c10d collective ops: no public ones",
    ("at_scale/simulate", "torch.utils._python_dispatch"): "TorchDispatchMode, which sees every c10d op whoever calls "
                                                           "it (DDP's reducer, FSDP2); no public module has it",
    ("at_scale/simulate", "torch.distributed.pipelining._utils"):
        "the classes a pipeline stage sends its neighbour its shapes in: the simulation makes what the neighbour, "
        "absent, would send",
    ("at_scale/simulate", "._warmup_p2p"): "the pipeline's first-step vote between stages, run on real tensors (fake "
                                           "ones have no values to vote with)",
    ("at_scale/simulate", "._batch_p2p"): "the pipeline schedules' batches of sends and receives: their works made "
                                          "to hold the tensors, as gloo's do (the fake group's hold none)",
    ("at_scale/simulate", "torch.nn.parallel.distributed._verify_param_shape_across_processes"):
        "DDP's constructor's check that all ranks' shapes agree, skipped: a rank alone has none to compare, and the "
        "check reads tensor values fake tensors have not",
    ("at_scale/simulate", "._WINFO"): "which storages the memory tracker has seen allocated: memory it never saw "
                                      "allocated (DDP's buckets, gloo's own buffers) is left out of the step's peak",
    ("at_scale/simulate", "._update_and_maybe_create_winfos"):
        "FSDPMemTracker's own labelling of a tensor (it has no public one): a parameter FSDP2 leaves out (stage 14's "
        "experts under --ep) has its gradient labelled as FSDP2's are, state, not counted in the activation peak too",
    ("at_scale/simulate", "._clear_sharding_prop_cache"):
        "DTensor's cache of sharding decisions, keyed by mesh: one simulation's meshes equal the next one's in a "
        "process, and would hand it the previous one's process groups",
    ("at_scale/simulate", "._scaled_dot_product_flash_attention_for_cpu"):
        "the CPU's attention kernel, which FlopCounterMode leaves uncounted: counted as torch counts its GPU kernels",
    ("debugging/bugs", "torch._C"):
        "_distributed_c10d._dump_fr_trace, the flight recorder's dump: NCCL's watchdog calls it on a timeout, gloo's "
        "never does, and torch has no public name for it (fr_trace reads what it writes)",
    **{(script, "torch._dynamo"):
       "imported before the ranks are forked, only to have it once: DDP's constructor imports it (2-3 CPU-s) in each "
       "rank otherwise, and no public module imports it"
       for script in ("debugging/bugs", "ddp_by_hand/vs_ddp", "zero_by_hand/vs_library", "zero_by_hand/memory")},
    ("at_scale/simulate", "._run_step"): "the stage's own training step (Trainer._run_step, what its train() calls): "
                                         "the simulation runs that step",
    # at_scale/this_machine.py times stage 13's step on the fake process group, on real tensors (simulate.py's way).
    ("at_scale/this_machine", "torch.testing._internal"): "FakeStore, whose import registers the \"fake\" backend: "
                                                          "the fake process group has no public module",
    ("at_scale/this_machine", "torch.nn.parallel.distributed._verify_param_shape_across_processes"):
        "DDP's constructor's check that all ranks' shapes agree, skipped: on the fake group there is no other rank",
    ("at_scale/this_machine", "._run_step"): "the stage's own training step (Trainer._run_step, what its train() "
                                             "calls): the step timed",
}
PRIVATE = re.compile(r"\b(?:torch|dist)(?:\.[A-Za-z]\w*)*\._[A-Za-z]\w*|\._type\(\)|\.unbox\(")
# Names with a leading underscore that the standard library documents as public.
PUBLIC_UNDERSCORED = {"_exit",  # os._exit
                      "_asdict", "_replace", "_fields", "_make"}  # a namedtuple's methods (collections docs)
# Every script a reader runs: the stages, the recipes, and the tools beside them.
PRIVATE_SCANNED = [*STAGES, *RECIPES, *sorted(str(p.relative_to(ROOT).with_suffix("")) for p in [
    ROOT / "10_pipeline_parallel" / "by_hand.py", *ROOT.glob("ddp_by_hand/*.py"), *ROOT.glob("zero_by_hand/*.py"),
    *ROOT.glob("benchmarks/*.py"), *ROOT.glob("collectives/*.py"), *ROOT.glob("tools/*.py"),
    *ROOT.glob("at_scale/*.py"), *ROOT.glob("debugging/*.py")])]


def private_names(source: str) -> set[str]:
    """The private names `source` uses: torch's by name (PRIVATE, outside comments), and `._attr` of objects for any
    private attribute the file does not define (assign, def, class) itself."""
    lines = source.splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:  # a comment runs to the end of its line
            row, column = token.start
            lines[row - 1] = lines[row - 1][:column] + "\n"
    used = {m.group(0) for m in PRIVATE.finditer("".join(lines))}
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    own |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
    own |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return used | {f".{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
                   and not n.attr.startswith("__") and n.attr not in own | PUBLIC_UNDERSCORED
                   and not PRIVATE.fullmatch(ast.unparse(n))}  # torch's, by name: counted above


@pytest.mark.parametrize("script", PRIVATE_SCANNED)
def test_scripts_use_public_torch_apis_where_torch_has_them(script):
    used = set().union(*(private_names(path.read_text()) for path in stage_files(script)))
    allowed = [prefix for s, prefix in PRIVATE_ALLOWED if s == script]
    unexplained = [name for name in used if not any(name.startswith(prefix) for prefix in allowed)]
    assert not unexplained, f"{script} uses {unexplained}: use the public API, or say in PRIVATE_ALLOWED why not"
    stale = [prefix for prefix in allowed if not any(name.startswith(prefix) for name in used)]
    assert not stale, f"PRIVATE_ALLOWED explains {stale} for {script}, which no longer uses it: remove the entry"


def test_the_private_name_scan_sees_what_it_must():
    """Negative controls: a private torch module, a private method of a torch object and a private constant are
    seen; the same in a comment, a name the file defines itself, and os._exit are not."""
    seen = private_names("import torch.distributed as dist\nfrom torch._dynamo import utils\n"
                         "data = model._get_ddp_logging_data()\nx = dist._DEFAULT_FIRST_BUCKET_BYTES\n")
    assert seen == {"torch._dynamo", "._get_ddp_logging_data", "dist._DEFAULT_FIRST_BUCKET_BYTES"}, seen
    assert not private_names("import os\n# torch._dynamo, model._get_ddp_logging_data()\nclass A:\n"
                             "    def _mine(self):\n        return self._mine\nos._exit(0)\n")


def test_docs_have_no_unfilled_placeholders():
    for doc in [ROOT / "README.md", *ROOT.glob("*/README.md")]:
        assert not re.search(r"\b(TOUR_OUTPUT|OUTPUT_\d\d|TODO|FIXME)\b", doc.read_text()), doc


def test_every_stage_has_a_readme_with_its_commands():
    for stage in STAGES:
        text = (ROOT / stage / "README.md").read_text()
        assert f"{stage}/train.py" in text, f"{stage}/README.md does not show how to run it"


def test_every_recipe_is_in_the_recipes_readme():
    text = (ROOT / "recipes" / "README.md").read_text()
    missing = [recipe for recipe in RECIPES if f"{recipe}/train.py" not in text]
    assert RECIPES and not missing, f"recipes/README.md does not show how to run {missing}"


# Stages that check and write snapshots with the previous stage's code: the fault battery's bad-snapshot and
# full-disk cases run on the first of each pair alone (each case launches a process, ~4 CPU-s).
SHARED_SNAPSHOT_CODE = {
    ("06_checkpoint", "07_model_parallel"): ["load_snapshot", "SnapshotError", "Trainer._load_snapshot",
                                             "Trainer._save_snapshot", "Trainer._cuda_devices"],
    ("08_fsdp", "09_tensor_parallel"): ["load_snapshot", "checkpoints", "MetadataUnpickler", "SnapshotError"],
    # 11 checks its own snapshot's fields (tests/test_gpt.py), with 08's reading, listing and refusing code.
    ("08_fsdp", "11_gpt"): ["checkpoints", "MetadataUnpickler", "SnapshotError", "failed_save", "check_checkpoint_arg"],
    # 12 is 11 with cp: the same checkpoints (progress.json and all), checked by 11's code.
    ("11_gpt", "12_context_parallel"): ["checkpoints", "MetadataUnpickler", "SnapshotError", "failed_save",
                                        "check_checkpoint_arg", "schedule", "Trainer._load_snapshot",
                                        "Trainer._save_snapshot"],
    # 13 is 12 with pp: the same again (each stage writes its own blocks' shards, under the same names).
    ("12_context_parallel", "13_pipeline_4d"): ["checkpoints", "MetadataUnpickler", "SnapshotError", "failed_save",
                                                "check_checkpoint_arg", "schedule", "Trainer._load_snapshot",
                                                "Trainer._save_snapshot", "load_snapshot"],
    # 14 is 13 with experts: the same again (the experts are DTensors over ep, named as one process names them).
    ("13_pipeline_4d", "14_experts"): ["checkpoints", "MetadataUnpickler", "SnapshotError", "failed_save",
                                       "check_checkpoint_arg", "schedule", "Trainer._load_snapshot",
                                       "Trainer._save_snapshot", "load_snapshot"],
}
# What a later stage adds to that code, the rest unchanged: removed before comparing. 14's progress.json also keeps the
# tokens each expert took (a resumed run's loads then start at step 0); how the checkpoint is written and fails is 13's.
SNAPSHOT_ADDITIONS = {("13_pipeline_4d", "14_experts"): {"Trainer._save_snapshot":
                                                         ', "experts": self.expert_log.history()'}}


@pytest.mark.parametrize("pair", SHARED_SNAPSHOT_CODE, ids="-".join)
def test_snapshots_are_handled_with_the_previous_stages_code(pair):
    """The later stage reads, checks, refuses and writes snapshots with the earlier one's code (compared as syntax
    trees: a comment may differ), so the fault battery need not repeat its snapshot cases on it."""
    first, then = (load_stage(stage) for stage in pair)

    def tree(obj, added: str = "") -> str:
        source = inspect.getsource(obj)
        assert added in source, f"{pair[1]}'s {obj.__qualname__} no longer adds {added!r}: update SNAPSHOT_ADDITIONS"
        return ast.dump(ast.parse(textwrap.dedent(source.replace(added, "", 1) if added else source)))

    added = SNAPSHOT_ADDITIONS.get(pair, {})
    drifted = [name for name in SHARED_SNAPSHOT_CODE[pair]
               if tree(operator.attrgetter(name)(first)) != tree(operator.attrgetter(name)(then), added.get(name, ""))]
    assert not drifted, f"{pair[1]}'s {drifted} differ from {pair[0]}'s: add {pair[1]} to the snapshot faults"
    refusal = ("    except SnapshotError as e:\n"
               "        print(f\"{STAGE}/train.py: error: argument --snapshot: {e}\", file=sys.stderr)\n"
               "        sys.exit(2)\n")
    # (a GPT stage calls what only the checks need through `checks.`, its checks.py)
    assert all(refusal in inspect.getsource(stage.main).replace("checks.", "") for stage in (first, then)), \
        "the refusal in main() differs"


GPU_PATH = re.compile(r"torch\.cuda|[\"']cuda")  # a script that can run on a GPU names it
EVERY_SCRIPT = [p for p in sorted(ROOT.rglob("*.py"))
                if not {"tests", ".venv", "runs"} & set(p.relative_to(ROOT).parts)]
GPU_SCRIPTS = [p for p in EVERY_SCRIPT if GPU_PATH.search(p.read_text())]


def lines_calling(node: ast.AST, name: str) -> list[int]:
    """The lines under `node` that call `name` (as written: "torch.cuda.synchronize")."""
    return [n.lineno for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == name]


def functions(tree: ast.AST) -> list[ast.AST]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


DDP_NAMES = ("DDP", "DistributedDataParallel")


def ddp_outliving_its_group(tree: ast.AST) -> list[tuple[str, int]]:
    """(name, line) of each DDP model a function binds and still holds where it destroys the process group, and then
    frees as it returns (no os._exit after): freed after its group, DDP's reducer joins gloo's worker thread holding
    the interpreter that thread may need to free the last collective's tensors, a hang at exit (your_model/hf_ddp.py
    did, 5 of 56 runs beside busy loops; hugging_face.md). A `del` before the call frees it while the group lives."""
    found = []
    for func in functions(tree):
        destroys = lines_calling(func, "dist.destroy_process_group")
        exits = lines_calling(func, "os._exit")
        models = [(t.id, n.lineno) for n in ast.walk(func)
                  if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                  and ast.unparse(n.value.func).split(".")[-1] in DDP_NAMES
                  for t in n.targets if isinstance(t, ast.Name)]
        deleted = [(t.id, n.lineno) for n in ast.walk(func) if isinstance(n, ast.Delete) for t in n.targets
                   if isinstance(t, ast.Name)]
        for destroy in destroys:
            for name, bound in models:
                freed = any(d == name and bound < line < destroy for d, line in deleted)
                if bound < destroy and not freed and not any(e > destroy for e in exits):
                    found.append((name, destroy))
    return found


def test_a_scripts_help_describes_it_in_whole_sentences():
    """A script whose --help takes its docstring's first line as the description: that line ends a sentence (else
    --help stops mid-sentence, as this_machine.py's did; such scripts take the first paragraph)."""
    def first_line(p: Path) -> str:
        return ast.get_docstring(ast.parse(p.read_text())).splitlines()[0].rstrip()
    cut = [p.relative_to(ROOT).as_posix() for p in EVERY_SCRIPT if "description=__doc__.splitlines()[0]" in
           p.read_text() and not first_line(p).endswith((".", ":"))]
    assert not cut, f"--help stops mid-sentence (use the docstring's first paragraph): {cut}"


def test_no_ddp_model_outlives_its_process_group():
    held = {str(p.relative_to(ROOT)): found for p in EVERY_SCRIPT if (found := ddp_outliving_its_group(
        ast.parse(p.read_text())))}
    assert not held, f"DDP models still held where their process group is destroyed, freed after it: {held}"


def test_the_ddp_check_sees_a_model_freed_after_its_group():
    """Negative control: hf_ddp.py without its `del model`; with os._exit after the destroy it never frees it."""
    source = (ROOT / "your_model" / "hf_ddp.py").read_text()
    assert "    del model\n" in source
    without = source.replace("    del model\n", "")
    assert [name for name, _ in ddp_outliving_its_group(ast.parse(without))] == ["model"]
    exits = without.replace("    dist.destroy_process_group()\n", "    dist.destroy_process_group()\n    os._exit(0)\n")
    assert not ddp_outliving_its_group(ast.parse(exits))


def clock_reads(tree: ast.AST) -> list[tuple[int, bool]]:
    """(line, waits for the GPU) of every time.perf_counter() call: waits when the function it is in calls
    torch.cuda.synchronize on an earlier line (as the stages' clock() does); a read at module level never waits.
    (time.monotonic() times whole jobs from the parent process, which runs no CUDA: tour.py, the benchmarks.)"""
    reads = []
    for func in functions(tree):
        syncs = lines_calling(func, "torch.cuda.synchronize")
        reads += [(line, any(sync < line for sync in syncs)) for line in lines_calling(func, "time.perf_counter")]
    inside = {line for line, _ in reads}
    return reads + [(line, False) for line in lines_calling(tree, "time.perf_counter") if line not in inside]


@pytest.mark.parametrize("path", GPU_SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_clock_read_on_a_gpu_path_waits_for_the_gpu(path):
    """CUDA runs asynchronously: a clock read while kernels are queued times their launches, not the kernels. In a
    script that can run on a GPU, every time.perf_counter() is read in a function that synchronises first (clock());
    scripts that never touch CUDA are left out."""
    unsynced = [line for line, waits in clock_reads(ast.parse(path.read_text())) if not waits]
    assert not unsynced, f"{path.relative_to(ROOT)}: clock read without waiting for the GPU at lines {unsynced}"


def device_first(tree: ast.AST) -> list[int]:
    """Lines of dist.init_process_group calls not preceded, in their function, by torch.cuda.set_device: NCCL binds
    each rank's communicator to the current device, so a rank that sets it later also works on GPU 0."""
    late = []
    for func in functions(tree):
        sets = lines_calling(func, "torch.cuda.set_device")
        late += [line for line in lines_calling(func, "dist.init_process_group") if not any(s < line for s in sets)]
    return sorted(set(late))


@pytest.mark.parametrize("path", [p for p in GPU_SCRIPTS if "init_process_group(" in p.read_text()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_that_can_run_on_a_gpu_sets_its_device_before_joining_the_group(path):
    late = device_first(ast.parse(path.read_text()))
    assert not late, f"{path.relative_to(ROOT)}: init_process_group before torch.cuda.set_device at lines {late}"


def test_the_device_check_sees_a_group_joined_first():
    source = ("def good(device):\n    torch.cuda.set_device(device)\n    dist.init_process_group('nccl')\n"
              "def bad(device):\n    dist.init_process_group('nccl')\n    torch.cuda.set_device(device)\n")
    assert device_first(ast.parse(source)) == [5]

def test_the_clock_check_sees_a_read_that_does_not_wait():
    """The check above, on reads it must flag: one with no synchronize, one before it, one at module level."""
    source = ("import time, torch\n"
              "def clock():\n    torch.cuda.synchronize()\n    return time.perf_counter()\n"
              "def unsynced():\n    return time.perf_counter()\n"
              "def late():\n    t = time.perf_counter()\n    torch.cuda.synchronize()\n    return t\n"
              "START = time.perf_counter()\n")
    assert sorted(clock_reads(ast.parse(source))) == [(4, True), (6, False), (8, False), (11, False)]


# A GPT stage's files that the next stage copies unchanged (checked identical), and that the next changes where its
# method needs it (its README diffs those). grid.py, checks.py and reports.py grow with each stage's flags and groups.
COPIES = {("11_gpt", "12_context_parallel"): ["dataset.py"],
          ("12_context_parallel", "13_pipeline_4d"): ["context_parallel.py", "dataset.py"],
          ("13_pipeline_4d", "14_experts"): ["context_parallel.py", "dataset.py", "evaluate.py", "pipeline.py"]}


LONGEST_FILE = 450  # lines: a file a learner opens holds one concern (nanoGPT's model.py and train.py: ~330 each)


@pytest.mark.parametrize("stage", FOLDER_STAGES)
def test_no_file_of_a_gpt_stage_is_longer_than_a_lesson(stage):
    """A GPT stage is a folder of files by concern so that none is long: one that grows past LONGEST_FILE holds
    two concerns; split it (as checks.py and reports.py were) rather than raise the number."""
    long = {p.name: n for p in (ROOT / stage).glob("*.py") if (n := len(p.read_text().splitlines())) > LONGEST_FILE}
    assert not long, f"{stage}: {long} lines, above {LONGEST_FILE}: split by concern"


@pytest.mark.parametrize("stage", FOLDER_STAGES)
def test_a_gpt_stage_is_its_folder_and_torch(stage):
    """Each GPT stage stands alone, as a reader copies it: its files import the standard library, torch and each
    other, nothing from another stage or the repository's root; and each is named for one concern."""
    beside = {p.stem for p in (ROOT / stage).glob("*.py")}
    foreign = []
    for path in [p for p in (ROOT / stage).glob("*.py") if p.name != "plot_loss.py"]:  # a tool: plots a run with
        # matplotlib (requirements.txt), run on its own; nothing of the stage imports it
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            foreign += [(path.name, n) for n in names
                        if n.split(".")[0] not in {*sys.stdlib_module_names, "torch", "__future__", *beside}]
    assert not foreign, f"{stage} imports from outside its folder, the standard library and torch: {foreign}"


@pytest.mark.parametrize("pair", COPIES, ids="-".join)
def test_a_file_a_gpt_stage_does_not_change_is_a_copy(pair):
    first, then = pair
    differs = [name for name in COPIES[pair] if (ROOT / first / name).read_bytes() != (ROOT / then / name).read_bytes()]
    assert not differs, f"{then}'s {differs} differ from {first}'s: copy them, or take them out of COPIES and diff " \
                        f"them in {then}/README.md"


def test_two_stages_in_one_process_each_get_their_own_files(tmp_path):
    """Tests, notebooks and benchmarks load several stages in one process (tour.load_stage), and the GPT stages' files
    share names (model.py): each stage gets its own, under its own name, whichever was loaded first; and the plain
    names stay free for the next. Two copies of 11 whose model.py differ by one line stand for two stages."""
    import shutil
    stages = {}
    for tag in ("a", "b"):
        copy = tmp_path / tag
        shutil.copytree(ROOT / "11_gpt", copy, ignore=shutil.ignore_patterns("data", "*.png", "*.json", "__pycache__"))
        (copy / "model.py").write_text((copy / "model.py").read_text() + f"\nTAG = {tag!r}\n")
        stages[tag] = load_stage(copy)
    for tag, stage in stages.items():
        model = sys.modules[stage.GPT.__module__]
        assert (model.TAG, inspect.getsourcefile(stage.GPT)) == (tag, str(tmp_path / tag / "model.py")), model
    assert not {"model", "dataset", "train", "checks", "reports"} & set(sys.modules)
    s11, s12 = (load_stage(stage) for stage in FOLDER_STAGES[:2])
    assert inspect.getsourcefile(s11.Trainer) != inspect.getsourcefile(s12.Trainer)
