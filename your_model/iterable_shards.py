"""An IterableDataset under DDP must split itself: by rank, and by DataLoader worker within each rank.

    python your_model/iterable_shards.py
"""
import itertools
from collections import Counter

import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


class Stream(IterableDataset):
    """Stand-in for your stream: records read in order from files, a database, the network."""

    def __init__(self, n: int, rank: int | None = None, world_size: int | None = None, by_worker: bool = True):
        self.n, self.by_worker = n, by_worker
        # Under torchrun, from the process group; given here, to play every rank in one process.
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size

    def records(self):
        return iter(range(self.n))

    def __iter__(self):
        info = get_worker_info()  # inside a DataLoader worker: its id and how many there are; else None
        worker, workers = (info.id, info.num_workers) if info and self.by_worker else (0, 1)
        # Every (rank, worker) pair is one reader; reader k of R keeps records k, k+R, k+2R, ...
        # (For files: give reader k the files files[k::R], and it reads them whole.)
        reader, readers = self.rank * workers + worker, self.world_size * workers
        return itertools.islice(self.records(), reader, None, readers)


def main() -> None:
    n, world_size, workers = 1000, 2, 2
    for by_worker in (True, False):
        seen = Counter()
        for rank in range(world_size):  # under torchrun each rank is its own process; here, one after the other
            loader = DataLoader(Stream(n, rank, world_size, by_worker), batch_size=50, num_workers=workers)
            batches = [batch.tolist() for batch in loader]
            seen.update(i for batch in batches for i in batch)
            print(f"split by rank{' and worker' if by_worker else ' only'}: rank {rank} got {len(batches)} batches, "
                  f"the first two start {batches[0][:3]} and {batches[1][:3]}")
        times = Counter(seen.values())  # {times seen: how many samples}
        print(f"  of {n} samples: {times[1]} seen once, {times[2]} twice, {n - len(seen)} never")


if __name__ == "__main__":
    main()
