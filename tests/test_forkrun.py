"""tests/forkrun.py, the suite's launcher for the jobs no fault watches: served from the session's import of torch,
it must behave as the launch it stands for (output, exit status, environment, ranks) and leave nothing behind.

Each case runs a few lines of Python, not a stage (a served launch costs well under a CPU-second), and says who
started it: the session's server (a leader forked from `forkrun.py --serve`), torchrun's agent, or the launch itself.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

import forkrun
import harness
import readme_blocks
from harness import FORKRUN, Job, forked, run_job, time_limit

# What the script's process says about itself: its parent's command line tells who started it.
REPORT = textwrap.dedent("""\
    import os, sys, time
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    served = "forkrun.py --serve" in parent
    agent = "torch.distributed.run" in parent
    # one write per line: the ranks' stdout is unbuffered (`python -u`), and print()'s two writes interleave
    sys.stdout.write(f"rank {os.environ.get('RANK', '-')} of {os.environ.get('WORLD_SIZE', '-')} pid {os.getpid()} "
                     f"served {served} agent {agent} args {sys.argv[1:]}\\n")
    sys.stdout.flush()
    """)


def script(tmp_path: Path, tail: str = "") -> Path:
    path = tmp_path / "report.py"
    path.write_text(REPORT + textwrap.dedent(tail))
    return path


@pytest.fixture(scope="module", autouse=True)
def server_ready() -> None:
    """The session's server answers once it has imported torch (seconds after the session starts; a launch before
    that imports torch itself): these cases are about the server, so they wait for it."""
    ready = Path(f"{os.environ[forkrun.SERVER]}.env")
    for _ in range(6000):  # a hang guard, not a time bound
        if ready.exists():
            return
        time.sleep(0.1)
    pytest.fail(f"the session's forkrun server never wrote {ready}")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_python_launch_is_served_with_its_output_arguments_and_exit_status(tmp_path):
    path = script(tmp_path, "print('threads', os.environ.get('OMP_NUM_THREADS'))\nsys.exit(3)\n")
    cmd = [sys.executable, str(path), "--flag", "x"]
    cmds, env = harness.served([cmd], None)
    assert cmds[0][:3] == [sys.executable, str(FORKRUN), "python"], cmds
    assert env == {"OMP_NUM_THREADS": "1"}, env  # the server's thread count, where the test sets none
    assert harness.served([cmd], {"OMP_NUM_THREADS": "2"})[1] == {"OMP_NUM_THREADS": "2"}  # a test's own stays
    assert harness.served([["bash", "-c", "true"]], None) == ([["bash", "-c", "true"]], None)  # not forked: as it is
    run = harness.launch_commands([cmd], timeout=time_limit(1))
    assert run.returncode == 3 and not run.survivors, run.describe()
    assert "rank - of - pid" in run.stdout and "served True agent False args ['--flag', 'x']" in run.stdout, \
        run.describe()
    assert "threads 1" in run.stdout, run.describe()


def test_torchrun_job_is_served_with_torchruns_ranks(tmp_path):
    path = script(tmp_path)
    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=3", str(path), "a"]]),
                  timeout=time_limit(3))
    assert run.returncode == 0 and not run.survivors, run.describe()
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(" pid ")[0] for line in lines] == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"], run.describe()
    assert all(line.endswith("served True agent False args ['a']") for line in lines), run.describe()


def test_a_launch_whose_environment_torch_would_read_otherwise_is_not_served(tmp_path):
    """TORCH_LOGS is read as torch is imported: the server imported it without, so the launch starts its own."""
    run = run_job(forked([[sys.executable, str(script(tmp_path))]]), env={"TORCH_LOGS": "dynamo"},
                  timeout=time_limit(1))
    assert run.returncode == 0 and "served False" in run.stdout, run.describe()


def test_a_failing_rank_stops_the_others_and_the_job_fails(tmp_path):
    path = script(tmp_path, """\
        if os.environ["RANK"] == "1":
            sys.exit("rank 1 gives up")
        time.sleep(600)
        """)
    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]]), timeout=time_limit(2))
    assert run.returncode == 1 and "rank 1 gives up" in run.stderr and not run.survivors, run.describe()


def test_a_killed_launch_takes_its_ranks_with_it(tmp_path):
    """The launch is what the harness kills at a test's time limit; the ranks are the server's children."""
    path = script(tmp_path, "time.sleep(600)\n")
    ranks: list[int] = []

    def kill_the_launch(job: Job) -> None:
        while not job.ended.is_set():
            pids = [int(line.split(" pid ")[1].split()[0]) for line in job.output().splitlines() if " pid " in line]
            if len(pids) == 2:
                ranks.extend(pids)
                for pid in job.members():  # the launch, not the ranks (forked from the server: its command line)
                    try:
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
                    except FileNotFoundError:  # a member that ended since it was listed (seen under load)
                        continue
                    if "--serve" not in cmdline:
                        os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]]), timeout=time_limit(2),
                  during=kill_the_launch)
    assert run.returncode == -signal.SIGKILL and len(ranks) == 2, run.describe()
    for _ in range(1000):  # the leader looks every 0.05 s; 1000 looks of 0.05 s: a hang guard, not a time bound
        if not any(alive(pid) for pid in ranks):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"ranks {ranks} outlived their launch")


def test_a_process_a_served_rank_leaves_behind_is_found_and_killed(tmp_path):
    """The planted leftover: a rank forks a child that waits for ever, and ends. The child carries the server's
    environment (a fork's /proc/PID/environ is its exec's), not the job's tag: the survivor check must find it by
    the name the leader gave the job's processes, report it and kill it."""
    path = script(tmp_path, """\
        import signal
        child = os.fork()
        if child == 0:
            signal.pause()  # until killed
            os._exit(0)
        sys.stdout.write(f"left {child}\\n")
        sys.stdout.flush()
        """)
    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]]), timeout=time_limit(2))
    left = sorted(int(line.split()[1]) for line in run.stdout.splitlines() if line.startswith("left "))
    assert run.returncode == 0 and "served True" in run.stdout and len(left) == 2, run.describe()
    assert sorted(run.survivors) == left, run.describe()
    for _ in range(1000):  # SIGKILL lands a moment later; 1000 looks of 0.05 s: a hang guard, not a time bound
        if not any(alive(pid) for pid in left):
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"{left} outlived the check that found them")


