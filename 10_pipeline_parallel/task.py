"""by_hand.py's task, word for word train.py's: the data (a known answer to learn), the model and its cut into
pipeline stages, and the loss of micro-batches of any size (padding rows that count for nothing). by_hand.py imports
it; what is new there is the pipeline itself.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

N_TRAIN, N_EVAL = 4096, 1001  # 1001 is odd: the held-out set never splits evenly over 2, 4 or 8 ranks
N_FEATURES, N_CLASSES, HIDDEN = 8, 4, 64
DTYPES = {"float32": torch.float32, "float64": torch.float64}  # --dtype
N_LAYERS = 3  # Linear layers in Net: a pipeline has at most one stage per layer
STAGE_LAYERS = {1: [["body.0", "head.0", "head.2"]], 2: [["body.0"], ["head.0", "head.2"]],  # by --pp
                3: [["body.0"], ["head.0"], ["head.2"]]}
IGNORE = -100  # the label of a padding row: cross_entropy's ignore_index leaves it out of the loss and its gradients


def make_data(seed: int, dtype: torch.dtype = torch.float32) -> tuple[TensorDataset, TensorDataset]:
    """A task with a known answer: the label is the argmax of a fixed random linear map of x."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N_TRAIN + N_EVAL, N_FEATURES, generator=g)
    teacher = torch.randn(N_FEATURES, N_CLASSES, generator=g)
    y = (x @ teacher).argmax(dim=1)
    x = x.to(dtype)  # after the labels: the same task in either --dtype
    return TensorDataset(x[:N_TRAIN], y[:N_TRAIN]), TensorDataset(x[N_TRAIN:], y[N_TRAIN:])


class Net(nn.Module):
    """A small MLP in two halves; stage 07 puts `body` and `head` on different devices."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(N_FEATURES, HIDDEN), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, N_CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def split_layers(model: nn.Module, pp: int) -> list[nn.Sequential]:
    """The model's layers in order, cut into pp runs of whole layers (a Linear and the ReLU after it)."""
    layers: list[list[nn.Module]] = []
    for module in [*model.body, *model.head]:
        if isinstance(module, nn.Linear):
            layers.append([])
        layers[-1].append(module)
    return [nn.Sequential(*[m for layer in layers[i * len(layers) // pp:(i + 1) * len(layers) // pp] for m in layer])
            for i in range(pp)]  # pp 2: stage 07's body | head; pp 3: one Linear each


def load_train_objs(args: argparse.Namespace, device: torch.device, pp_rank: int):
    train_set, eval_set = make_data(args.seed, DTYPES[args.dtype])
    torch.manual_seed(args.seed)  # the same initial weights in every stage (drawn in float32, then cast)
    model = Net().to(device, DTYPES[args.dtype])  # every process builds all of it, then keeps its own stage
    stage_module = split_layers(model, args.pp)[pp_rank]
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=args.lr, momentum=0.9)  # this stage's weights only
    return train_set, eval_set, stage_module, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int, rank: int, world_size: int, seed: int) -> DataLoader:
    # Epoch e shuffles with torch.randperm(N, seed + e) as in stage 01, and rank r takes
    # positions r, r+W, r+2W, ...: so the ranks' step k together covers stage 01's step k at batch W*b.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def padding_note(n: int, world_size: int) -> str | None:
    """What DistributedSampler does when the ranks cannot share the samples evenly, in one line (None if they can)."""
    if n % world_size == 0:
        return None
    extra = world_size - n % world_size
    return (f"note: {n} samples do not split evenly over {world_size} ranks: DistributedSampler repeats the first "
            f"{extra} of each epoch's order, so every rank takes {(n + extra) // world_size} and an epoch trains on "
            f"{n + extra} samples (stage 01's training on that order); drop_last=True would leave out the last "
            f"{n % world_size} instead")


class BatchMeanLoss:
    """The loss of one micro-batch as its share of the batch's mean: the sum over its rows divided by the batch's
    samples. Summed over the micro-batches, however the batch was cut, it is the batch's mean cross-entropy, as in
    stage 01 (a mean per micro-batch, averaged, would weigh a short micro-batch's samples more)."""

    def __init__(self) -> None:
        self.samples = 1  # set before each batch: its real samples, padding not counted

    def __call__(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum") / self.samples


def padded(x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch with padding rows up to `rows`: zeros for the features, IGNORE for the label (they add nothing)."""
    extra = rows - len(y)
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])]), torch.cat([y, y.new_full((extra,), IGNORE)])
