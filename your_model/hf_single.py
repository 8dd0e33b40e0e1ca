"""A small GPT-2 from Hugging Face transformers learns Shakespeare on one device: the start of hugging_face.md.

    python your_model/hf_single.py --out runs/hf_single
"""
import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
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
    p.add_argument("--out", type=Path, default=Path("runs/hf_single"))
    args = p.parse_args(argv)
    if args.batch_size % args.accumulate:
        p.error(f"argument --accumulate: {args.accumulate} does not divide --batch-size {args.batch_size}")
    if args.init and not args.init.is_file():
        p.error(f"argument --init: no file {args.init}; give a model.pt that a run wrote")
    device = torch.device(args.device)

    chars, ids = load_text()
    torch.manual_seed(args.seed)
    model = make_model(len(chars), DTYPES[args.dtype]).to(device)
    if args.init:
        model.load_state_dict(torch.load(args.init, map_location=device, weights_only=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    losses, norms = [], []
    for step in range(args.steps):
        batch = windows(ids, args.batch_size, args.seed, step).to(device)
        optimizer.zero_grad()
        total = torch.zeros((), dtype=DTYPES[args.dtype], device=device)
        for micro in batch.chunk(args.accumulate):  # accumulate: the gradients of the pieces add up in .grad
            loss = next_char_loss(model, micro) / args.accumulate  # so that the sum is the mean over the batch
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # the norm before clipping
        optimizer.step()
        losses.append(total.item())
        norms.append(norm.item())
        print(f"step {step + 1}: loss {losses[-1]:.4f}, gradient norm {norms[-1]:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / "model.pt")
    (args.out / "summary.json").write_text(json.dumps({"losses": losses, "norms": norms, "args": vars(args)},
                                                      indent=1, default=str))
    print(f"saved {args.out / 'model.pt'}")


if __name__ == "__main__":
    main()