SESSION = textwrap.dedent("""\
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    import harness
    with harness.forkrun_server(Path(sys.argv[1])):  # as conftest's session fixture starts it
        print("started", flush=True)
        sys.stdin.read()  # until the test ends this process
    """)


def server_of(folder: Path) -> int | None:
    """The pid of the server listening at folder/socket, if one is alive."""
    needle = f"--serve\0{folder / 'socket'}\0".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "cmdline").read_bytes() and alive(int(proc.name)):
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_the_server_ends_with_its_session_however_the_session_ends(tmp_path, how):
    """A stand-in for a test session (a process that starts a server as conftest does, then waits), with a served
    2-rank job running (its ranks wait for ever, each in a session of its own, as torchrun's workers), is ended by
    SIGTERM (what `timeout` and CI limits send; Python then runs no `finally`) or SIGKILL. Its server, which looks
    for its session every second, must be gone within that second plus its own start-up, timed in the same run (the
    server's import of torch: a margin for a loaded machine); and the ranks with it (out of its process group, they
    die with their leader)."""
    import subprocess
    start = time.monotonic()
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(tmp_path), str(Path(__file__).parent)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=harness.clean_env())
    job, ranks = None, []
    try:
        assert session.stdout.readline() == b"started\n"
        ready = tmp_path / "socket.env"
        for _ in range(6000):  # a hang guard, not a time bound
            if ready.exists():
                break
            time.sleep(0.01)
        startup, server = time.monotonic() - start, server_of(tmp_path)
        assert ready.exists() and server is not None, "the stand-in session's server never started"
        from tour import free_port
        job = subprocess.Popen([sys.executable, str(FORKRUN), "2", str(free_port()), str(script(tmp_path, """\
            sys.stdout.write(f"leads {os.getsid(0) == os.getpid()}\\n")
            sys.stdout.flush()
            time.sleep(600)
            """))], stdout=subprocess.PIPE, text=True, start_new_session=True,
            env={**harness.clean_env(), forkrun.SERVER: str(tmp_path / "socket"), **ONE_THREAD})
        lines = [job.stdout.readline() for _ in range(4)]  # each rank's two, in any order
        ranks.extend(int(line.split(" pid ")[1].split()[0]) for line in lines if "served True" in line)
        assert len(ranks) == 2 and lines.count("leads True\n") == 2, lines  # each leads a session of its own
        session.send_signal(how)
        session.wait()
        killed = time.monotonic()
        while any(alive(pid) for pid in [server, *ranks]) and time.monotonic() < killed + 1.0 + startup:
            time.sleep(0.02)
        left = [pid for pid in [server, *ranks] if alive(pid)]
        assert not left, f"{left} (server {server}, ranks {ranks}) outlived the session by " \
                         f"{time.monotonic() - killed:.1f} s (bound: 1 s + the server's start-up {startup:.1f} s)"
    finally:
        session.kill()
        if (left := server_of(tmp_path)) is not None:
            os.killpg(left, signal.SIGKILL)
        if job is not None:
            job.kill()
            job.wait()
        for pid in filter(alive, ranks):  # where the check failed: none left behind
            os.kill(pid, signal.SIGKILL)


