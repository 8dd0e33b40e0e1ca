"""your_model/ddp.py with FSDP2: each rank holds 1/W of the weights, gradients and optimizer state.

    torchrun --standalone --nproc_per_node=2 your_model/fsdp.py --out runs/fsdp
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def make_data(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Stand-in for your data: any map-style Dataset (one with __len__ and __getitem__) is used the same way."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4096 + 1001, 8, generator=g)
    y = (x @ torch.randn(8, 4, generator=g)).argmax(dim=1)  # a rule the model can learn
    return TensorDataset(x[:4096], y[:4096]), TensorDataset(x[4096:], y[4096:])


class Net(nn.Module):
    """Stand-in for your model: a stack of blocks, as most models are (FSDP shards it block by block)."""

    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.ReLU(), nn.Linear(width, width)) for _ in range(depth))
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(width, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@torch.no_grad()
def evaluate(model: nn.Module, dataset, device: torch.device) -> tuple[int, int]:
    """(number of correct answers, number of samples) on `dataset`."""
    model.eval()
    correct = 0
    for x, y in DataLoader(dataset, batch_size=256):
        correct += (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
    model.train()
    return correct, len(dataset)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-workers", type=int, default=0, help="processes that load batches (0: this one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("runs/your_model"))
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":  # one GPU per process: LOCAL_RANK is this process's number on its machine
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # first: before init and any CUDA work, or every rank also uses GPU 0
    # torchrun started this process and set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT: init reads them.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()

    train_set, eval_set = make_data()
    torch.manual_seed(0)
    model = Net().to(device)  # every rank builds the same weights (same seed): FSDP does not broadcast them
    mesh = init_device_mesh(device.type, (world_size,))
    for block in model.blocks:  # each block is gathered whole only while it computes, then freed
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # then the root: the parameters left over (inp, out)
    # After sharding: the optimizer must hold the shards, not the full tensors they replaced.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(train_set, shuffle=True)  # rank r takes every W-th sample of one shuffled order
    if rank == 0 and len(train_set) % world_size:  # 3 ranks, say: it repeats a few samples so that all get as many
        print(f"note: {len(train_set)} samples do not split evenly over {world_size} ranks: DistributedSampler "
              f"repeats the first {world_size - len(train_set) % world_size} of each epoch's order "
              f"(drop_last=True would leave out the last {len(train_set) % world_size} instead)")
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,  # batch_size: per rank
                        num_workers=args.num_workers, persistent_workers=args.num_workers > 0,
                        pin_memory=device.type == "cuda")  # page-locked memory: faster copies to a GPU

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order each epoch, the same on every rank; without it, epoch 0's again
        total = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        dist.all_reduce(total)  # each rank saw other samples: add up the ranks' sums
        if rank == 0:  # one rank prints and saves, or every line comes W times
            print(f"epoch {epoch + 1}: train loss {total.item() / (len(loader) * world_size):.4f}")

    # One file for inference: every rank must call this (it gathers the shards); with cpu_offload, only rank 0
    # receives the whole model, in CPU memory (the other ranks get an empty dict).
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A sharded checkpoint of the model: every rank writes its own shards, in parallel (to resume training, save the
    # optimizer's state beside it: get_state_dict(model, optimizer), as stage 08 does).
    dcp.save(get_model_state_dict(model), checkpoint_id=args.out / "checkpoint")
    if rank == 0:
        torch.save(state, args.out / "model.pt")
        print(f"saved {args.out / 'model.pt'} and {args.out / 'checkpoint'}/")
        plain = Net().to(device)  # a plain model on one device, no FSDP: as inference will use it
        plain.load_state_dict(torch.load(args.out / "model.pt", map_location=device, weights_only=True))
        correct, count = evaluate(plain, eval_set, device)
        print(f"held-out accuracy {correct / count:.2%} ({count} samples)")
    dist.destroy_process_group()
    # Leave without Python's teardown: gloo's worker thread may still be freeing the last collective's tensors,
    # which needs the interpreter, and teardown then aborts (your_model/index.md, "Leaving").
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
