"""Run a GPT stage's train.py with its training steps after the first two under torch.cuda.set_sync_debug_mode("error").

    torchrun --standalone --nproc_per_node=2 tests/sync_debug_step.py 12_context_parallel --cp 2 --device cuda ...

In that mode any call that makes the host wait for the GPU (a copy from ordinary host memory, `.item()`, a mask
copied in, a `nonzero`) raises, so the run fails where a step would wait. The first two steps run without it: DDP
builds its buckets in the first backward and rebuilds them at the second forward, once. Everything else (evaluation,
logging, checkpoints) is left as it is: it reads numbers on purpose, between steps. Rank 0 prints a line for each
step that ran checked (the stage ends with os._exit: nothing runs after main). tests/test_gpu.py runs it.
"""
from __future__ import annotations

import os
import sys

import torch

from harness import load_stage

WARM_UP = 2


def main() -> None:
    stage, argv = sys.argv[1], sys.argv[2:]
    module = load_stage(stage)
    plain = module.Trainer._run_step

    def run_step(self) -> torch.Tensor:
        if self.steps - self.resumed_at < WARM_UP:
            return plain(self)
        torch.cuda.set_sync_debug_mode("error")
        try:
            result = plain(self)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        if os.environ.get("RANK", "0") == "0":
            print(f"sync_debug_step: step {self.steps + 1} ran under set_sync_debug_mode('error')", flush=True)
        return result

    module.Trainer._run_step = run_step
    module.main(argv)


if __name__ == "__main__":
    main()