def test_the_readme_torchrun_forks_its_one_form_and_hands_the_others_to_torchrun(tmp_path):
    path = str(script(tmp_path))
    ours = run_job([[sys.executable, str(FORKRUN), "--torchrun", "--standalone", "--nproc_per_node=2", path]],
                   timeout=time_limit(2))
    theirs = run_job([[sys.executable, str(FORKRUN), "--torchrun", "--nproc_per_node=2", "--standalone", path]],
                     timeout=time_limit(3))
    for run, served, agent in ((ours, True, False), (theirs, False, True)):
        assert run.returncode == 0 and not run.survivors, run.describe()
        assert run.stdout.count(f"served {served} agent {agent}") == 2, run.describe()


def test_the_readme_python_forks_a_script_and_hands_the_rest_to_python(tmp_path):
    path = script(tmp_path, "sys.exit(4)\n")
    shims = readme_blocks.launch_shims(tmp_path)
    env = {"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}  # as run_block sets
    ours = run_job([["sh", "-c", f"python {path} a"]], env=env, timeout=time_limit(1))
    assert ours.returncode == 4 and "served True agent False args ['a']" in ours.stdout, ours.describe()
    for words, code, says in ((["-c", "import sys; print('torch' in sys.modules)"], 0, "False"),  # not imported here
                              ([str(tmp_path / "missing.py")], 2, "can't open file")):  # Python's own refusal
        theirs = run_job([["sh", "-c", " ".join(["python", *map(shlex.quote, words)])]], env=env, timeout=time_limit(1))
        assert theirs.returncode == code and says in theirs.stdout + theirs.stderr, theirs.describe()


def test_the_readme_shims_run_a_scripts_first_launch_through_the_real_launcher(tmp_path):
    """With a claims folder (readme_blocks.run_docs gives the README blocks one), the first `python script` and the
    first `torchrun --standalone` of a script run through Python and torchrun themselves, the next are forked; what a
    claim records is what ran. A claim made before (the tour's) leaves the first launch forked too."""
    path = script(tmp_path)
    claims = tmp_path / "claims"
    claims.mkdir()
    env = {"PATH": f"{readme_blocks.launch_shims(tmp_path)}{os.pathsep}{os.environ['PATH']}",
           forkrun.REAL_ONCE: str(claims), **ONE_THREAD}
    forms = {"python": f"python {path} a", "torchrun": f"torchrun --standalone --nproc_per_node=2 {path} a"}
    for launcher, command in forms.items():
        for served in (False, True):
            run = run_job([["sh", "-c", command]], env=env, timeout=time_limit(3), cwd=tmp_path)
            agent = launcher == "torchrun" and not served
            ranks = 2 if launcher == "torchrun" else 1
            assert run.returncode == 0 and run.stdout.count(f"served {served} agent {agent} args ['a']") == ranks, \
                (launcher, run.describe())
        claim = json.loads((claims / forkrun.real_once_name(launcher, "report.py")).read_text())
        assert claim == {"cwd": str(tmp_path), "argv": command.split()}, claim
    assert readme_blocks.shimmed(forms["torchrun"]) == ("torchrun", str(path))
    before = tmp_path / "before"
    before.mkdir()
    (before / forkrun.real_once_name("python", "report.py")).write_text('"the tour"')
    run = run_job([["sh", "-c", "python report.py"]], env={**env, forkrun.REAL_ONCE: str(before)},
                  timeout=time_limit(1), cwd=tmp_path)
    assert run.returncode == 0 and "served True" in run.stdout, run.describe()


# What a rank sees as it starts, written to OUT/rank{RANK}.json: the fields a forked rank must share with a real one;
# and what each process must draw for itself (DRAWN).
SEES = textwrap.dedent("""\
    import faulthandler, json, os, signal, sys, warnings
    import torch
    fresh = sorted(sys.modules)  # what `import torch` loads: every script's first import
    threads = len(os.listdir("/proc/self/task"))  # live threads as the script starts
    import random
    import numpy
    import torch.distributed as dist
    main = sys.modules["__main__"]
    parent = os.getppid()
    seen = {
        "env": dict(os.environ), "path0": sys.path[0], "file": __file__, "name": __name__, "cwd": os.getcwd(),
        "argv": sys.argv, "main": [main.__name__, main.__file__, main.__package__, main.__spec__, main.__cached__,
                                   type(main.__loader__).__name__],
        "streams": [[type(s).__name__, type(s.buffer).__name__, s.write_through, s.line_buffering, s.encoding,
                     s.errors] for s in (sys.stdout, sys.stderr)],
        "signals": {name: str(signal.getsignal(getattr(signal, name)))
                    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGCHLD", "SIGUSR1")},
        "faulthandler": faulthandler.is_enabled(),
        # the kernel's own view (a handler set from C, faulthandler's, is not in signal.getsignal): ignored, caught
        "kernel signals": [line for line in open("/proc/self/status") if line.startswith(("SigIgn", "SigCgt"))],
        "warnings": [str(f) for f in warnings.filters],
        "flags": list(sys.flags), "hash": hash("forkrun"), "modules": fresh, "orig_argv": sys.orig_argv,
        "threads": [threads, torch.get_num_threads()], "torch": torch.initial_seed(),
        # where it stands: a session's leader, a group's, in its parent's session, in its parent's group
        "session": [os.getsid(0) == os.getpid(), os.getpgrp() == os.getpid(), os.getsid(0) == os.getsid(parent),
                    os.getpgrp() == os.getpgid(parent)],
        "random": random.random(), "numpy": numpy.random.random()}
    if "RANK" in os.environ:  # the job's store: the agent's under torchrun, the ranks meet through it
        dist.init_process_group("gloo")
        dist.barrier()
        dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"rank{os.environ.get('RANK', '-')}.json"), "w") as f:
        json.dump(seen, f)
    """)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# Values each job draws for itself: its port, its run id (and the error files named after it), the harness's tag;
# and pytest's name of the test that starts it.
OWN = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "DDP_TUTORIAL_JOB", "PYTEST_CURRENT_TEST"}
# What each process draws for itself as it starts: the hash seed (a fork's is the server's), torch's seed (torch
# 2.13 draws one from the OS as it is imported), Python's and numpy's first random numbers. Not compared field by
# field: the caller checks that they differ from process to process.
DRAWN = ("hash", "torch", "random", "numpy")


