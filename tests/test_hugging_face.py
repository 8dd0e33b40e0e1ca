"""your_model/hugging_face.md, "Your Hugging Face model": every block of code on the page is the code, every command
on it prints what the page shows, and its claims hold.

- hf_ddp.py and hf_fsdp.py at W = 2, with --accumulate 2 and clipping (which binds on some steps and not on others),
  compute hf_single.py's training: every step's loss and gradient norm, and the final weights, within 1e-10 in
  float64 (measured: 2e-14). The negative controls: a copy of each where every rank keeps rank 0's rows ends 0.04
  from it.
- hf_fsdp.py --checkpoint: every block's forward run again in backward (counted; the control, a --checkpoint that
  does nothing, is told apart) and the same final weights, bit for bit. --init with --steps 0: the file, bit for bit
  (rank 0 read it, broadcast_from_rank0 sent the shards). The tied head: still the embedding's matrix after training;
  a unit of its own for the embedding splits the tie, and torch refuses it.
- --mp bf16 (the page's fine-tune): finite losses, the first within 1e-2 of the same weights' loss in float64 and
  not equal to it; the logits reach the loss in float32 (output_dtype). --compile: 2 steps at W = 1, the losses of
  the float64 run within 1e-4, one graph compiled for both blocks.
- The prose's claims about transformers: labels= shifts inside and computes in float32, the head is tied, GPT-2 has
  no buffer for to_empty to leave as garbage. Bad input: one line naming the flag, exit 2.

The page's four commands run as a reader types them, in order, through python and torchrun themselves, in a work
folder where runs/ fills. The checks' own runs (the controls, --checkpoint, --init with --steps 0, and the page's
hf_fsdp.py command again with its block forwards counted, which must end at the command's weights bit for bit) share
one launch: torchrun starts this file on 2 ranks (drive(), at the end), which runs them one after the other as
main(argv) in one process group. --compile and the other checks run in the pytest process.
"""
from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shlex
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
import torch

from harness import ROOT, TORCHRUN, check, group_of_one, run_job, time_limit
from page_blocks import block_limit, code_mismatch, diff_mismatch, output_mismatch, page_blocks, shown_outputs, untagged

try:
    import transformers  # noqa: F401  (the scripts' one package beyond torch)
    NO_TRANSFORMERS = None
except ImportError as e:
    NO_TRANSFORMERS = f"transformers is not importable ({e}); pip install -r requirements.txt"
needs_transformers = pytest.mark.skipif(NO_TRANSFORMERS is not None, reason=str(NO_TRANSFORMERS))

HERE = ROOT / "your_model"
PAGE = HERE / "hugging_face.md"
BLOCKS = page_blocks(PAGE)
RUNS = [b for b in BLOCKS if b.kind == "run"]
TORCHRUN_2 = ["torchrun", "--standalone", "--nproc_per_node=2"]  # how the page starts a distributed script
TOL = 1e-10  # float64: layouts differ by 2e-14 after 10 steps; a bug by far more (the controls: 0.04)
WRONG_SPLIT = (".chunk(world_size)[rank]", ".chunk(world_size)[0]")  # the controls: every rank keeps rank 0's rows
# The control of --checkpoint: a copy whose flag wraps nothing (the blocks keep every activation, as without it).
NO_CHECKPOINT = ("block.forward = partial(checkpoint, block.forward, use_reentrant=False)", "pass")
COUNTED = ("plain", "checkpoint", "checkpoint_does_nothing")  # drive() counts their blocks' forwards
BLOCK_FORWARDS = "block_forwards.json"  # (recomputations included) on rank 0, into this file


def module(path: Path, change: tuple[str, str] | None = None) -> types.ModuleType:
    """A script of your_model/ as a module, with one line changed if asked. It keeps its own __file__, so that it
    finds the text beside it."""
    source = path.read_text()
    if change:
        assert source.count(change[0]) == 1, f"{path.name}: expected one {change[0]!r} to change"
        source = source.replace(*change)
    mod = types.ModuleType(f"{path.stem}_{'changed' if change else 'as_is'}")
    mod.__file__ = str(path)
    exec(compile(source, str(path), "exec"), mod.__dict__)
    return mod


