"""Stage 05 with the c10d rendezvous: two torchrun nodes on 127.0.0.1, then on two separate "hosts".

The hosts are two Linux network namespaces joined by a veth pair: each has its own interfaces and
addresses and reaches the other only over the veth, as two machines on a LAN do, so the flags a
two-machine job needs are needed here too (05_multinode/README.md shows what fails without them).
Both jobs are runs["05"] (2 nodes x 1 process, batch 32) started another way, and must end at
stage 01's weights at batch 64.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import CONFIGS
from harness import ROOT, TORCHRUN, Run, assert_same_training, check, free_port, launch_commands, programs, time_limit

STEP = CONFIGS["05"]  # the tour's 2-node job: --device cpu --batch-size 32, one process per node
NODES = 2
ENV = {"OMP_NUM_THREADS": "1"}  # the two "nodes" share this machine's cores (as runs["05"] does)


def rdzv_node(endpoint: str, run_id: str, out: Path, *flags: str) -> list[str]:
    """One node's torchrun command in the rendezvous form: no --node_rank, no --master_addr."""
    assert STEP.nproc == 1 and STEP.nnodes == NODES, STEP
    return [*TORCHRUN, f"--nnodes={NODES}", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}", *flags,
            str(ROOT / STEP.stage / "train.py"), *STEP.args, "--out", str(out)]


def assert_same_job_as_stage_01(run: Run, runs) -> None:
    s = run.summary
    assert s["nodes"] == NODES and s["world_size"] == NODES, s["layout"]
    assert run.stdout.count("held-out:") == 1, run.stdout  # one global rank 0 in the whole job
    assert_same_training(run, runs["01"])


def test_c10d_rendezvous_on_localhost(runs, tmp_path):
    """Two terminals on one machine: the same command twice; the first to bind the endpoint hosts it."""
    node = rdzv_node(f"127.0.0.1:{free_port()}", f"local-{os.getpid()}-{tmp_path.name}", tmp_path)
    run = launch_commands([node, node], tmp_path, ENV, timeout=time_limit(programs=programs(STEP)))
    assert_same_job_as_stage_01(check(run), runs)


# --- two hosts: network namespaces -----------------------------------------------------------------

IFNAME = "eth1"  # the same NIC name on both hosts, as on most clusters: one GLOO_SOCKET_IFNAME for all


@dataclass(frozen=True)
class Host:
    netns: str
    addr: str

    def run(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *cmd]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=check)


@pytest.fixture
def two_hosts():
    """Two namespaces, 10.123.0.1 and 10.123.0.2 on a veth pair; removed afterwards, whatever happened."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2's `ip` to create network namespaces")
    hosts = [Host(f"ddp{os.getpid()}-{i}", f"10.123.0.{i + 1}") for i in range(NODES)]
    created: list[str] = []
    try:
        for h in hosts:
            proc = ip("netns", "add", h.netns, check=False)
            if proc.returncode != 0:
                pytest.skip(f"cannot create a network namespace: {proc.stderr.strip()}")
            created.append(h.netns)
        a, b = hosts
        ip("link", "add", IFNAME, "netns", a.netns, "type", "veth", "peer", "name", IFNAME, "netns", b.netns)
        for h in hosts:
            ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", IFNAME)
            ip("-n", h.netns, "link", "set", "lo", "up")
            ip("-n", h.netns, "link", "set", IFNAME, "up")
        yield hosts
    finally:
        for ns in created:  # the harness killed the job's processes; anything else left inside goes too
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            ip("netns", "delete", ns, check=False)  # deletes the veth pair with it


def rx_bytes(host: Host) -> int:
    link = json.loads(ip("-n", host.netns, "-s", "-j", "link", "show", "dev", IFNAME).stdout)[0]
    return link["stats64"]["rx"]["bytes"]


def test_c10d_rendezvous_across_two_hosts(runs, tmp_path, two_hosts):
    """The first host hosts the rendezvous on its LAN address; gloo is told which interface to use."""
    first, second = two_hosts
    endpoint, run_id = f"{first.addr}:{free_port()}", f"netns-{os.getpid()}-{tmp_path.name}"
    # Measured: without is_host=1 neither node hosts the store (the hostname check does not match the
    # address); without --local_addr a node advertises its hostname, which the other may not resolve;
    # without GLOO_SOCKET_IFNAME gloo listens on the hostname's 127.0.0.1 and the peer is refused.
    cmds = [first.run(rdzv_node(endpoint, run_id, tmp_path, "--rdzv_conf=is_host=1", f"--local_addr={first.addr}")),
            second.run(rdzv_node(endpoint, run_id, tmp_path, f"--local_addr={second.addr}"))]
    before = rx_bytes(first)
    run = check(launch_commands(cmds, tmp_path, {**ENV, "GLOO_SOCKET_IFNAME": IFNAME},
                                timeout=time_limit(programs=programs(STEP))))
    assert_same_job_as_stage_01(run, runs)
    # The gradients crossed the veth: every step, each rank's summed gradient depends on all of the
    # other rank's float32 values, so the first host must have received at least that many bytes.
    params = sum(t.numel() for t in run.model.values())
    assert rx_bytes(first) - before >= run.summary["steps"] * params * 4
