"""your_model/hf_single.py with DistributedDataParallel: each rank computes its share of every step's batch.

    torchrun --standalone --nproc_per_node=2 your_model/hf_ddp.py --out runs/hf_ddp
"""
import argparse
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
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
    p.add_argument("--out", type=Path, default=Path("runs/hf_ddp"))
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
    torch.manual_seed(args.seed)
    model = make_model(len(chars), DTYPES[args.dtype]).to(device)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location=device, weights_only=True))
    # DDP copies rank 0's weights to every rank, then averages the gradients in the last backward() of each step.
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses, norms = [], []
    for step in range(args.steps):
        # Every rank draws the whole batch of the step (the same windows as one device) and keeps its rows.
        batch = windows(ids, args.batch_size, args.seed, step).chunk(world_size)[rank].to(device)
        optimizer.zero_grad()
        total = torch.zeros((), dtype=DTYPES[args.dtype], device=device)
        pieces = batch.chunk(args.accumulate)
        for i, micro in enumerate(pieces):  # accumulate: the gradients of the pieces add up in .grad
            # no_sync: no all-reduce for the first pieces; the last backward() averages the sum over the ranks.
            with model.no_sync() if i < len(pieces) - 1 else nullcontext():
                loss = next_char_loss(model, micro) / args.accumulate  # so that the sum is the mean over the batch
                loss.backward()
            total += loss.detach()
        dist.all_reduce(total)  # the ranks' means of equal shares: their mean is the batch's
        total /= world_size
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # the norm before clipping
        optimizer.step()
        losses.append(total.item())
        norms.append(norm.item())
        if rank == 0:
            print(f"step {step + 1}: loss {losses[-1]:.4f}, gradient norm {norms[-1]:.4f}")

    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(model.module.state_dict(), args.out / "model.pt")  # .module: the model inside DDP
        (args.out / "summary.json").write_text(json.dumps({"losses": losses, "norms": norms, "args": vars(args)},
                                                          indent=1, default=str))
        print(f"saved {args.out / 'model.pt'}")
    # DDP before its process group: freed after it, as main() returns, DDP's reducer would wait for gloo's thread
    # while holding the interpreter that thread needs to free the last collective (pytorch/pytorch#75097): a hang.
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without Python's teardown: gloo's worker thread may still be freeing the last collective's tensors,
    # which needs the interpreter, and teardown then aborts (your_model/index.md, "Leaving").
    sys.stdout.flush()
    os._exit(0)
