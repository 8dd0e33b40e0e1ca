"""Stage 05 under a real Slurm: slurm/local_cluster.sh starts two nodes on this machine, and
slurm/train.sbatch, submitted as a reader submits it, must train on both and reach stage 01's weights.

Needs root and the Debian packages slurmctld, slurmd, slurm-client and munge (CI installs them);
skipped otherwise. Every command is bounded in time, ports are picked free, and the cluster is
stopped after the module, also when a test fails.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import DTYPE, B, W
from harness import ROOT, Run, assert_same_training, free_port, run_slurm_command
from tour import EPOCHS

CLUSTER_SH = ROOT / "slurm" / "local_cluster.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"
JOB_TIMEOUT = 120.0  # seconds from sbatch to the end of the job (~15 s here)
PROGRAMS = ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "munged", "mungekey")

_missing = [p for p in PROGRAMS if shutil.which(p) is None]
pytestmark = [
    pytest.mark.skipif(bool(_missing), reason=f"Slurm not installed (no {', '.join(_missing)}): "
                                              "apt-get install slurmctld slurmd slurm-client munge"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a local Slurm cluster needs root (slurmd runs jobs as their user)"),
]


def slurm_env(conf: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Variables for talking to the cluster `conf` (run_slurm_command drops the caller's Slurm ones)."""
    return {"SLURM_CONF": str(conf), **(extra or {})}


def sh(cmd: list[str], env: dict[str, str], timeout: float = 30.0) -> Run:
    """Run `cmd` in its own process group; fail the test after `timeout` seconds (the group is killed)."""
    run = run_slurm_command(cmd, env, timeout)
    if run.returncode is None:
        pytest.fail(f"$ {' '.join(cmd)}\ntimed out after {timeout:.0f}s\n{run.stdout}\n{run.stderr}")
    return run


def processes_under(path: Path) -> list[str]:
    """Live processes whose command line names `path`: the cluster's daemons."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if f"{path}/" in text:
                found.append(f"{cmdline.parent.name} {text}")
    return found


@dataclass
class Cluster:
    dir: Path
    conf: Path
    start: Run

    def logs(self) -> str:
        return "\n".join(f"--- {f.name} (last lines) ---\n" + "\n".join(f.read_text().splitlines()[-20:])
                         for f in sorted((self.dir / "log").glob("*.log")))


@pytest.fixture(scope="module")
def cluster():
    # Not under pytest's tmp_path: munged wants every directory above its socket searchable by all.
    state = Path(tempfile.mkdtemp(prefix="ddp-slurm-test-"))
    env = slurm_env(state / "slurm.conf")
    try:
        start = sh(["bash", str(CLUSTER_SH), "start", str(state)], env, timeout=60)
        assert start.returncode == 0, f"local_cluster.sh start failed:\n{start.stdout}\n{start.stderr}"
        yield Cluster(state, state / "slurm.conf", start)
    finally:
        stop = sh(["bash", str(CLUSTER_SH), "stop", str(state)], env, timeout=60)
        again = sh(["bash", str(CLUSTER_SH), "stop", str(state)], env, timeout=60)
        left = processes_under(state)
        for line in left:  # never leave a daemon behind, even when the script failed to stop it
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[0]), signal.SIGKILL)
        assert stop.returncode == 0 and again.returncode == 0, f"{stop.stderr}\n{again.stderr}"
        assert "not running" in again.stderr, again.stderr  # a second stop is a no-op
        assert not left, f"daemons left running after stop: {left}"
        shutil.rmtree(state, ignore_errors=True)


@dataclass
class Job:
    id: str
    port: int
    out: Path
    log: str
    state: str
    seconds: float


@pytest.fixture(scope="module")
def job(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Submit slurm/train.sbatch on 2 nodes, configured only through its variables and sbatch options."""
    tmp = tmp_path_factory.mktemp("slurm_job")
    out, port = tmp / "out", free_port()
    env = slurm_env(cluster.conf, {
        "REPO": str(ROOT),
        "TORCHRUN": f"{sys.executable} -m torch.distributed.run",  # torchrun, with this interpreter
        "TRAIN_ARGS": f"--device cpu --dtype {DTYPE} --batch-size {B} --epochs {EPOCHS} --out {out}",  # runs["01"]'s
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",  # two "nodes" share this machine's cores (as in the tour)
        "NPROC_PER_NODE": "1", "VENV": "", "MODULES": "",  # not whatever the caller's shell has
    })
    start = time.monotonic()
    submit = sh(["sbatch", "--parsable", f"--nodes={W}", f"--output={tmp}/slurm-%j.out", str(SBATCH)], env)
    assert submit.returncode == 0, f"sbatch failed:\n{submit.stdout}\n{submit.stderr}\n{cluster.logs()}"
    job_id = submit.stdout.strip().split(";")[0]
    log_file = tmp / f"slurm-{job_id}.out"

    def log() -> str:
        return log_file.read_text() if log_file.exists() else "(no job log)"

    # Bounded polling: squeue lists the job until it has ended.
    while sh(["squeue", "-h", "-j", job_id], env).stdout.strip():
        if time.monotonic() - start > JOB_TIMEOUT:
            sh(["scancel", job_id], env)
            pytest.fail(f"job {job_id} still in the queue after {JOB_TIMEOUT:.0f}s (cancelled)\n"
                        f"--- job log ---\n{log()}\n{cluster.logs()}")
        time.sleep(0.5)
    seconds = time.monotonic() - start
    shown = sh(["scontrol", "show", "job", job_id], env).stdout
    state = re.search(r"JobState=(\S+)", shown)
    return Job(job_id, port, out, log(), state.group(1) if state else f"unknown:\n{shown}", seconds)


def test_job_completes_on_two_nodes(job: Job, cluster: Cluster):
    assert job.state == "COMPLETED", f"job {job.id}: {job.state}\n--- job log ---\n{job.log}\n{cluster.logs()}"
    s = json.loads((job.out / "summary.json").read_text())
    assert s["stage"] == "05_multinode"
    assert s["world_size"] == W and s["nodes"] == W
    assert s["global_batch"] == W * B and s["device"] == "cpu" and s["backend"] == "gloo"
    assert s["replica_max_abs_diff"] == 0.0


def test_job_reaches_stage_01_weights(job: Job, runs):
    assert job.state == "COMPLETED", job.log
    # Its outputs, read as a launched run's: stage 01 at batch W*B is the same global batch.
    assert_same_training(Run(["sbatch"], 0, job.log, "", job.seconds, job.out), runs["01"])


def test_log_shows_both_nodes_and_one_rank_zero(job: Job):
    # Node names n1, n2 do not resolve: the script connects to the first node's NodeAddr.
    assert f"rendezvous at 127.0.0.1:{job.port}" in job.log, job.log
    layout = re.findall(r"^\s*node (\d+) \((.*?)\) \| local rank (\d+) \| global rank (\d+)$", job.log, re.M)
    assert sorted((int(n), int(r)) for n, _, _, r in layout) == [(i, i) for i in range(W)], job.log
    assert job.log.count("held-out:") == 1 and job.log.count("epoch 1/") == 1, job.log  # global rank 0 only


def test_start_while_running_says_so(cluster: Cluster):
    before = (cluster.dir / "pids").read_text()
    again = sh(["bash", str(CLUSTER_SH), "start", str(cluster.dir)], slurm_env(cluster.conf))
    assert again.returncode == 0 and "already running" in again.stderr, again.stderr
    assert again.stdout.strip() == f"export SLURM_CONF={cluster.conf}"
    assert (cluster.dir / "pids").read_text() == before  # no second set of daemons
