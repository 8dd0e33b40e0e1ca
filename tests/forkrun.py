"""`torchrun --standalone --nproc_per_node=N script args`, for the tests that check what a script computes, with one
start-up instead of N + 1: `python tests/forkrun.py N PORT script args` (PORT: a free one, for MASTER_PORT).

The suite's cost is start-ups: torchrun's agent imports torch (1.7 CPU-s), each of its N workers imports torch again
(2.5 s) and DDP's constructor imports torch._dynamo (2 s more). Here torch and torch._dynamo are imported once, and the
N ranks are forked from this process, before it has run any tensor work or started a thread. Each rank gets the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...; OMP_NUM_THREADS=1
for N > 1) and runs the script as `python script args` would (as __main__, its folder first on sys.path).
What differs from torchrun: no agent, so no agent's store (the scripts' init_process_group makes its own on MASTER_PORT,
the free port harness.forked picked), no restarts, no monitoring beyond "one rank failed: stop the others" (SIGTERM,
then SIGKILL after GRACE s, the order torchrun's agent uses; its grace is 30 s), and exit status 1 for any failure
(torchrun's too). What torchrun itself does (its rendezvous, restarts, a failing rank ending the job) stays with the
real launcher: the tour, the README blocks and the fault battery (tests/test_faults.py) run it. harness.launch_commands
decides which launches come here.
"""
from __future__ import annotations

import os
import signal
import sys
import time

GRACE = 5.0  # seconds between SIGTERM and SIGKILL for the ranks left when one fails


def run_rank(script: str, args: list[str], env: dict[str, str]) -> int:
    """In the forked child: become rank env['RANK'] and run the script as __main__; its exit status."""
    import atexit
    import runpy
    import traceback
    os.environ.update(env)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # what `python script` puts first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # sys.exit(2) after a refusal, or sys.exit("message")
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter would run at exit
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def main() -> int:
    nproc, port, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: before torch reads it
    import torch  # noqa: F401  the start-up every rank shares
    import torch._dynamo  # noqa: F401  what DDP's constructor imports
    import torch.distributed  # noqa: F401
    threads = os.listdir(f"/proc/{os.getpid()}/task")
    assert len(threads) == 1, f"forkrun: {len(threads)} threads before forking: a fork would copy locks they hold"
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
              "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": "forkrun"}
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            os._exit(run_rank(script, args, env))
        ranks[pid] = rank
    failed, deadline = False, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG) if failed else os.waitpid(-1, 0)
        if pid == 0:  # stopping the others: wait for them, up to the grace, then kill
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.02)
            continue
        ranks.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, deadline = True, time.monotonic() + GRACE
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
