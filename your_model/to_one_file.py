"""A sharded checkpoint (a directory that dcp.save wrote, every rank its own shards) to one file torch.load reads.

    python your_model/to_one_file.py runs/fsdp/checkpoint runs/fsdp/from_checkpoint.pt
"""
import sys

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

# One process, no process group, no GPU, any number of ranks wrote it: the shards are joined into whole tensors.
dcp_to_torch_save(sys.argv[1], sys.argv[2])
print(f"wrote {sys.argv[2]}")
