"""Stage 02: nn.DataParallel, one process driving every visible GPU.

Each forward scatters the batch over the GPUs, replicates the model onto each, runs the
replicas in threads and gathers the outputs on GPU 0, where the loss is computed. On the
CPU DataParallel has nothing to split, so the model trains exactly as in stage 01.

    python 02_dataparallel/train.py
    python 02_dataparallel/train.py --device cpu --epochs 5 --out runs/02
"""
from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

STAGE = "02_dataparallel"
N_TRAIN, N_EVAL = 4096, 1001  # 1001 is odd: the held-out set never splits evenly over 2, 4 or 8 ranks
N_FEATURES, N_CLASSES, HIDDEN = 8, 4, 64
DTYPES = {"float32": torch.float32, "float64": torch.float64}  # --dtype


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


def load_train_objs(args: argparse.Namespace, device: torch.device):
    train_set, eval_set = make_data(args.seed, DTYPES[args.dtype])
    torch.manual_seed(args.seed)  # the same initial weights in every stage (drawn in float32, then cast)
    model = Net().to(device, DTYPES[args.dtype])
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return train_set, eval_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    # The Trainer reseeds this generator every epoch, so epoch e visits the samples in the
    # order torch.randperm(N, seed + e): the order DistributedSampler uses in stage 03.
    sampler = RandomSampler(dataset, generator=torch.Generator())
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer, epoch: int) -> dict:
    """Weights and momentum after `epoch` epochs, on the CPU: tour.py replays each epoch from them."""
    params = list(model.parameters())
    return {"epoch": epoch, "params": [p.detach().cpu().clone() for p in params],
            "momentum": [optimizer.state[p]["momentum_buffer"].cpu().clone() if p in optimizer.state else None
                         for p in params]}


class Trainer:
    def __init__(self, model: nn.Module, train_loader: DataLoader, optimizer: torch.optim.Optimizer,
                 device: torch.device, seed: int) -> None:
        self.model = model
        self.train_loader = train_loader
        self.optimizer = optimizer
        self.device = device
        self.seed = seed
        self.losses: list[float] = []
        self.steps = 0
        self.trajectory: list[dict] = []  # state_of() at the start and after every epoch

    def _run_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.steps += 1
        return loss.detach()

    def _run_epoch(self, epoch: int) -> float:
        self.train_loader.sampler.generator.manual_seed(self.seed + epoch)
        total = torch.zeros((), device=self.device, dtype=torch.float64)  # float64 in either --dtype: stages compare it
        for x, y in self.train_loader:
            total += self._run_batch(x.to(self.device), y.to(self.device))
        return total.item() / len(self.train_loader)  # one .item() per epoch: no GPU sync per step

    def train(self, epochs: int) -> None:
        self.trajectory.append(state_of(self.model, self.optimizer, 0))
        for epoch in range(epochs):
            start = time.perf_counter()
            self.losses.append(self._run_epoch(epoch))
            self.trajectory.append(state_of(self.model, self.optimizer, epoch + 1))
            print(f"epoch {epoch + 1}/{epochs} | train loss {self.losses[-1]:.4f} "
                  f"| {time.perf_counter() - start:.2f}s")


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, device: torch.device) -> tuple[float, float, int]:
    """Return (sum of losses, number correct, number of samples) over `dataset`."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for x, y in DataLoader(dataset, batch_size=256):
        logits = model(x.to(device))
        loss_sum += F.cross_entropy(logits, y.to(device), reduction="sum").item()
        correct += (logits.argmax(dim=1).cpu() == y).sum().item()
    model.train()
    return loss_sum, correct, len(dataset)


def write_summary(out: Path, summary: dict, model: nn.Module, trajectory: list[dict]) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    torch.save(model.state_dict(), out / "model.pt")
    torch.save(trajectory, out / "trajectory.pt")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line naming the flag, exit 2 (no usage dump)
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind):
    def parse(text: str):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in "invalid int value"
    return parse


def ensure_writable(directory: Path) -> None:
    """Create `directory` if needed and write a file there: mkdir alone succeeds on a read-only disk."""
    directory.mkdir(parents=True, exist_ok=True)
    tempfile.TemporaryFile(dir=directory).close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog=f"{STAGE}/train.py", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=positive(int), default=20)
    p.add_argument("--batch-size", type=positive(int), default=64, help="samples per step per process")
    p.add_argument("--lr", type=positive(float), default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="float64 rounds 5e8 times finer than float32: for checking results, not for speed")
    p.add_argument("--out", type=Path, help="write summary.json, model.pt and trajectory.pt here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda asked but no GPU is visible; use --device cpu (or auto)")
    if args.out is not None:
        try:  # fail now, not after training
            ensure_writable(args.out)
        except OSError as e:
            p.error(f"argument --out: cannot write to {args.out} ({e.strerror}); choose a writable directory")
    return args


def pick_device(choice: str) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def train(device: torch.device, args: argparse.Namespace) -> None:
    train_set, eval_set, model, optimizer = load_train_objs(args, device)
    train_loader = prepare_dataloader(train_set, args.batch_size)
    fallback = " (no GPU visible: using the CPU)" if args.device == "auto" and device.type == "cpu" else ""
    print(f"[{STAGE}] device {device}{fallback} | batch {args.batch_size} | {len(train_loader)} steps/epoch")
    raw_model = model  # keep the unwrapped model: it is what we evaluate and save
    if device.type == "cuda":
        model = nn.DataParallel(model)  # batch split over all visible GPUs; params stay on GPU 0
        print(f"[{STAGE}] DataParallel over {torch.cuda.device_count()} GPU(s)")
    else:
        print(f"[{STAGE}] on the CPU DataParallel has no devices to split over: training as in stage 01")

    trainer = Trainer(model, train_loader, optimizer, device, args.seed)
    start = time.perf_counter()
    trainer.train(args.epochs)
    seconds = time.perf_counter() - start

    loss_sum, correct, count = evaluate(raw_model, eval_set, device)
    print(f"held-out: loss {loss_sum / count:.4f} | accuracy {correct / count:.2%} ({count} samples)")
    if args.out is not None:
        summary = {
            "stage": STAGE, "world_size": 1, "backend": None, "device": device.type,
            "global_batch": args.batch_size, "batch_size": args.batch_size, "epochs": args.epochs,
            "lr": args.lr, "dtype": args.dtype, "seed": args.seed, "steps": trainer.steps, "losses": trainer.losses,
            "eval_loss": loss_sum / count, "eval_accuracy": correct / count, "eval_count": count,
            "replica_max_abs_diff": 0.0, "seconds": seconds,
            "data_parallel_gpus": torch.cuda.device_count() if device.type == "cuda" else 0,
            "samples_per_s": trainer.steps * args.batch_size / seconds,
        }
        write_summary(args.out, summary, raw_model, trainer.trajectory)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    train(pick_device(args.device), args)


if __name__ == "__main__":
    main()
