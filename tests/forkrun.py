"""`torchrun --standalone --nproc_per_node=N script args`, for the tests that check what a script computes, with one
start-up instead of N + 1: `python tests/forkrun.py N PORT script args` (PORT: a free one, for MASTER_PORT); and
`python script args` as `python tests/forkrun.py python script args`.

The suite's cost is start-ups: torchrun's agent imports torch (1.7 CPU-s), each of its N workers imports torch again
(2.5 s) and DDP's constructor imports torch._dynamo (2 s more). Here torch and torch._dynamo are imported once, and the
N ranks are forked from this process, before it has run any tensor work or started a thread. Each rank starts as
torchrun's worker does: its variables (torchrun_env: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, the run id, an
error file, TORCHELASTIC_USE_AGENT_STORE...; OMP_NUM_THREADS=1 for N > 1), the job's store hosted by this process as
by torchrun's agent (the ranks connect to it; none hosts one), `python -u script args` (a fresh __main__, the
script's folder first on sys.path, __file__ absolute, argv as given, stdout and stderr unbuffered), the signal
handlers of a program the launch (torchrun's agent) starts, what importing torch printed, sys.orig_argv (`python -u
script args`), a session of its own (torchrun's start_new_session; a `python script` leads what its launch leads),
torch's and numpy's global generators seeded from the OS (a fork would copy the server's). tests/test_forkrun.py
compares a forked rank with a real torchrun rank, field by field. Two differences remain, as a fork must have them:
every forked rank of the session shares this process's hash seed, across launches too (torchrun's ranks each draw
their own, so a set of strings iterates in another order on each: a script whose ranks walk such a set to issue
collectives would disagree under torchrun and agree here), and they start with the modules imported here
(torch._dynamo's 800 and more, beside torch's own): test_forkrun checks that no script uses a module it does not
import (a script that reached torch.distributed.fsdp through torch alone would pass here and fail under torchrun).
The tour, the fault battery, the README commands of 11, 12 and your_model/, and the first README launch of every
other script run through torchrun itself. What torchrun does beyond starting its workers (rendezvous between nodes,
restarts, the agent's monitoring) stays with the real launcher: here, one rank failing stops the others (SIGTERM to
each one's process group, then SIGKILL after GRACE s, as torchrun's agent does; its grace is 30 s), and the exit
status is 1 for any failure (torchrun's too).
A forked `python script` that starts processes with mp.spawn (stage 03, the tools that measure several world sizes)
has its children forked from the server too (SPAWNED): multiprocessing would start each as a fresh interpreter
importing torch again; test_forkrun compares such a child with Python's own, field by field.
harness.launch_commands decides which test launches come here, readme_blocks.launch_shims which README commands.

Within a test session even that one import is shared: the session starts a server (`forkrun.py --serve SOCKET`,
harness.forkrun_server) that imports torch once and forks a leader for each launch whose environment is the one torch
was imported with (else the launch imports for itself, as above). The leader takes the launch's stdin, stdout,
stderr, working directory and environment, runs its ranks, and answers with the exit status; the launch, a small
process that never imports torch, waits for it, and if the launch is killed (its test's time limit) the leader kills
the ranks at once. A leader's processes carry the server's environment as their own (/proc/PID/environ is what a
process was started with), so the leader names itself after the launch's tag (PR_SET_NAME: its last 15 characters)
and its ranks inherit the name: the harness's survivor check finds them by it (tour._job_members), and the leader
reaps every rank before it answers. The server looks every second for the session that started it, and ends with
it, its leaders and ranks too, however the session ended.
"""
from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import os
import re
import select
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

GRACE = 5.0  # seconds between SIGTERM and SIGKILL for the ranks left when one fails
PYTHON = "python"  # in place of N and PORT: one process, as `python script args`