def command(block) -> tuple[str, list[str], bool]:
    """(script, argv, distributed) of a run block: one `python SCRIPT ...` or `torchrun ... SCRIPT ...` line."""
    words = shlex.split(block.body)
    if words[:1] == ["python"]:
        return words[1], words[2:], False
    assert words[:3] == TORCHRUN_2, f"{block.id}: not a command this test runs: {block.body}"
    return words[3], words[4:], True


@contextlib.contextmanager
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as torchrun gives its workers; the tests share the cores
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_alone(script: str, argv: list[str]) -> None:
    """main(argv) of a distributed script in this process, on the CPU, as the one rank of a group of one (its own
    init and destroy calls skipped), printing nowhere."""
    with group_of_one(), one_thread(), contextlib.redirect_stdout(io.StringIO()), \
            mock.patch.object(torch.distributed, "init_process_group"), \
            mock.patch.object(torch.distributed, "destroy_process_group"):
        module(HERE / script).main([*argv, "--device", "cpu"])


@dataclass
class Ran:
    work: Path  # where runs/ filled
    printed: dict[str, str]  # what each run printed, by block id (the page's commands) or name (the others)

    def summary(self, out: str) -> dict:
        return json.loads((self.work / "runs" / out / "summary.json").read_text())

    def weights(self, out: str) -> dict[str, torch.Tensor]:
        return torch.load(self.work / "runs" / out / "model.pt", weights_only=True)


def out_of(argv: list[str]) -> str:
    """The runs/ folder a command writes: its last --out's (a later flag wins, as argparse reads them)."""
    last = max(i for i, word in enumerate(argv) if word == "--out")
    return Path(argv[last + 1]).name


def single_block():
    (block,) = [b for b in RUNS if not command(b)[2]]
    return block


def single_out() -> str:
    return out_of(command(single_block())[1])


def page_block(script: str, init: bool = False):
    """The page's run block of `script` (its command with --init or without)."""
    (block,) = [b for b in RUNS if command(b)[0].endswith(script) and ("--init" in command(b)[1]) == init]
    return block


def page_run(script: str, init: bool = False) -> str:
    """The block id of the page's command of `script`: the name of its run."""
    return page_block(script, init).id


def phases() -> tuple[list[dict], dict[str, str]]:
    """The checks' own runs, in order, and {name: runs/ folder} of theirs and of the page's commands (by block id).
    "plain" is the page's hf_fsdp.py command again, driven: its block forwards counted, and its weights the page's
    run's, bit for bit (the driven runs compute what the commands do)."""
    fsdp, ddp = command(page_block("hf_fsdp.py"))[1], command(page_block("hf_ddp.py"))[1]
    runs = [{"name": "plain", "script": "your_model/hf_fsdp.py", "argv": [*fsdp, "--out", "runs/hf_fsdp_plain"]},
            {"name": "checkpoint", "script": "your_model/hf_fsdp.py",
             "argv": [*fsdp, "--checkpoint", "--out", "runs/hf_fsdp_checkpoint"]},
            {"name": "checkpoint_does_nothing", "script": "your_model/hf_fsdp.py", "change": NO_CHECKPOINT,
             "argv": [*fsdp, "--checkpoint", "--out", "runs/hf_fsdp_checkpoint_does_nothing"]},
            {"name": "ddp_wrong_split", "script": "your_model/hf_ddp.py", "change": WRONG_SPLIT,
             "argv": [*ddp, "--out", "runs/hf_ddp_wrong_split"]},
            {"name": "fsdp_wrong_split", "script": "your_model/hf_fsdp.py", "change": WRONG_SPLIT,
             "argv": [*fsdp, "--out", "runs/hf_fsdp_wrong_split"]},
            {"name": "loaded", "script": "your_model/hf_fsdp.py",
             "argv": ["--dtype", "float64", "--init", f"runs/{single_out()}/model.pt", "--steps", "0",
                      "--out", "runs/hf_loaded"]}]
    return runs, {**{b.id: out_of(command(b)[1]) for b in RUNS}, **{r["name"]: out_of(r["argv"]) for r in runs}}