def error_file_form(env: dict[str, str]) -> str:
    """TORCHELASTIC_ERROR_FILE with the job's folder and run id named generically."""
    path = env.get("TORCHELASTIC_ERROR_FILE", "")
    path = path.replace(env.get("TORCHELASTIC_RUN_ID", "-"), "RUN")
    return re.sub(r"torchelastic_\w+/RUN(_\w+)?/", "torchelastic_X/RUN/", path)


def differences(real: dict, forked: dict, server: dict) -> list[str]:
    """How a forked rank's start differs from a real one's, beyond the two differences a fork must have (the hash
    seed, and the server's modules, which must include the fresh process's). What each process draws (DRAWN) is
    compared across processes by the caller."""
    real, forked = (descriptors_unnumbered(record) for record in (real, forked))
    found = [f"{key}: {real[key]!r} under the real launcher, {forked[key]!r} forked" for key in real
             if key not in ("env", "modules", *DRAWN) and real[key] != forked.get(key)]
    env_r, env_f = real["env"], forked["env"]
    added = {k for k, v in server["added"].items() if env_f.get(k) == v and k not in env_r}  # torch set it there
    for key in sorted({*env_r, *env_f} - OWN - added):
        if env_r.get(key) != env_f.get(key):
            found.append(f"${key}: {env_r.get(key)!r} under the real launcher, {env_f.get(key)!r} forked")
    if error_file_form(env_r) != error_file_form(env_f):
        found.append(f"$TORCHELASTIC_ERROR_FILE: {env_r.get('TORCHELASTIC_ERROR_FILE')!r} against "
                     f"{env_f.get('TORCHELASTIC_ERROR_FILE')!r}")
    if missing := sorted(set(real["modules"]) - set(forked["modules"])):
        found.append(f"modules a fresh process has and a forked one lacks: {missing[:5]}")
    if extra := sorted(set(forked["modules"]) - set(real["modules"]) - set(server["modules"])):
        found.append(f"modules a forked rank has that neither a fresh process nor the server imported: {extra[:5]}")
    return found