def run_rank(script: str, args: list[str], env: dict[str, str], orig_argv: list[str]) -> int:
    """In the forked child: become rank env['RANK'] and run the script as __main__; its exit status. `orig_argv`: the
    command line the rank stands for (sys.orig_argv: `python -u script args` under torchrun)."""
    import atexit
    import builtins
    import importlib.machinery
    import io
    import traceback
    import types
    os.write(2, IMPORT_STDERR)  # what importing torch printed, as a fresh process prints it
    warnings.filters[:] = FRESH_FILTERS
    os.environ.update(env)
    # faulthandler's handlers (SIGSEGV, SIGABRT...: the stacks a crash, or tour.print_stacks, has printed), set from
    # C and reset by start_signals: as a fresh interpreter sets them from the launch's PYTHONFAULTHANDLER
    faulthandler.disable()
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable()
    sys.orig_argv = orig_argv
    # torch's generator (torch.rand, a model's initial weights) and numpy's global one were seeded from the OS as the
    # server imported them (torch imports numpy.random): a fork copies their state, so every forked rank of the
    # session would draw the same numbers where a script sets no seed. A fresh process seeds each from the OS as it
    # imports it: so here. (Python's `random` reseeds itself in a forked child: os.register_at_fork. CUDA's
    # generators are made in the rank, by its first use of CUDA.)
    if (torch := sys.modules.get("torch")) is not None:
        torch.default_generator.seed()
    if (numpy_random := sys.modules.get("numpy.random")) is not None:
        numpy_random.seed()
    main = types.ModuleType("__main__")  # a fresh __main__, the script's
    if script == "-c":  # `python -c CODE args`: mp.spawn's child (SPAWNED), its code given
        text, path = args[0], "<string>"
        sys.argv, sys.path[0] = ["-c", *args[1:]], ""  # as `python -c` sets them
        main.__dict__.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter)
    else:
        text = None  # read in the try below, as the script's own errors are
        sys.argv = [script, *args]  # the script as given: `python script` leaves sys.argv[0] so
        path = os.path.abspath(script)  # and __file__ absolute, as `python script` gives it
        sys.path[0] = os.path.dirname(path)  # what `python script` puts first
        main.__dict__.update(__file__=path, __cached__=None, __builtins__=builtins,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    if not env and SPAWNED:  # `python script`: its mp.spawn children are forked from the server too (SPAWNED)
        import multiprocessing
        multiprocessing.set_executable(SPAWNED)
    if env:  # torchrun starts its workers as `python -u script`: stdout and stderr unbuffered
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding=sys.stdout.encoding,
                                      errors=sys.stdout.errors, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding=sys.stderr.encoding,
                                      errors=sys.stderr.errors, write_through=True)
    code = 0
    try:
        if text is None:
            with open(path, "rb") as source:
                text = source.read()
        exec(compile(text, path, "exec"), main.__dict__)
    except SystemExit as e:  # sys.exit(2) after a refusal, or sys.exit("message")
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException as e:  # printed from the script's first frame, as `python script` prints it
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter would run at exit
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


IMPORT_STDERR = b""  # what importing torch printed (its warnings): each rank prints it, as a fresh process would
FRESH_FILTERS: list = []  # the warnings filters after `import torch` alone (sympy, imported by torch._dynamo, adds one)


def imported() -> None:
    """The start-up every rank shares, in a process that must stay single-threaded until it forks. What it prints
    on stderr is kept for the ranks (IMPORT_STDERR), not printed here (the server's log)."""
    global IMPORT_STDERR
    import tempfile
    saved = os.dup(2)
    with tempfile.TemporaryFile() as printed:
        os.dup2(printed.fileno(), 2)
        try:
            import torch  # noqa: F401
            FRESH_FILTERS[:] = warnings.filters  # what a script finds after its `import torch`
            import torch._dynamo  # noqa: F401  what DDP's constructor imports
            import torch.distributed  # noqa: F401
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        printed.seek(0)
        IMPORT_STDERR = printed.read()
    threads = os.listdir(f"/proc/{os.getpid()}/task")
    assert len(threads) == 1, f"forkrun: {len(threads)} threads before forking: a fork would copy locks they hold"


# The signals torchrun's agent handles (TORCHELASTIC_SIGNALS_TO_HANDLE): its workers start with them at their default.
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def ignored_signals() -> list[int]:
    """The signals the launch ignores (a `nohup` shell's SIGHUP, say): a program it execs ignores them too. (SIGPIPE:
    every Python ignores it as it starts.)"""
    return [int(s) for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGPIPE)
            and signal.getsignal(s) == signal.SIG_IGN]


def start_signals(ignored: list[int], agent: bool) -> None:
    """In a rank: the handlers a fresh `python script` started by the launch would have (by torchrun's agent, for
    `agent`): what the launch ignored stays ignored (exec keeps it), but the agent's own signals; the rest at their
    default; SIGINT Python's KeyboardInterrupt, SIGPIPE ignored, as Python sets them."""
    for s in signal.valid_signals():
        if s in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.SIG_IGN if s in ignored and not (agent and s in AGENT_SIGNALS) else signal.SIG_DFL
        if s == signal.SIGPIPE:
            handler = signal.SIG_IGN
        elif s == signal.SIGINT and handler == signal.SIG_DFL:
            handler = signal.default_int_handler
        with contextlib.suppress(OSError, ValueError):
            signal.signal(s, handler)


