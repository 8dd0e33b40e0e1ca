"""docker/: the image a reader builds, and stage 05 as two containers on a bridge network.

The image is built from docker/Dockerfile by a real engine (podman: Docker's daemon does not run
here), on a Debian base made by docker/debian-base.sh (no registry is reachable), with torch from
a wheelhouse instead of an index: only build arguments differ from a reader's build. The job is
docker/compose.yaml, run as written (podman-compose) with the suite's flags in ARGS, and must end
at stage 01's weights. Images, containers and the network are removed afterwards, also on failure.
The compose file's port 29500 is fixed on purpose: it is each container's own, not this machine's.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import pytest

from conftest import CONFIGS
from harness import ROOT, Run, assert_same_training, check, run_command

STEP = CONFIGS["05"]  # the suite's two-node job: one process per node, batch 32, float64
TAG = f"{os.getpid()}-{os.urandom(3).hex()}"  # this run's names: a second run beside it does not collide
PROJECT = f"ddptest{TAG.replace('-', '')}"
IMAGE, BASE = f"localhost/ddp-tutorial:test-{TAG}", f"localhost/ddp-debian-base:test-{TAG}"
# Measured here: podman's default nofile limit (1048576) is above what this sandbox may set ("setrlimit
# RLIMIT_NOFILE: Operation not permitted"), so containers keep the host's limits; no syslog either.
CONTAINERS_CONF = '[containers]\ndefault_ulimits = []\n[engine]\nevents_logger = "file"\n'


def engine_missing() -> str | None:
    """Why no container can be built and run here, or None."""
    missing = [p for p in ("podman", "podman-compose", "debootstrap") if shutil.which(p) is None]
    if missing:
        return f"no container engine: {', '.join(missing)} not installed (.ci/run installs them)"
    return "building a base image with debootstrap needs root" if os.geteuid() != 0 else None


def podman(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Run:
    """One engine command, bounded; fails the test with its output unless it exits 0."""
    return check(run_command(["podman", *args], env=env, timeout=timeout))


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> dict[str, str]:
    """The environment the engine commands run in; removes whatever this module made, whatever happened."""
    if (why := engine_missing()) is not None:
        pytest.skip(why)
    conf = tmp_path_factory.mktemp("engine") / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    env = {"CONTAINERS_CONF": str(conf)}
    try:
        yield env
    finally:
        label = f"io.podman.compose.project={PROJECT}"
        ids = subprocess.run(["podman", "ps", "-aq", "--filter", f"label={label}"], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=60).stdout.split()
        for cmd in (["rm", "-f", *ids] if ids else None, ["network", "rm", "-f", f"{PROJECT}_default"],
                    ["rmi", "-f", IMAGE, BASE]):
            if cmd:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    subprocess.run(["podman", *cmd], env={**os.environ, **env}, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def image(engine, tmp_path_factory) -> str:
    """docker/Dockerfile built on a debootstrapped Debian, torch from the host's pinned wheel."""
    check(run_command([str(ROOT / "docker" / "debian-base.sh"), BASE], env=engine, timeout=600))
    # The wheels the image's pip installs, fetched as docker/README.md's offline build does: its Python
    # (Debian 12's 3.11) and requirements.txt's pins.
    wheels = tmp_path_factory.mktemp("wheels")
    check(run_command([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                       "--python-version", "3.11", "--dest", str(wheels), "torch", "numpy",
                       "--constraint", str(ROOT / "requirements.txt")], timeout=600))
    build = podman("build", "--file", "docker/Dockerfile", "--tag", IMAGE, "--build-arg", f"BASE={BASE}",
                   "--build-arg", "PIP_OPTIONS=--no-index --find-links /wheels", "--volume", f"{wheels}:/wheels:ro",
                   ".", env=engine, timeout=900)
    assert "torch 2." in build.stdout, build.describe()  # the build's own check that torch imports
    return IMAGE


def test_two_containers_on_a_bridge_network_reach_stage_01s_weights(image, engine, tmp_path, request):
    """compose.yaml as a reader runs it: node1 finds node0 by its service name, across the network.

    Stage 01's run is asked for last (a session fixture named in the signature would be made first): the image
    builds while the tour, which makes it, may still run in the background (conftest.background)."""
    env = {**engine, "IMAGE": image, "OUT": str(tmp_path), "ARGS": " ".join(STEP.args)}
    compose = ["podman-compose", "--file", str(ROOT / "docker" / "compose.yaml"), "--project-name", PROJECT]
    assert STEP.nproc == 1 and STEP.nnodes == 2, STEP  # compose.yaml's shape: two nodes, one process each
    try:
        # Not through run_command: `up --detach` leaves the engine's helpers running on purpose (seen: one
        # process beside the containers), and the harness kills whatever a command leaves behind.
        up = subprocess.run([*compose, "up", "--detach", "--no-build"], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
        nodes = [f"{PROJECT}_node{i}_1" for i in range(2)]
        waited = run_command(["podman", "wait", *nodes], env=env, timeout=180)
        if waited.returncode is None:
            pytest.fail(f"the two-node job did not end in 180 s\n{podman('logs', nodes[0], env=env).stdout}")
        logs = [podman("logs", node, env=env) for node in nodes]
        output = "\n".join(f"--- {node} ---\n{log.stdout}{log.stderr}" for node, log in zip(nodes, logs, strict=True))
        codes = waited.stdout.split()
        run = Run(["podman-compose", "up"], 0 if waited.returncode == 0 and set(codes) == {"0"} else 1,
                  output, waited.stderr, waited.seconds, tmp_path)
        check(run)
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):  # the module's fixture removes what is left
            subprocess.run([*compose, "down"], env={**os.environ, **env}, capture_output=True, timeout=120)
    s = run.summary
    # Two hosts as the job saw them: each container has its own hostname and network namespace.
    assert s["nodes"] == 2 and sorted(r["host"] for r in s["layout"]) == ["node0", "node1"], s["layout"]
    assert run.stdout.count("held-out:") == 1, run.stdout  # one global rank 0 in the whole job
    assert_same_training(run, request.getfixturevalue("runs")["01"])
