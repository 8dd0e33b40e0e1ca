"""DistributedSampler up close: why every rank calls set_epoch, and what padding and drop_last do to evaluation.

    python your_model/samplers.py
"""
from collections import Counter

import torch
from torch.utils.data import DistributedSampler

N = 1001  # held-out samples: an odd number, so it never splits evenly over 2, 8 or 64 ranks


def set_epoch() -> None:
    # The sampler takes the rank as an argument, so one process can list what a rank would get.
    sampler = DistributedSampler(range(4096), num_replicas=2, rank=0, shuffle=True, seed=0)
    print(f"{'rank 0, first 4 samples of epoch 0:':<47}{list(sampler)[:4]}")
    print(f"{'next epoch, without sampler.set_epoch:':<47}{list(sampler)[:4]}")
    sampler.set_epoch(1)  # what the training loop calls at the start of epoch 1, on every rank
    print(f"{'next epoch, after sampler.set_epoch(1):':<47}{list(sampler)[:4]}")


def padding() -> None:
    # Stand-in for a model's answers on the held-out set: correct[i] is 1 if it got sample i right.
    correct = (torch.rand(N, generator=torch.Generator().manual_seed(0)) < 0.9).long()
    print(f"accuracy over the {N} samples, each once: {correct.sum().item() / N:.3%}")
    print(f"{'W':>2}  {'split':<30} {'scored':>6} {'twice':>6} {'never':>6} {'accuracy':>9}")
    for world_size in (2, 8, 64):
        for split in ("DistributedSampler", "  drop_last=True", "Subset(range(r, N, W))"):
            if split.startswith("Subset"):  # stage 03's evaluate_distributed: rank r scores r, r+W, r+2W, ...
                shares = [range(r, N, world_size) for r in range(world_size)]
            else:  # shuffle=False, as for evaluation: the padding repeats the first samples
                shares = [DistributedSampler(range(N), num_replicas=world_size, rank=r, shuffle=False,
                                             drop_last="drop_last" in split) for r in range(world_size)]
            scored = [i for share in shares for i in share]
            twice = [i for i, t in Counter(scored).items() if t == 2]
            never = sorted(set(range(N)) - set(scored))
            # Each rank's (number right, number scored), added up by an all_reduce, then divided: the accuracy.
            accuracy = correct[scored].sum().item() / len(scored)
            print(f"{world_size:>2}  {split:<30} {len(scored):>6} {len(twice):>6} {len(never):>6} {accuracy:>9.3%}"
                  + (f"  twice: {twice}" if world_size == 2 and twice else "")
                  + (f"  never: {never}" if world_size == 2 and never else ""))
        # Another way to get it wrong: the mean of the ranks' accuracies (their shards differ in size).
        mean = sum(correct[r::world_size].float().mean().item() for r in range(world_size)) / world_size
        print(f"{world_size:>2}  {'  mean of per-rank accuracies':<30} {N:>6} {0:>6} {0:>6} {mean:>9.3%}")


if __name__ == "__main__":
    set_epoch()
    padding()
