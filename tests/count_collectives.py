"""Run a script under torch's profiler, from outside, and write down every collective it called.

    torchrun --standalone --nproc_per_node=2 tests/count_collectives.py OUT_DIR 08_fsdp/train.py --epochs 2 ...

Each rank writes OUT_DIR/rank<r>.json, {collective op: calls}, when the script destroys its process group (the
stages leave with os._exit right after it). The stages carry no hook for this: the counter wraps them. (The
profiler, not CommDebugMode: stage 08 counts its first step with a CommDebugMode of its own, and the two do not
nest.)
"""
import json
import runpy
import sys
from pathlib import Path

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

out, script, *args = sys.argv[1:]
profiler = profile(activities=[ProfilerActivity.CPU])
destroy = dist.destroy_process_group


def destroy_and_report(*a, **k):
    profiler.stop()
    counts = {e.key: e.count for e in profiler.key_averages() if e.key.startswith(("c10d::", "_c10d_functional::"))}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(counts))
    return destroy(*a, **k)


dist.destroy_process_group = destroy_and_report
sys.argv = [script, *args]
profiler.start()
runpy.run_path(script, run_name="__main__")
