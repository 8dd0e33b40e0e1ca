"""Where the suite's CPU time goes: `pytest --cpu-profile` (opt-in; CI does not ask for it).

The suite's cost is CPU-seconds (its launches import torch), and on 2 cores its wall time follows them. This plugin
samples /proc four times a second and gives every process the session starts to what started it: a test module, or
the background (the tour, the README blocks, the container build). A process is counted at the largest CPU time seen
for it, so one that lives less than a sample's interval (0.25 s) is missed: a lower bound, close for this suite,
whose processes import torch (2 s or more). The pytest process's own CPU goes to the module running at the time. At
the end it prints CPU-seconds by owner; with CPU_PROFILE_OUT=FILE it also writes every process's line as JSON, with
when it was first and last seen (seconds into the session) and when each module began: what ran beside what.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

import tour

TICK = os.sysconf("SC_CLK_TCK")
INTERVAL = 0.25


class Profile:
    def __init__(self) -> None:
        self.owner = "collection"  # the module of the test running now
        self.jobs: dict[str, str] = {}  # a launched job's tag (tour.JOB_TAG): who launched it
        self.procs: dict[tuple[int, int], dict] = {}  # (pid, start time): owner, command, CPU-seconds
        self.own: Counter[str] = Counter()  # the pytest process's CPU, by module
        self.stop = threading.Event()
        self.start = time.monotonic()
        self.modules: dict[str, float] = {}  # when each module's first test began (seconds into the session)

    def launched(self, tag: str, first_command: str) -> None:
        """Called as a job starts (from tour.clean_env, in the launching thread)."""
        thread = threading.current_thread().name
        if thread.startswith("background-build"):  # conftest.Background's threads
            self.jobs[tag] = "background: the container build"
        elif thread.startswith("background"):
            self.jobs[tag] = "background: the tour" if "tour.py" in first_command else "background: README blocks"
        else:  # a test, or a pool of its own (the settings sweep's)
            self.jobs[tag] = self.owner

    def sample(self) -> None:
        now = round(time.monotonic() - self.start, 2)
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    text = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                fields = text[text.rindex(")") + 2:].split()
                stats[int(entry)] = (int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICK)
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        stack = [os.getpid()]
        while stack:  # every descendant, parents before children
            for pid in children.get(stack.pop(), []):
                stack.append(pid)
                ppid, started, cpu = stats[pid]
                record = self.procs.get((pid, started))
                if record is None:
                    parent = self.procs.get((ppid, stats.get(ppid, (0, 0, 0))[1]))
                    # a leader: a child of the session's forkrun server (itself a child of this process)
                    leader = stats.get(ppid, (0,))[0] == os.getpid() and "forkrun.py --serve" in (parent or {}).get(
                        "command", "")
                    record = self.procs[(pid, started)] = {"owner": self.owner_of(pid, parent, leader), "cpu": cpu,
                                                           "command": self.command(pid), "first": now}
                record["cpu"], record["last"] = max(record["cpu"], cpu), now  # (when: what overlapped what)

    def owner_of(self, pid: int, parent: dict | None, leader: bool = False) -> str:
        try:
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                if item.startswith(f"{tour.JOB_TAG}=".encode()):
                    tag = item.split(b"=", 1)[1].decode()
                    if tag in self.jobs:
                        return self.jobs[tag]
            # A job of the session's forkrun server does not carry the launch's environment: its leader's name does.
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            for tag, owner in self.jobs.items():
                if len(name) == 15 and tag.endswith(name):
                    return owner
        except OSError:
            pass
        if leader:  # a job launched where clean_env is not this process's: a notebook's kernel
            return "forked jobs of the notebooks' kernels"
        return parent["owner"] if parent is not None else self.owner

    @staticmethod
    def command(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            return "?"

    def run(self) -> None:
        last = time.process_time()
        while not self.stop.wait(INTERVAL):
            self.sample()
            now = time.process_time()
            self.own[self.owner] += now - last
            last = now


PROFILE = Profile()


def start(config: pytest.Config) -> None:
    """conftest.py calls this for --cpu-profile: wrap tour.clean_env (every launch calls it), start sampling."""
    clean_env = tour.clean_env

    def tagged(extra: dict[str, str] | None = None) -> dict[str, str]:
        if extra and tour.JOB_TAG in extra:  # run_job's call: its caller's frame holds the commands
            commands = sys._getframe(1).f_locals.get("cmds") or [[""]]
            PROFILE.launched(extra[tour.JOB_TAG], " ".join(commands[0]))
        return clean_env(extra)
    tour.clean_env = tagged
    threading.Thread(target=PROFILE.run, daemon=True, name="cpu_profile").start()
    config.pluginmanager.register(sys.modules[__name__], "cpu_profile")  # its hooks below


def pytest_runtest_setup(item: pytest.Item) -> None:
    PROFILE.owner = item.path.name
    PROFILE.modules.setdefault(item.path.name, round(time.monotonic() - PROFILE.start, 2))


def pytest_terminal_summary(terminalreporter) -> None:
    PROFILE.stop.set()
    PROFILE.sample()
    by_owner: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for record in PROFILE.procs.values():
        by_owner[record["owner"]] += record["cpu"]
        count[record["owner"]] += 1
    total = sum(by_owner.values()) + sum(PROFILE.own.values())
    write = terminalreporter.write_line
    write(f"CPU-seconds by owner (cpu_profile: processes sampled every {INTERVAL}s; the pytest process apart)")
    for owner, cpu in by_owner.most_common():
        write(f"{cpu:9.0f}  {count[owner]:5d} processes  {owner}")
    write(f"{sum(PROFILE.own.values()):9.0f}  the pytest process itself")
    write(f"{total:9.0f}  in all")
    if out := os.environ.get("CPU_PROFILE_OUT"):
        Path(out).write_text(json.dumps({"processes": list(PROFILE.procs.values()), "pytest": dict(PROFILE.own),
                                          "modules": PROFILE.modules}))
