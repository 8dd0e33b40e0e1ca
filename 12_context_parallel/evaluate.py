"""How well the GPT does, measured with the model as it trains (sharded, split: no rank holds it whole): the loss on
the whole held-out text, and a sample of generated text. Under --cp each rank scores its share of every window's
positions (a window cp cannot split evenly is padded; --sp: its share must split over tp too)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from context_parallel import ContextParallel
from grid import Grid


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's logits for x, whole over the vocabulary: --sp leaves them split over tp (a DTensor), gathered here,
    where every rank needs them whole (a sample, a loss on few windows)."""
    logits = model(x)
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def held_out_loss(model: nn.Module, tokens: torch.Tensor, context: int, grid: Grid, cp: ContextParallel,
                  device: torch.device) -> tuple[float, int]:
    """Sum of the losses on every held-out character but the first, in windows of `context`, with the model as it
    trains (sharded, split: no rank holds it whole). The dp rows share the windows (row r scores r, r+dp, ...: each
    once; a row's tp ranks score the same ones together, its cp ranks each their share of the positions); every rank
    runs as many batches (FSDP's forward is a collective: each unit all-gathers), some maybe empty; one all_reduce
    over dp x cp adds the sums."""
    model.eval()
    dp_rank, dp = grid.coords["dp"], grid.sizes["dp"]
    starts = torch.arange(0, len(tokens) - 1, context)
    whole, tail = starts[starts + context + 1 <= len(tokens)], starts[starts + context + 1 > len(tokens)]
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for chunk in whole[dp_rank::dp].tensor_split(-(-len(whole) // (dp * 32))):  # batches of up to 32 windows
        windows = tokens[chunk[:, None] + torch.arange(context + 1)]
        x, y = cp.share(windows[:, :-1]).to(device), cp.share(windows[:, 1:]).to(device)
        logits = logits_of(model, x).double()
        totals += torch.tensor([F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item(),
                                y.numel()], dtype=torch.float64, device=device)
    for start in tail.tolist():  # the text's last window is shorter: every rank computes it, dp row 0 counts it
        window = tokens[start:][None]
        x, y = cp.pad(window[:, :-1], 0), cp.pad(window[:, 1:], -100)  # -100: ignored by the loss
        x, y = cp.share(x).to(device), cp.share(y).to(device)
        logits = logits_of(model, x)
        if dp_rank == 0:
            totals += torch.tensor([F.cross_entropy(logits[0].double(), y[0], reduction="sum").item(),
                                    (y != -100).sum().item()], dtype=torch.float64, device=device)
    if hasattr(model, "reshard"):  # FSDP2 keeps the root unit gathered after a forward, for a backward: none follows
        model.reshard()
    model.train()
    dist.all_reduce(totals, group=grid.group("dp_cp"))
    return totals[0].item(), int(totals[1].item())


@torch.no_grad()
def sample(model: nn.Module, chars: str, length: int, context: int, seed: int, cp: ContextParallel,
           device: torch.device, temperature: float = 0.8) -> str:
    """`length` characters, each drawn from the model's prediction given those before it (its last `context`).
    Every rank runs it with the model as it trains (its forward is a collective): the same seed, the same logits
    (every rank computes them whole, or, under --cp, gathers them from its cp group), so the same characters."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([[chars.find("\n") if "\n" in chars else 0]])  # start as a line starts
    for _ in range(length):
        n = idx[:, -context:].shape[1]
        x = cp.pad(idx[:, -context:], 0)  # to a length cp can split
        logits = cp.gather(logits_of(model, cp.share(x).to(device)), x.shape[1])[0, n - 1].double().cpu()
        next_char = torch.multinomial((logits / temperature).softmax(-1), 1, generator=g)
        idx = torch.cat([idx, next_char[None]], dim=1)
    if hasattr(model, "reshard"):
        model.reshard()
    model.train()
    return "".join(chars[i] for i in idx[0, 1:].tolist())


def clock(device: torch.device) -> float:
    """Seconds on a steady clock, read once the GPU has finished its queued work: CUDA runs asynchronously, so a
    clock read without waiting would time the kernels' launches, not the kernels."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