def leads() -> str:
    """What the launch's process leads: "session" (a session of its own, as the harness starts every launch),
    "group" (a process group: a shell's job), or "" (neither). A `python script` rank takes the same place."""
    return "session" if os.getsid(0) == os.getpid() else "group" if os.getpgrp() == os.getpid() else ""


def take_place(place: str, leader: int) -> None:
    """In a rank: lead a session or a group, as the process it stands for does (torchrun starts each worker in a
    session of its own: start_new_session). Out of the leader's group, which the server's end (os.killpg) reaches,
    a rank dies with its leader instead (PR_SET_PDEATHSIG), and ends now if the leader has already gone."""
    if place == "session":
        os.setsid()
    elif place == "group":
        os.setpgid(0, 0)
    if place:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != leader:
            os._exit(1)


def stop(pid: int, sig: int) -> None:
    """Signal a rank as torchrun's agent does, its process group (os.killpg); the rank alone if it has not made its
    group yet (just forked) or belongs to the leader's."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
            return
    except ProcessLookupError:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def torchrun_env(nproc: int, port: str, run_id: str, errors: str) -> list[dict[str, str]]:
    """Each rank's variables, as `torchrun --standalone` sets them for its workers (torch 2.13)."""
    common = {"MASTER_ADDR": "localhost", "MASTER_PORT": port, "WORLD_SIZE": str(nproc),
              "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default",
              "ROLE_WORLD_SIZE": str(nproc), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
              "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
              "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}
    return [{**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank),
             "TORCHELASTIC_ERROR_FILE": os.path.join(errors, run_id, "attempt_0", str(rank), "error.json")}
            for rank in range(nproc)]


def run_ranks(nproc: int, port: str, script: str, args: list[str], client: socket.socket | None = None,
              ignored: list[int] | None = None, orig_argv: list[str] | None = None, place: str = "") -> int:
    """Fork the N ranks, wait for them; one failing stops the others. With `client` (a server's job): its
    connection closing (the test's launch killed, at its time limit) kills the ranks at once. Port PYTHON: one
    process as `python script args` (no torchrun variables, its own exit status; `orig_argv` its command line,
    `place` what its launch leads: leads()). A torchrun job's store is this process's, as it is torchrun's agent's
    (TORCHELASTIC_USE_AGENT_STORE: the ranks connect to it, none hosts one); its ranks each lead a session."""
    import shutil
    import tempfile
    import uuid
    errors = tempfile.mkdtemp(prefix="torchelastic_")  # where torchrun has each rank's error file
    envs = [{}] if port == PYTHON else torchrun_env(nproc, port, str(uuid.uuid4()), errors)
    for env in envs:
        if "TORCHELASTIC_ERROR_FILE" in env:
            os.makedirs(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]))
    if port != PYTHON:  # what torchrun's agent runs: `python -u script args` (PYTHON_EXEC: another interpreter)
        orig_argv, place = [os.environ.get("PYTHON_EXEC", sys.executable), "-u", script, *args], "session"
    sys.stdout.flush()
    sys.stderr.flush()
    ranks, leader = {}, os.getpid()
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            if client is not None:
                client.close()
            take_place(place, leader)
            start_signals(ignored_signals() if ignored is None else ignored, agent=port != PYTHON)
            os._exit(run_rank(script, args, envs[rank], orig_argv or [sys.executable, script, *args]))
        ranks[pid] = rank
    try:
        return wait_for(ranks, port, client)
    finally:
        shutil.rmtree(errors, ignore_errors=True)


