"""your_model/hf_ddp.py with FSDP2: each rank holds 1/W of the weights, and only rank 0 ever holds them whole.

    torchrun --standalone --nproc_per_node=2 your_model/hf_fsdp.py --out runs/hf_fsdp
"""
import argparse
import json
import os
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import GPT2Config, GPT2LMHeadModel

TEXT = Path(__file__).resolve().parents[1] / "11_gpt" / "data" / "input.txt"  # tiny Shakespeare, in the repository
CONTEXT = 64  # characters the model reads at once (its n_positions)
DTYPES = {"float32": torch.float32, "float64": torch.float64}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2 (no usage dump)
        self.exit(2, f"{self.prog}: error: {message}\n")


def load_text(path: Path = TEXT) -> tuple[str, torch.Tensor]:
    """The vocabulary (every character of the text, sorted) and the text as character ids."""
    text = path.read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    return chars, torch.tensor([index[c] for c in text])


def windows(ids: torch.Tensor, rows: int, seed: int, step: int) -> torch.Tensor:
    """Step `step`'s batch: `rows` windows of CONTEXT + 1 characters at random places, drawn from seed + step (so
    every process that asks for the same step gets the same windows)."""
    g = torch.Generator().manual_seed(seed + step)
    starts = torch.randint(len(ids) - CONTEXT, (rows, 1), generator=g)
    return ids[starts + torch.arange(CONTEXT + 1)]


def make_model(vocab: int, dtype: torch.dtype) -> GPT2LMHeadModel:
    """Built from a config, so nothing is downloaded; from_pretrained(name) would give the same class, trained."""
    config = GPT2Config(vocab_size=vocab, n_positions=CONTEXT, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: a run repeats exactly
                        bos_token_id=None, eos_token_id=None,  # GPT-2's are 50256, outside this vocabulary
                        use_cache=False,  # no cache of keys and values: that is for generating text, one by one
                        attn_implementation="sdpa")  # torch's fused attention, named so a new default can't change it
    return GPT2LMHeadModel(config).to(dtype)  # lm_head.weight IS transformer.wte.weight: one tensor, tied


def next_char_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each window's next character at every position.

    Computed here, in the model's dtype. model(input_ids=x, labels=x).loss gives the same mean (of one position
    fewer) but shifts x inside: pass the inputs as labels, not the next characters. It computes in float32."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog=f"your_model/{Path(__file__).name}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16, help="windows per step")
    p.add_argument("--accumulate", type=int, default=1, help="split each step's batch into this many backward()s")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="the largest gradient norm a step takes")
    p.add_argument("--seed", type=int, default=0, help="the initial weights and the windows")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--init", type=Path, help="start from these weights (a model.pt) instead of random ones")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mp", choices=["bf16"], help="compute in bfloat16 (the weights and optimizer stay in --dtype)")
    p.add_argument("--checkpoint", action="store_true", help="keep only each block's input; recompute the rest")
    p.add_argument("--compile", action="store_true", help="torch.compile every block")
    p.add_argument("--out", type=Path, default=Path("runs/hf_fsdp"))
    args = p.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; checked before joining, on every rank
    if args.batch_size % (world_size * args.accumulate):
        p.error(f"argument --batch-size: {args.batch_size} windows do not split into {world_size} ranks x "
                f"{args.accumulate} pieces; use a multiple of {world_size * args.accumulate}")
    if args.init and not args.init.is_file():
        p.error(f"argument --init: no file {args.init}; give a model.pt that a run wrote")
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per process: LOCAL_RANK is this process's number on its machine
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()

    chars, ids = load_text()
    full = {}  # the whole model's weights: on rank 0 alone, in CPU memory (from_pretrained would go here)
    if rank == 0:
        torch.manual_seed(args.seed)
        full = torch.load(args.init, map_location="cpu", weights_only=True) if args.init \
            else make_model(len(chars), DTYPES[args.dtype]).state_dict()  # what hf_single.py starts from
    with torch.device("meta"):  # the model's structure, with no memory and no values: on every rank
        model = make_model(len(chars), DTYPES[args.dtype])
    mesh = init_device_mesh(device.type, (world_size,))
    # bf16: each block's weights are gathered as bfloat16 and it computes in it; gradients average in float32.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.mp \
        else MixedPrecisionPolicy()
    for block in model.transformer.h:  # first what changes a block's forward, then shard it
        if args.checkpoint:  # inside the forward, so that FSDP's hooks (gather, free) stay outside
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        if args.compile:  # each block on its own, in place (the weights keep their names)
            block.compile()
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # The root: wte, wpe, ln_f and lm_head. The tied wte/lm_head tensor is used at both ends of the forward, so it
    # must stay in the unit that is gathered for the whole forward: the root, never a unit of its own. Its output,
    # the logits, comes back in --dtype: the loss is computed in it.
    fully_shard(model, mesh=mesh, mp_policy=replace(mp, output_dtype=DTYPES[args.dtype]))
    model.to_empty(device=device)  # memory for this rank's shards, values still garbage
    # Rank 0's weights, sent shard by shard: each rank keeps its own. (A buffer not in the state dict, such as the
    # causal mask transformers 4.x kept in attn.bias, would stay garbage: GPT-2 in transformers 5 has none.)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    assert model.lm_head.weight is model.transformer.wte.weight, "the tie did not survive fully_shard and to_empty"
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses, norms = [], []
    for step in range(args.steps):
        # Every rank draws the whole batch of the step (the same windows as one device) and keeps its rows.
        batch = windows(ids, args.batch_size, args.seed, step).chunk(world_size)[rank].to(device)
        optimizer.zero_grad()
        total = torch.zeros((), dtype=DTYPES[args.dtype], device=device)
        pieces = batch.chunk(args.accumulate)
        for i, micro in enumerate(pieces):  # accumulate: the gradients of the pieces add up in .grad
            # No reduce-scatter for the first pieces (the unsharded gradients add up); the last one averages the sum.
            model.set_requires_gradient_sync(i == len(pieces) - 1)
            loss = next_char_loss(model, micro) / args.accumulate  # so that the sum is the mean over the batch
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)  # the ranks' means of equal shares: their mean is the batch's
        total /= world_size
        # The gradients are shards (DTensors): the norm is the whole model's, all-reduced over the mesh.
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).full_tensor()
        optimizer.step()
        losses.append(total.item())
        norms.append(norm.item())
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}, gradient norm {norms[-1]:.4f}")

    # The whole model, gathered unit by unit to rank 0's CPU (every rank calls this; the others get an empty dict).
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out / "model.pt")
        (args.out / "summary.json").write_text(json.dumps({"losses": losses, "norms": norms, "args": vars(args)},
                                                          indent=1, default=str))
        print(f"saved {args.out / 'model.pt'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without Python's teardown: gloo's worker thread may still be freeing the last collective's tensors,
    # which needs the interpreter, and teardown then aborts (your_model/index.md, "Leaving").
    sys.stdout.flush()
    os._exit(0)