def descriptors_unnumbered(record: dict) -> dict:
    """`record` with the descriptor numbers in an mp.spawn child's command line (`spawn_main(tracker_fd=6,
    pipe_handle=10)`) left out: they are whichever numbers were free in its parent, a real process or a forked rank
    (seen: 6 and 10 in one, others in the other, on one CI run). Whether the child finds its pipes at those numbers is
    what its run checks: it reads its task from them."""
    argv = [re.sub(r"\b(tracker_fd|pipe_handle)=\d+", r"\1=N", a) for a in record.get("orig_argv", [])]
    return {**record, "orig_argv": argv} if "orig_argv" in record else record


def server_record() -> dict:
    return json.loads(Path(f"{os.environ[forkrun.SERVER]}.env").read_text())


def sees(run, out: Path) -> list[dict]:
    """The ranks' records (then removed: every run of SEES writes to the same folder, its one argument)."""
    assert run.returncode == 0 and not run.survivors, run.describe()
    found = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    for p in out.glob("rank*.json"):
        p.unlink()
    return found


@pytest.fixture(scope="module")
def sees_script(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("sees")
    (folder / "sees.py").write_text(SEES)
    (folder / "out").mkdir()
    return folder / "sees.py", folder / "out"


@pytest.fixture(scope="module")
def starts(sees_script) -> dict[str, list[dict]]:
    """SEES run four ways: `torchrun --standalone --nproc_per_node=2` itself and forked, `python` itself and forked."""
    path, out = sees_script
    found = {}
    for name, cmd in (("torchrun", [*harness.TORCHRUN, "--standalone", "--nproc_per_node=2"]),
                      ("python", [sys.executable])):
        for how in ("real", "forked"):
            cmds = [[*cmd, str(path), str(out)]]
            cmds = forked(cmds) if how == "forked" else cmds
            # Under nohup (SIGHUP ignored, as CI run from a `nohup` shell had it): what the launch ignores, a program
            # it starts ignores too, but for the signals torchrun's agent handles. One intra-op thread, as the server
            # has and as torchrun gives its workers.
            run = run_job([["nohup", *c] for c in cmds], env=ONE_THREAD, timeout=time_limit(3))
            found[f"{name} {how}"] = sees(run, out)
    return found


def test_a_forked_rank_starts_as_a_real_one(starts):
    """Field by field (environment, sys.path[0], __file__, argv and sys.orig_argv, __main__, the streams' buffering,
    signal handlers, warnings filters, flags, the modules, the live threads and torch's, the session and process
    group it leads or shares with its parent): a forked rank and a rank of torchrun itself, and a forked `python
    script` and Python itself. Each process, forked or not, draws its own seed of torch's and first numbers of
    Python's random and numpy's (torch's and numpy's generators were seeded as the server imported them: a fork copies
    them). What a fork cannot give is said and checked: the real ranks draw their own hash seeds, every forked rank
    has the server's, in every launch."""
    server = server_record()
    for name, ranks in (("torchrun", 2), ("python", 1)):
        real, fork = starts[f"{name} real"], starts[f"{name} forked"]
        assert len(real) == len(fork) == ranks, (name, len(real), len(fork))
        for r, f in zip(real, fork, strict=True):
            assert not (found := differences(r, f, server)), f"{name}, rank {r['env'].get('RANK', '-')}: {found}"
    reals = starts["torchrun real"] + starts["python real"]
    forks = starts["torchrun forked"] + starts["python forked"]  # two launches
    for key in ("torch", "random", "numpy"):
        assert len({s[key] for s in reals}) == len({s[key] for s in forks}) == 3, (key, reals, forks)
    # The fork's one difference: one hash seed for every forked rank of every launch (set orders of strings alike).
    assert len({s["hash"] for s in reals}) == 3 and len({s["hash"] for s in forks}) == 1, (reals, forks)
    real, fork = starts["torchrun real"], starts["torchrun forked"]
    assert real[0]["session"] == [True, True, False, False]  # torchrun's worker leads a session of its own
    assert real[0]["env"]["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the ranks met through the launcher's store
    assert (real[0]["signals"]["SIGHUP"], starts["python real"][0]["signals"]["SIGHUP"]) == ("0", "1")  # nohup's


def own_copy(tmp_path: Path, edit: tuple[str, str]) -> Path:
    """A copy of forkrun.py with one edit, that asks no server (the session's runs the original) and so imports torch
    and forks the ranks itself."""
    copy, text, server = tmp_path / "forkrun.py", FORKRUN.read_text(), f'SERVER = "{forkrun.SERVER}"'
    assert text.count(edit[0]) == text.count(server) == 1, edit
    copy.write_text(text.replace(*edit).replace(server, 'SERVER = "NO_SERVER_FOR_THIS_COPY"'))
    return copy


def test_the_comparison_sees_a_planted_difference(starts, sees_script, tmp_path):
    """forkrun.py with one of torchrun's variables left out (a copy that asks no server, which runs the original)
    must be told apart; and each field of the comparison, changed in a real rank's record, is seen."""
    copy = own_copy(tmp_path, ('"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",', ""))
    path, out = sees_script
    from tour import free_port
    run = run_job([[sys.executable, str(copy), "2", str(free_port()), str(path), str(out)]], env=ONE_THREAD,
                  timeout=time_limit(3))
    server, real = server_record(), starts["torchrun real"][0]
    found = differences(real, sees(run, out)[0], server)
    assert len(found) == 1 and found[0].startswith("$TORCHELASTIC_SIGNALS_TO_HANDLE"), found
    for key in ("path0", "file", "argv", "main", "streams", "signals", "warnings", "flags", "orig_argv", "threads",
                "session"):
        assert differences(real, {**real, key: "changed"}, server), key
    assert differences(real, {**real, "env": {**real["env"], "LOCAL_RANK": "7"}}, server)
    assert differences(real, {**real, "modules": real["modules"][1:]}, server)
    assert differences(real, {**real, "modules": [*real["modules"], "not.imported.anywhere"]}, server)


# SEES in mp.spawn's children (stage 03's launch): each child imports the script again as __mp_main__, and records
# there; a `-c` __main__ has no __file__. A second argument makes child 1 fail after recording.
SPAWNS = SEES.replace("main.__file__, main.__package__, main.__spec__, main.__cached__",
                      'getattr(main, "__file__", None), main.__package__, main.__spec__, '
                      'getattr(main, "__cached__", None)').replace(
    "f\"rank{os.environ.get('RANK', '-')}.json\"", 'f"{__name__}{os.getpid()}.json"') + textwrap.dedent("""\
    def child(index, queue):
        queue.put(index)  # a pipe in the function's arguments: passed as a descriptor, at its number
        if index == 1 and len(sys.argv) > 2:
            raise ValueError("planted in child 1")
    if __name__ == "__main__":
        import torch.multiprocessing as mp
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(child, args=(queue,), nprocs=2)
        print("queued", sorted(queue.get() for _ in range(2)))
    """)


def test_a_forked_mp_spawn_child_starts_as_a_real_one(sees_script, tmp_path):
    """A served `python script` forks mp.spawn's children from the server too (forkrun.SPAWNED): each must start as
    Python's own child does (the fields test_a_forked_rank_starts_as_a_real_one compares), be forked (it has the
    server's torch._dynamo, which a fresh child never imports), and a child that fails must fail the job with its
    traceback, the other ended, nothing left behind."""
    assert SPAWNS.count("getattr(main") == 2 and '{__name__}{os.getpid()}' in SPAWNS  # the replacements took
    path, out = tmp_path / "spawns.py", sees_script[1]
    path.write_text(SPAWNS)
    children = {}
    for how in ("real", "forked"):
        cmds = [[sys.executable, str(path), str(out)]]
        run = run_job([["nohup", *c] for c in (forked(cmds) if how == "forked" else cmds)], env=ONE_THREAD,
                      timeout=time_limit(3))
        assert run.returncode == 0 and not run.survivors and "queued [0, 1]" in run.stdout, run.describe()
        children[how] = [json.loads(p.read_text()) for p in sorted(out.glob("__mp_main__*.json"))]
        for p in out.glob("*.json"):
            p.unlink()
        assert len(children[how]) == 2, (how, run.describe())
    server = server_record()
    for r, f in zip(children["real"], children["forked"], strict=True):
        assert r["name"] == "__mp_main__" and not (found := differences(r, f, server)), found
        assert "torch._dynamo" in f["modules"] and "torch._dynamo" not in r["modules"]  # forked, from the server
    failing = run_job(forked([[sys.executable, str(path), str(out), "fail"]]), env=ONE_THREAD, timeout=time_limit(3))
    assert failing.returncode == 1 and "ValueError: planted in child 1" in failing.stderr, failing.describe()
    assert not failing.survivors, failing.describe()


def test_what_importing_torch_prints_reaches_each_rank(tmp_path):
    """A fresh rank prints torch's import-time warnings on its own stderr; a forked rank, whose torch was imported
    before it existed, prints what that import printed (forkrun.IMPORT_STDERR). Planted: a copy of forkrun whose
    import prints a line, a 2-rank job: the line twice on the job's stderr, once a rank."""
    line = "            import torch  # noqa: F401\n"
    copy = own_copy(tmp_path, (line, line + "            print('torch says: planted', file=sys.stderr)\n"))
    path = script(tmp_path)
    from tour import free_port
    run = run_job([[sys.executable, str(copy), "2", str(free_port()), str(path)]], env=ONE_THREAD,
                  timeout=time_limit(3))
    assert run.returncode == 0 and run.stdout.count("served False") == 2, run.describe()
    assert run.stderr.count("torch says: planted") == 2, run.describe()


def unimported(source: str, fresh: set[str], preloaded: set[str]) -> list[str]:
    """The modules `source` reaches by attribute (`torch.distributed.fsdp.fully_shard`) that a fresh process would
    not have loaded: neither by `import torch` (fresh) nor by one of the file's own imports (it or a submodule of it
    named); only those the server loads (preloaded) matter: what a forked rank has and a fresh one not."""
    import ast
    tree = ast.parse(source)
    named, bound = set(), {}  # modules the file imports (with their parents); names bound to modules
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                named.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
                bound[alias.asname or parts[0]] = alias.name if alias.asname else parts[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            parts = node.module.split(".")
            named.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
            for alias in node.names:
                named.add(f"{node.module}.{alias.name}")
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in bound:
            parts = [*bound[node.id].split("."), *reversed(chain)]
            for i in range(len(bound[node.id].split(".")) + 1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module in preloaded and module not in fresh and module not in named:
                    found.add(f"{module} (line {node.lineno})")
    return sorted(found)


def scripts() -> list[Path]:
    return sorted(p for p in harness.ROOT.rglob("*.py")
                  if not any(part.startswith(".") for part in p.relative_to(harness.ROOT).parts))


def test_no_script_uses_a_module_only_the_server_imported(starts, tmp_path):
    """A forked rank starts with the server's modules (torch._dynamo's, torch.distributed.fsdp among them): a script
    that reaches one by attribute without importing it passes forked and fails under torchrun. None does; a planted
    one is found, and is shown passing forked and failing in Python itself."""
    fresh = set(starts["python real"][0]["modules"])
    preloaded = set(server_record()["modules"]) - fresh
    assert "torch.distributed.fsdp" in preloaded and "torch.distributed.fsdp" not in fresh  # the premise
    found = {str(p.relative_to(harness.ROOT)): unimported(p.read_text(), fresh, preloaded) for p in scripts()}
    assert not {k: v for k, v in found.items() if v}, found
    planted = tmp_path / "planted.py"
    planted.write_text("import torch\n\nprint(torch.distributed.fsdp.fully_shard.__name__)\n")
    assert unimported(planted.read_text(), fresh, preloaded) == ["torch.distributed.fsdp (line 3)"]
    stage = (harness.ROOT / "04_ddp_torchrun" / "train.py").read_text()
    assert unimported(stage + "\ntorch.distributed.fsdp.fully_shard\n", fresh, preloaded)
    forked_run = run_job(forked([[sys.executable, str(planted)]]), env=ONE_THREAD, timeout=time_limit(1))
    real_run = run_job([[sys.executable, str(planted)]], env=ONE_THREAD, timeout=time_limit(1))
    assert forked_run.returncode == 0 and "fully_shard" in forked_run.stdout, forked_run.describe()
    assert real_run.returncode == 1 and "AttributeError" in real_run.stderr, real_run.describe()


# What a run measures of the machine rather than computes: left out when a forked run is compared with a real one.
MEASURED = ("seconds", "train_seconds", "tokens_per_s", "mfu", "peak_flops", "peak", "memory")


def trained(summary: dict) -> dict:
    """A summary's numbers that training computes: all but MEASURED, and each curve point without its tokens/s
    ([step, train loss, held-out loss, tokens/s])."""
    kept = {k: v for k, v in summary.items() if k not in MEASURED}
    return {**kept, "curve": [point[:3] for point in summary["curve"]]}


def test_a_forked_stage_14_run_trains_as_torchruns_does(tmp_path):
    """Stage 14 with its experts over ep 2 (2 ranks: all-to-alls, the experts' own groups, a balancing loss), 3 steps
    in float64, under torchrun itself and forked: the same training bit for bit (the summary's losses, gradient
    norms, held-out loss, each expert's load and balancing losses; its timings apart) and the same weights. The
    comparison is sharp: one loss one ulp away is told apart. A small model on a small corpus (harness.small_corpus):
    what a fork could change (the modules, seeds, threads and environment a rank starts with) does not depend on
    the model's size, and the default's held-out scoring was most of this test's CPU time."""
    import math
    step = harness.Step("14_experts", "torchrun", ("--ep", "2", "--max-steps", "3", "--eval-every", "3",
                                                   "--sample", "0", "--dtype", "float64", "--layers", "2",
                                                   "--heads", "2", "--width", "32", "--context", "24",
                                                   "--batch-size", "4", "--data", str(harness.small_corpus(tmp_path))),
                        nproc=2)
    runs = {}
    for how, programs in (("real", 3), ("forked", 2)):  # torchrun's agent and 2 ranks; 2 ranks
        out = tmp_path / how
        cmds = forked(step.commands(out)) if how == "forked" else step.commands(out)
        assert (cmds[0][1] == str(FORKRUN)) == (how == "forked"), cmds
        runs[how] = harness.check(run_job(cmds, out, ONE_THREAD, timeout=time_limit(programs=programs)))
    real, fork = (trained(runs[how].summary) for how in ("real", "forked"))
    assert {"losses", "grad_norms", "eval_loss", "experts"} <= real.keys() and real["experts"]["load"], real
    assert real == fork, {k: (real[k], fork.get(k)) for k in real if real[k] != fork.get(k)}
    assert harness.max_abs_diff(runs["real"].model, runs["forked"].model) == 0.0
    nudged = {**fork, "losses": [math.nextafter(fork["losses"][0], math.inf), *fork["losses"][1:]]}
    assert nudged != real