def wait_for(ranks: dict[int, int], port: str, client: socket.socket | None) -> int:
    """Host the job's store (after forking: it starts threads), then wait for the ranks as run_ranks says."""
    store = None
    if port != PYTHON:
        import torch.distributed as dist
        try:
            store = dist.TCPStore("localhost", int(port), is_master=True, wait_for_workers=False)
        except Exception as e:  # the port taken since it was picked: torchrun's agent would fail too
            print(f"forkrun: cannot host the job's store on port {port}: {e}", file=sys.stderr, flush=True)
            for other in ranks:
                stop(other, signal.SIGKILL)
            for _ in ranks:
                os.waitpid(-1, 0)
            return 1
    failed, deadline = False, float("inf")
    while ranks:
        if client is not None and select.select([client], [], [], 0.05)[0]:  # the launch is gone: so is the job
            for other in ranks:
                stop(other, signal.SIGKILL)
            failed, deadline, client = True, float("inf"), None
        pid, status = os.waitpid(-1, os.WNOHANG) if failed or client is not None else os.waitpid(-1, 0)
        if pid == 0:  # stopping the others: wait for them, up to the grace, then kill
            if time.monotonic() > deadline:
                for other in ranks:
                    stop(other, signal.SIGKILL)
                deadline = float("inf")
            if client is None:
                time.sleep(0.02)
            continue
        ranks.pop(pid)
        if port == PYTHON:
            return os.waitstatus_to_exitcode(status)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, deadline = True, time.monotonic() + GRACE
            for other in ranks:
                stop(other, signal.SIGTERM)
    del store  # closed once every rank has ended, as torchrun's agent closes its own
    return 1 if failed else 0


def shim_form(launcher: str, args: list[str], exists: bool = True) -> str | None:
    """The script of `torchrun args` or `python args` if it is a form the README shims fork, else None: `torchrun
    --standalone --nproc_per_node=N script ...` and `python script.py ...` (a file that exists, unless `exists` is
    False: a README's command read before the copy it runs in is made)."""
    if launcher == "torchrun":
        forked = len(args) >= 3 and args[0] == "--standalone" and re.fullmatch(r"--nproc_per_node=\d+", args[1]) \
            and not args[2].startswith("-")
        return args[2] if forked else None
    return args[0] if args and args[0].endswith(".py") and (not exists or os.path.isfile(args[0])) else None


# A folder (the README shims set it; popped here, so no launch sees it) where each launcher and script the shims see
# is claimed once: the first launch of a script through a launcher runs through the real one (python, torchrun),
# the later ones are forked. So every script a README launches runs through its real launcher once in the session
# (readme_blocks.run_docs: the pairs the tour runs are claimed before, test_readme_commands checks the rest).
REAL_ONCE = "DDP_TUTORIAL_REAL_ONCE"


def claimed_first(folder: str | None, launcher: str, script: str) -> bool:
    """Whether this launch is the first of `script` through `launcher` (claimed in `folder`, with what it ran)."""
    if not folder:
        return False
    path = Path(folder) / real_once_name(launcher, os.path.relpath(os.path.abspath(script)))
    try:
        with open(path, "x") as f:
            json.dump({"cwd": os.getcwd(), "argv": [launcher, *sys.argv[2:]]}, f)
    except FileExistsError:
        return False
    return True


def real_once_name(launcher: str, script: str) -> str:
    return f"{launcher} {script}".replace("/", "%")


# mp.spawn's children, in a served `python script` (run_rank sets multiprocessing's executable to this file's
# `--spawned`, written by the server beside its socket): multiprocessing starts each child as `python -c
# "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=T, pipe_handle=P)" --multiprocessing-fork`,
# with the pipes T and P open, and any other the parent passed. That form is forked from the server, each
# descriptor at its number, so the child starts from the one import of torch as the script did, and reads its task
# from the pipe as a fresh child does: it imports the script as __mp_main__ again, and runs the function mp.spawn
# was given. Any other form (another interpreter flag, the forkserver's start) is Python's own. The parent's Popen
# waits for this process, which ends as the child does; terminated (mp.spawn stops the others when one fails), it
# takes the child with it (the leader kills it: a child's own SIGTERM handler would not run, as it would there).
SPAWNED = ""  # the server's executable for them; "" where there is no server
SPAWN_MAIN = re.compile(r"from multiprocessing\.spawn import spawn_main; "
                        r"spawn_main\(tracker_fd=(\d+), pipe_handle=(\d+)\)")


