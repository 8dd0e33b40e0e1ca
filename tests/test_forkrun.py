"""tests/forkrun.py, the suite's launcher for the jobs no fault watches: served from the session's import of torch,
it must behave as the launch it stands for (output, exit status, environment, ranks) and leave nothing behind.

Each case runs a few lines of Python, not a stage (a served launch costs well under a CPU-second), and says who
started it: the session's server (a leader forked from `forkrun.py --serve`), torchrun's agent, or the launch itself.
"""
from __future__ import annotations

import os
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
from harness import FORKRUN, Job, forked, run_job

# What the script's process says about itself: its parent's command line tells who started it.
REPORT = textwrap.dedent("""\
    import os, sys, time
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().replace(b"\\0", b" ").decode()
    served = "forkrun.py --serve" in parent
    agent = "torch.distributed.run" in parent
    print(f"rank {os.environ.get('RANK', '-')} of {os.environ.get('WORLD_SIZE', '-')} pid {os.getpid()} "
          f"served {served} agent {agent} args {sys.argv[1:]}", flush=True)
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
    run = harness.launch_commands([cmd], timeout=60)
    assert run.returncode == 3 and not run.survivors, run.describe()
    assert "rank - of - pid" in run.stdout and "served True agent False args ['--flag', 'x']" in run.stdout, \
        run.describe()
    assert "threads 1" in run.stdout, run.describe()


def test_torchrun_job_is_served_with_torchruns_ranks(tmp_path):
    path = script(tmp_path)
    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=3", str(path), "a"]]), timeout=60)
    assert run.returncode == 0 and not run.survivors, run.describe()
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(" pid ")[0] for line in lines] == ["rank 0 of 3", "rank 1 of 3", "rank 2 of 3"], run.describe()
    assert all(line.endswith("served True agent False args ['a']") for line in lines), run.describe()


def test_a_launch_whose_environment_torch_would_read_otherwise_is_not_served(tmp_path):
    """TORCH_LOGS is read as torch is imported: the server imported it without, so the launch starts its own."""
    run = run_job(forked([[sys.executable, str(script(tmp_path))]]), env={"TORCH_LOGS": "dynamo"}, timeout=60)
    assert run.returncode == 0 and "served False" in run.stdout, run.describe()


def test_a_failing_rank_stops_the_others_and_the_job_fails(tmp_path):
    path = script(tmp_path, """\
        if os.environ["RANK"] == "1":
            sys.exit("rank 1 gives up")
        time.sleep(600)
        """)
    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]]), timeout=120)
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
                    if "--serve" not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                        os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]]), timeout=120,
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
        print(f"left {child}", flush=True)
        """)
    run = run_job(forked([[*harness.TORCHRUN, "--standalone", "--nproc_per_node=2", str(path)]]), timeout=60)
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
    """A stand-in for a test session (a process that starts a server as conftest does, then waits) is ended by
    SIGTERM (what `timeout` and CI limits send; Python then runs no `finally`) or SIGKILL. Its server, which looks
    for its session every second, must be gone within that second plus its own start-up, timed in the same run (the
    server's import of torch: a margin for a loaded machine)."""
    import subprocess
    start = time.monotonic()
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(tmp_path), str(Path(__file__).parent)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=harness.clean_env())
    try:
        assert session.stdout.readline() == b"started\n"
        ready = tmp_path / "socket.env"
        for _ in range(6000):  # a hang guard, not a time bound
            if ready.exists():
                break
            time.sleep(0.01)
        startup, server = time.monotonic() - start, server_of(tmp_path)
        assert ready.exists() and server is not None, "the stand-in session's server never started"
        session.send_signal(how)
        session.wait()
        killed = time.monotonic()
        while alive(server) and time.monotonic() < killed + 1.0 + startup:
            time.sleep(0.02)
        assert not alive(server), f"the server outlived its session by {time.monotonic() - killed:.1f} s " \
                                  f"(bound: 1 s + its start-up {startup:.1f} s)"
    finally:
        session.kill()
        if (left := server_of(tmp_path)) is not None:
            os.killpg(left, signal.SIGKILL)


def test_the_readme_torchrun_forks_its_one_form_and_hands_the_others_to_torchrun(tmp_path):
    path = str(script(tmp_path))
    ours = run_job([[sys.executable, str(FORKRUN), "--torchrun", "--standalone", "--nproc_per_node=2", path]],
                   timeout=60)
    theirs = run_job([[sys.executable, str(FORKRUN), "--torchrun", "--nproc_per_node=2", "--standalone", path]],
                     timeout=120)
    for run, served, agent in ((ours, True, False), (theirs, False, True)):
        assert run.returncode == 0 and not run.survivors, run.describe()
        assert run.stdout.count(f"served {served} agent {agent}") == 2, run.describe()


def test_the_readme_python_forks_a_script_and_hands_the_rest_to_python(tmp_path):
    path = script(tmp_path, "sys.exit(4)\n")
    shims = readme_blocks.launch_shims(tmp_path)
    env = {"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}  # as run_block sets
    ours = run_job([["sh", "-c", f"python {path} a"]], env=env, timeout=60)
    assert ours.returncode == 4 and "served True agent False args ['a']" in ours.stdout, ours.describe()
    for words, code, says in ((["-c", "import sys; print('torch' in sys.modules)"], 0, "False"),  # not imported here
                              ([str(tmp_path / "missing.py")], 2, "can't open file")):  # Python's own refusal
        theirs = run_job([["sh", "-c", " ".join(["python", *map(shlex.quote, words)])]], env=env, timeout=60)
        assert theirs.returncode == code and says in theirs.stdout + theirs.stderr, theirs.describe()