PHASES, OUT = phases()


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Ran:
    """The page's commands as a reader types them, through python and torchrun themselves, in a work folder that
    holds your_model/ (a link) and fills runs/; then one launch for the checks' own runs (drive())."""
    if NO_TRANSFORMERS:
        pytest.skip(NO_TRANSFORMERS)
    work = tmp_path_factory.mktemp("hugging_face")
    (work / "your_model").symlink_to(HERE)
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",  # one thread per process, as torchrun gives; no GPU
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # `python`, `torchrun`: ours
    printed = {}
    for block in RUNS:  # in the page's order: the fine-tune loads hf_single.py's model
        run = check(run_job([["bash", "-euo", "pipefail", "-c", block.body]], work, env=env, timeout=block_limit(block),
                            cwd=work))
        printed[block.id] = run.stdout
    (work / "phases.json").write_text(json.dumps(PHASES))
    runs = 3 * len(PHASES)  # each run as much as a launch of 2 ranks and an agent
    launch = check(run_job([[*TORCHRUN, "--standalone", "--nproc_per_node=2", __file__, "phases.json"]], work,
                           env=env, timeout=time_limit(programs=runs), cwd=work))
    parts = launch.stdout.split("=== ")[1:]  # drive() prints "=== NAME" before each run (rank 0 prints the rest)
    assert [p.split("\n", 1)[0] for p in parts] == [p["name"] for p in PHASES], launch.describe()
    printed.update(p.split("\n", 1) for p in parts)
    return Ran(work, printed)


def gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# --- the page shows the code ----------------------------------------------------------------------

def test_every_block_says_what_it_is():
    wrong = untagged(BLOCKS)
    assert not wrong, f"tag these blocks as tests/page_blocks.py says: {wrong}"
    assert [command(b)[0] for b in RUNS] == ["your_model/hf_single.py", "your_model/hf_ddp.py",
                                             "your_model/hf_fsdp.py", "your_model/hf_fsdp.py"], "the page's commands"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "python"], ids=lambda b: b.id)
def test_code_blocks_are_the_files(block):
    why = code_mismatch(block)
    assert why is None, why


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.lang == "diff"], ids=lambda b: b.id)
def test_diffs_are_the_files_diffs(block):
    why = diff_mismatch(block)
    assert why is None, why


def test_the_page_shows_every_hf_script():
    shown = {path for b in BLOCKS if b.lang in ("python", "diff") for path in b.arg.split()}
    assert shown == {f"your_model/{p.name}" for p in HERE.glob("hf_*.py")}


def test_index_links_here():
    assert "(hugging_face.md)" in (HERE / "index.md").read_text()


# --- the page's commands print what it shows ------------------------------------------------------

@needs_transformers
def test_every_command_on_the_page_prints_what_it_shows(ran):
    pairs = shown_outputs(BLOCKS)
    assert [run.id for run, _ in pairs] == [b.id for b in RUNS], "every command's output is on the page"
    for run, shown in pairs:
        why = output_mismatch(shown, ran.printed[run.id])
        assert why is None, why


# --- its claims -----------------------------------------------------------------------------------

@needs_transformers
def test_ddp_and_fsdp_compute_the_single_device_training(ran):
    ref, one = ran.summary(single_out()), ran.weights(single_out())
    assert ref["args"]["dtype"] == "float64" and ref["args"]["accumulate"] == 2
    clip = ref["args"]["clip"]
    assert max(ref["norms"]) > clip > min(ref["norms"]), "clipping should bind on some steps and not on others"
    for script in ("hf_ddp.py", "hf_fsdp.py"):
        name = page_run(script)
        s = ran.summary(OUT[name])
        assert s["args"]["accumulate"] == 2 and s["args"]["dtype"] == "float64", s["args"]
        steps = max(abs(a - b) for key in ("losses", "norms") for a, b in zip(s[key], ref[key], strict=True))
        final = gap(ran.weights(OUT[name]), one)
        assert steps <= TOL and final <= TOL, f"{script} at W = 2: steps {steps:.1e}, weights {final:.1e} from one"
        # What it prints: hf_single.py's lines, the folder it saved to apart.
        assert ran.printed[name].splitlines()[:-1] == ran.printed[single_block().id].splitlines()[:-1]
        control = gap(ran.weights(OUT[f"{script[3:-3]}_wrong_split"]), one)
        assert control > 1e-3, f"{script} keeping rank 0's rows on every rank ends {control:.1e} from one device: " \
                               "the check cannot see a wrong split"
        text = " ".join(PAGE.read_text().split())
        assert f"ends {control:.2f} away" in text, f"the page's control distance: {control:.2f}"


def recomputes(forwards: int, plain: int) -> bool:
    """Whether a run's block forwards are those of a run that recomputes every block once in backward: twice the
    plain run's."""
    return plain > 0 and forwards == 2 * plain