def spawned(args: list[str]) -> int:
    """`forkrun.py --spawned ARGS`: multiprocessing's child, forked from the server where its form allows."""
    *flags, c, prog, fork = args if len(args) >= 3 else ["?"] * 3
    code = SPAWN_MAIN.fullmatch(prog) if (c, fork) == ("-c", "--multiprocessing-fork") else None
    if code:
        # Every descriptor the parent passed (spawn's pipes, and any a queue or a connection in the function's
        # arguments added): the child finds each at its number. Nothing else is open here above stderr.
        passed = [fd for fd in sorted(int(name) for name in os.listdir("/proc/self/fd")) if fd > 2 and valid(fd)]
        # The parent's interpreter flags (sys.flags), which a fork keeps: served only if they are the server's.
        served = ask_server(1, PYTHON, "-c", args[-2:], fds=tuple(passed), flags=flags,
                            orig_argv=[*interpreter(), *args])
        if served is not None and served < 0:  # killed by a signal: so is this process, as the child was
            signal.signal(-served, signal.SIG_DFL)
            os.kill(os.getpid(), -served)
        if served is not None:
            return served
    os.execv(sys.executable, [sys.executable, *args])


def valid(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # the listing's own, closed since
        return False
    return True


def interpreter() -> list[str]:
    """This launch's `python [flags]`, before forkrun.py in its command line: what the program it stands for was
    started with (its sys.orig_argv, before the script)."""
    return sys.orig_argv[:len(sys.orig_argv) - len(sys.argv)]


def main() -> int:
    once = os.environ.pop(REAL_ONCE, None)
    python = interpreter()  # before sys.argv changes
    if sys.argv[1] == "--spawned":
        return spawned(sys.argv[2:])
    if sys.argv[1] == "--torchrun":  # tests/readme_blocks.py's `torchrun`: the form it can run, or torchrun itself
        args = sys.argv[2:]
        if (script := shim_form("torchrun", args)) is None or claimed_first(once, "torchrun", script):
            os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", *args])
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tour import free_port  # the suite's one way to pick a port (stdlib only: no torch in the launch)
        sys.path.pop(0)  # the script's sys.path is `python script`'s (run_rank)
        sys.argv = [sys.argv[0], args[1].split("=")[1], str(free_port()), *args[2:]]
    if sys.argv[1] == "--python":  # tests/readme_blocks.py's `python`: `python script.py args` forked, else python
        args = sys.argv[2:]
        if (script := shim_form("python", args)) is None or claimed_first(once, "python", script):
            os.execv(sys.executable, [sys.executable, *args])
        sys.argv = [sys.argv[0], PYTHON, *args]
    if sys.argv[1] == PYTHON:  # `forkrun.py python script args`: `python script args`, from the server if it can
        nproc, port, script, args = 1, PYTHON, sys.argv[2], sys.argv[3:]
    else:
        nproc, port, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    if nproc > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: before torch reads it
    served = ask_server(nproc, port, script, args, orig_argv=[*python, script, *args])
    if served is not None and served < 0:  # the script's process was killed by a signal: so is this one
        signal.signal(-served, signal.SIG_DFL)
        os.kill(os.getpid(), -served)
    if served is not None:
        return served
    if port == PYTHON:
        os.execv(sys.executable, [sys.executable, script, *args])
    imported()
    code = run_ranks(nproc, port, script, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown: ~0.5 CPU-s of collecting torch's objects, for nothing


# A server (`forkrun.py --serve SOCKET`, one per test session: conftest starts it) makes the start-up once for every
# job: each `forkrun.py N PORT script args` whose environment is the server's asks it to fork a leader, which takes
# the launch's stdin, stdout and stderr and working directory and runs the ranks as above; the launch waits for the
# leader's exit status. The environment must be the server's (what torch read as it was imported), but for these:
JOB_ENV = {
    # the launch's tag, the test's name, the shell's; read when used (a subprocess, CUDA's first call,
    # init_process_group), not as torch is imported;
    "DDP_TUTORIAL_JOB", "PYTEST_CURRENT_TEST", "PWD", "OLDPWD", "SHLVL", "_", "PATH", "CUDA_VISIBLE_DEVICES",
    "MASTER_ADDR", "MASTER_PORT",
    # what a notebook's kernel adds (Jupyter's, IPython's and matplotlib's folders, its terminal settings,
    # tests/test_notebooks.py's folders), none of them read by torch;
    "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "JPY_PARENT_PID", "IPYTHONDIR",
    "PYDEVD_USE_FRAME_EVAL", "MPLBACKEND", "MPLCONFIGDIR", "TERM", "PAGER", "GIT_PAGER", "CLICOLOR", "CLICOLOR_FORCE",
    "FORCE_COLOR", "NOTEBOOK_RUNS", "NOTEBOOK_REUSE",
    # what inductor sets in a process that loads a compiled module, just before it loads one (a test that compiles
    # in-process leaves it in the session's environment; a rank that compiles sets its own);
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    # read by Python as it starts: the leader applies it (sys.dont_write_bytecode);
    "PYTHONDONTWRITEBYTECODE",
}
# and what importing torch adds (TORCHINDUCTOR_CACHE_DIR), if it has the server's value.
SERVER = "DDP_TUTORIAL_FORKRUN_SERVER"  # the server's socket, set in the session's environment


def comparable(env: dict[str, str], added: dict[str, str] | None = None) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in JOB_ENV and (added or {}).get(k) != v}


def ask_server(nproc: int, port: str, script: str, args: list[str], fds: tuple[int, ...] = (),
               flags: list[str] | None = None, orig_argv: list[str] | None = None) -> int | None:
    """The job's exit status, run by the session's server; None where there is none or its environment differs.
    `fds`: descriptors beyond stdin, stdout and stderr that the job has at the same numbers (SPAWNED's pipes);
    `flags`: the interpreter flags the job must start with (SPAWNED's), None for any: a fork has the server's;
    `orig_argv`: a `python` job's command line (run_ranks)."""
    path = os.environ.get(SERVER)
    try:
        server = json.loads(Path(f"{path}.env").read_text()) if path else None
        if server is None or flags is not None and flags != server["flags"]:
            return None
        mine = comparable(dict(os.environ), server["added"])
        if differs := sorted(k for k in {*mine, *server["env"]} if mine.get(k) != server["env"].get(k)):
            with open(f"{path}.unserved", "a") as log:  # the session's summary counts them (tests/conftest.py)
                log.write(" ".join(differs) + "\n")
            return None
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
    except OSError:
        return None
    request = {"nproc": nproc, "port": port, "script": script, "args": args, "cwd": os.getcwd(),
               "env": dict(os.environ), "ignored": ignored_signals(), "fds": [0, 1, 2, *fds], "orig_argv": orig_argv,
               "place": leads()}
    socket.send_fds(conn, [json.dumps(request).encode()], request["fds"])
    reply = conn.recv(16)  # the leader's, once every rank has ended; nothing if the leader died
    return int(reply) if reply else 1


def lead(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the server's child: become the launch (its files, directory, environment) and run its ranks."""
    import fcntl
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in [conn.fileno(), *fds]]  # clear of the numbers below
    conn.close()
    conn = socket.socket(fileno=high.pop(0))
    for fd in fds:
        os.close(fd)
    for target, fd in zip(request["fds"], high, strict=True):  # each at the launch's number
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))  # read by Python as it starts
    tag = request["env"].get("DDP_TUTORIAL_JOB", "")
    # The process's name carries the launch's tag (its last 15 characters), and so do the ranks it forks: the
    # survivor check (tour._job_members) finds them by it, and `pytest --cpu-profile` finds its owner so.
    ctypes.CDLL(None).prctl(15, tag[-15:].encode(), 0, 0, 0)  # PR_SET_NAME
    code = run_ranks(request["nproc"], request["port"], request["script"], request["args"], client=conn,
                     ignored=request["ignored"], orig_argv=request["orig_argv"], place=request["place"])
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        conn.send(str(code).encode())


