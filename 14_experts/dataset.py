"""The GPT stages' data: tiny Shakespeare (11_gpt/data/input.txt), a character per token, and a step's batch.

The vocabulary is every character the text uses; the first 90% of the text is trained on, the last 10% held out.
A step's batch is drawn from the step's number and the seed alone, the same on every rank, so a run of any layout
sees the windows one process sees.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch

# Tiny Shakespeare, shipped once in the repository (11_gpt/data/README.md says where from), read by every GPT stage
DATA = Path(__file__).resolve().parents[1] / "11_gpt" / "data" / "input.txt"
HELD_OUT = 0.1  # the last tenth of the text is never trained on: the held-out loss is measured there


class Corpus(NamedTuple):
    chars: str  # the vocabulary: every character the text uses, sorted; a token is an index into it
    train: torch.Tensor  # the first 90% of the text as token ids
    held_out: torch.Tensor  # the last 10%


def load_corpus(path: Path) -> Corpus:
    text = path.read_text(encoding="utf-8")
    chars = "".join(sorted(set(text)))  # of the whole text, so that every held-out character has an id
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(len(tokens) * (1 - HELD_OUT))
    return Corpus(chars, tokens[:split], tokens[split:])


def baselines(corpus: Corpus) -> dict[str, float]:
    """The held-out loss (nats per character) of three models that need no training: "it learned" is a comparison.

    uniform: every character equally likely (ln of the vocabulary's size). unigram: each character as frequent as
    in the training text. bigram: the next character given this one, counted in the training text. Counts start at
    1 (add-one smoothing), so no held-out character has probability 0. They predict what the model predicts: every
    held-out character but the first.
    """
    v, train, held = len(corpus.chars), corpus.train, corpus.held_out
    unigram = torch.bincount(train, minlength=v).double() + 1
    pairs = (torch.bincount(train[:-1] * v + train[1:], minlength=v * v).double() + 1).view(v, v)
    return {"uniform": math.log(v),
            "unigram": -(unigram / unigram.sum()).log()[held[1:]].mean().item(),
            "bigram": -(pairs / pairs.sum(1, keepdim=True)).log()[held[:-1], held[1:]].mean().item()}


def batch_of_windows(tokens: torch.Tensor, context: int, rows: int, seed: int, step: int):
    """Step `step`'s batch: `rows` windows of `context` characters at random places, and the same shifted by one.

    One order for every layout: drawn from a generator seeded with seed + step, the same on every rank, so the
    global batch of a step does not depend on how many processes share it (each takes its rows, in Trainer).
    """
    g = torch.Generator().manual_seed(seed + step)
    starts = torch.randint(len(tokens) - context, (rows, 1), generator=g)
    positions = starts + torch.arange(context)
    return tokens[positions], tokens[positions + 1]  # the input, and the next character at every position


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch from the CPU to the training device without waiting: copied from pinned (page-locked) memory, a
    copy runs on the GPU's queue while Python goes on; from ordinary memory it would wait for the GPU to catch up."""
    return batch.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else batch.to(device)