@needs_transformers
def test_activation_checkpointing_recomputes_and_is_the_same_training_bit_for_bit(ran):
    """--checkpoint runs every block's forward again in its backward (counted at GPT2Block.forward: twice the plain
    run's calls) and ends at the plain run's weights bit for bit. The control, a --checkpoint that wraps nothing,
    trains the same too, and the count tells it apart: the bit equality alone could not."""
    plain, checkpointed = ran.weights(OUT[page_run("hf_fsdp.py")]), ran.weights(OUT["checkpoint"])
    assert ran.summary(OUT["checkpoint"])["args"]["checkpoint"]
    assert plain.keys() == checkpointed.keys() and all(torch.equal(plain[k], checkpointed[k]) for k in plain)
    driven = ran.weights(OUT["plain"])  # the page's command driven in the shared group: the command's weights
    assert driven.keys() == plain.keys() and all(torch.equal(plain[k], driven[k]) for k in plain)
    calls = json.loads((ran.work / BLOCK_FORWARDS).read_text())
    assert recomputes(calls["checkpoint"], calls["plain"]), calls
    assert not recomputes(calls["checkpoint_does_nothing"], calls["plain"]), calls


@needs_transformers
def test_init_loads_the_file_bit_for_bit_and_the_tie_survives(ran):
    given, loaded = ran.weights(single_out()), ran.weights(OUT["loaded"])
    assert loaded.keys() == given.keys() and all(torch.equal(loaded[k], given[k]) for k in given)
    trained = ran.weights(OUT[page_run("hf_fsdp.py")])  # FSDP2, 10 steps: a head untied from wte would have drifted
    assert torch.equal(trained["lm_head.weight"], trained["transformer.wte.weight"])
    assert not torch.equal(trained["lm_head.weight"], given["lm_head.weight"]), "it trained"


@needs_transformers
def test_the_bf16_fine_tune_starts_from_the_file_and_rounds_as_bf16_does(ran):
    hf_single = module(HERE / "hf_single.py")
    s = ran.summary(OUT[page_run("hf_fsdp.py", init=True)])
    assert s["args"]["mp"] == "bf16" and s["args"]["checkpoint"] and all(map(math.isfinite, s["losses"]))
    chars, ids = hf_single.load_text()
    model = hf_single.make_model(len(chars), torch.float64)
    model.load_state_dict(ran.weights(single_out()))
    with torch.no_grad():  # the first step's batch, on the weights it started from, in float64
        first = hf_single.windows(ids, s["args"]["batch_size"], s["args"]["seed"], 0)
        exact = hf_single.next_char_loss(model, first).item()
    assert 1e-6 < abs(s["losses"][0] - exact) < 1e-2, (s["losses"][0], exact)
    assert exact < ran.summary(single_out())["losses"][0] - 0.5, "the fine-tune starts from trained weights"
    model.load_state_dict(ran.weights(OUT[page_run("hf_fsdp.py", init=True)]))  # a plain model takes what it saved
    # output_dtype: the logits reach the loss in --dtype (float32), not in bfloat16. Seen in a 1-step run here.
    seen, cross_entropy = [], torch.nn.functional.cross_entropy
    with mock.patch.object(torch.nn.functional, "cross_entropy",
                           lambda logits, *a, **k: seen.append(logits.dtype) or cross_entropy(logits, *a, **k)):
        run_alone("hf_fsdp.py", ["--mp", "bf16", "--steps", "1", "--out", str(ran.work / "runs" / "bf16_alone")])
    assert seen == [torch.float32], seen


@needs_transformers
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's imports
def test_compile_computes_the_eager_steps_with_one_graph_for_both_blocks(ran):
    """--compile, in this process (a group of one, W = 1), 2 steps in float32: the losses of the float64 run."""
    ref = ran.summary(single_out())["losses"][:2]
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    try:
        run_alone("hf_fsdp.py", ["--compile", "--steps", "2", "--out", str(ran.work / "runs" / "compiled")])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    losses = ran.summary("compiled")["losses"]
    assert max(abs(a - b) for a, b in zip(losses, ref, strict=True)) < 1e-4, (losses, ref)
    assert graphs == 1, f"{graphs} graphs compiled: expected one, shared by the two blocks"