def serve(path: str) -> None:
    global SPAWNED
    SPAWNED = f"{path}.python"
    import shlex
    Path(SPAWNED).write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} "
                             f'{shlex.quote(os.path.abspath(__file__))} --spawned "$@"\n')
    os.chmod(SPAWNED, 0o755)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    before = comparable(dict(os.environ))  # what torch reads as it is imported
    imported()
    added = {k: v for k, v in os.environ.items() if k not in before}  # and what it sets
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # this server's own path: a killed one's socket may be left
    listener.bind(path)
    listener.listen(64)
    # The modules the ranks start with (test_forkrun checks that no script uses one of them without importing it).
    import subprocess
    Path(f"{path}.env.tmp").write_text(json.dumps({"env": before, "added": added, "modules": sorted(sys.modules),
                                                   "flags": subprocess._args_from_interpreter_flags()}))
    os.rename(f"{path}.env.tmp", f"{path}.env")  # clients read it first: whole or not at all
    session = os.getppid()
    while True:
        if os.getppid() != session:  # the test session that started this server is gone, however it ended (a
            os.killpg(0, signal.SIGKILL)  # SIGKILL runs no finally): this server, its leaders and their ranks go too
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # leaders that have ended
                pass
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 64)
        if os.fork() == 0:
            listener.close()
            try:
                lead(conn, json.loads(message), fds)
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:
        sys.exit(main())