@needs_transformers
def test_what_the_page_says_of_transformers():
    hf_single = module(HERE / "hf_single.py")
    chars, ids = hf_single.load_text()
    torch.manual_seed(0)
    model = hf_single.make_model(len(chars), torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight, "the head is the embedding's matrix"
    assert {"lm_head.weight", "transformer.wte.weight"} <= model.state_dict().keys()
    assert not dict(model.named_buffers()), "a buffer would be left as garbage by to_empty: hf_fsdp.py must fill it"
    assert model.config._attn_implementation == "sdpa"
    b = hf_single.windows(ids, 4, 0, 0)[:, :33]
    with torch.no_grad():
        ours = hf_single.next_char_loss(model, b)
        theirs = model(input_ids=b, labels=b).loss  # the inputs as labels: shifted inside
        twice = model(input_ids=b[:, :-1], labels=b[:, 1:]).loss  # the next characters as labels: shifted twice
    assert ours.dtype == torch.float64 and theirs.dtype == torch.float32, "transformers computes it in float32"
    assert abs(ours.item() - theirs.item()) < 1e-5, (ours.item(), theirs.item())
    assert abs(twice.item() - ours.item()) > 1e-3, "the labels shifted twice should give another loss"


@needs_transformers
def test_a_unit_of_its_own_for_the_embedding_splits_the_tie_and_torch_refuses_it():
    """What the page says happens if the tied matrix leaves the root (in a group of one: W = 1 is enough)."""
    from torch.distributed.fsdp import fully_shard
    hf_single = module(HERE / "hf_single.py")
    model = hf_single.make_model(65, torch.float32)
    with group_of_one():
        fully_shard(model.transformer.wte)
        fully_shard(model)
        assert model.lm_head.weight is not model.transformer.wte.weight
        with pytest.raises(ValueError, match="is shared with a parameter already managed by another FSDP group"):
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))


@needs_transformers
@pytest.mark.parametrize(("script", "argv", "flag"), [
    ("hf_single.py", ["--init", "no/such/model.pt"], "--init"),
    ("hf_single.py", ["--accumulate", "3"], "--accumulate"),
    ("hf_single.py", ["--dtype", "float16"], "--dtype"),
    ("hf_ddp.py", ["--batch-size", "15"], "--batch-size"),
    ("hf_ddp.py", ["--accumulate", "16"], "--batch-size"),
    ("hf_fsdp.py", ["--init", "no/such/model.pt"], "--init"),
    ("hf_fsdp.py", ["--batch-size", "6", "--accumulate", "2"], "--batch-size"),
    ("hf_fsdp.py", ["--mp", "fp16"], "--mp"),
])
def test_bad_input_is_refused_in_one_line(script, argv, flag, monkeypatch, capsys):
    """Refused before joining a process group: as every rank of a 2-rank torchrun would (WORLD_SIZE=2)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as exit_:
        module(HERE / script).main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"argument {flag}" in err, err
    assert err.startswith(f"your_model/{script}: error: "), err


# --- the launch: this file is torchrun's script ---------------------------------------------------

def drive(phases_file: str) -> None:
    """Every run in the phases file as the page's command would do it, one after the other: main(argv) of the
    script (or of its changed copy), in one process group, joined once (the scripts' own init and destroy calls
    are skipped). Rank 0 prints "=== NAME" before each."""
    import torch.distributed as dist
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    dist.init_process_group("gloo")
    forwards, block_forward = {}, GPT2Block.forward
    counted = COUNTED

    def counting(self, *args, **kwargs):  # a recomputation in backward calls it too (checkpoint calls forward)
        forwards[name] += 1
        return block_forward(self, *args, **kwargs)

    with mock.patch.object(dist, "init_process_group"), mock.patch.object(dist, "destroy_process_group"):
        for run in json.loads(Path(phases_file).read_text()):
            name = run["name"]
            if dist.get_rank() == 0:
                print(f"=== {name}", flush=True)
            forwards[name] = 0
            with mock.patch.object(GPT2Block, "forward", counting) if name in counted else contextlib.nullcontext():
                module(ROOT / run["script"], run.get("change")).main(run["argv"])
    if dist.get_rank() == 0:
        Path(BLOCK_FORWARDS).write_text(json.dumps({name: forwards[name] for name in counted}))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as the scripts leave (your_model/index.md, "Leaving")


if __name__ == "__main__":
    drive(sys.argv[1])
