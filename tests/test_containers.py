"""docker/: the image a reader builds, and stage 05 as two containers on a bridge network.

The image is built as the session starts, in the background (tests/containers.py says how, and why in the
background). The job is docker/compose.yaml, run as written (podman-compose) with the suite's flags in ARGS,
and must end at stage 01's weights. Images, containers and the network are removed at the end of the session,
also on failure. The compose file's port 29500 is fixed on purpose: it is each container's own, not this machine's.
"""
from __future__ import annotations

import contextlib
import os
import subprocess

import pytest

from conftest import CONFIGS, Background
from containers import PROJECT, engine_missing, podman
from harness import ROOT, Run, assert_same_training, check, run_command, time_limit

STEP = CONFIGS["05"]  # the suite's two-node job: one process per node, batch 32, float64


@pytest.fixture(scope="module")
def image(background: Background) -> tuple[str, dict[str, str]]:
    """(the image's name, the engine's environment) once the background build has ended."""
    if (why := engine_missing()) is not None:
        pytest.skip(why)
    assert background.image is not None, "the container test was selected but no image was started"
    return background.image.result(), background.engine


def test_two_containers_on_a_bridge_network_reach_stage_01s_weights(image, runs, tmp_path):
    """compose.yaml as a reader runs it: node1 finds node0 by its service name, across the network."""
    name, engine = image
    env = {**engine, "IMAGE": name, "OUT": str(tmp_path), "ARGS": " ".join(STEP.args)}
    compose = ["podman-compose", "--file", str(ROOT / "docker" / "compose.yaml"), "--project-name", PROJECT]
    assert STEP.nproc == 1 and STEP.nnodes == 2, STEP  # compose.yaml's shape: two nodes, one process each
    try:
        # Not through run_command: `up --detach` leaves the engine's helpers running on purpose (seen: one
        # process beside the containers), and the harness kills whatever a command leaves behind.
        up = subprocess.run([*compose, "up", "--detach", "--no-build"], env={**os.environ, **env},
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}"
        nodes = [f"{PROJECT}_node{i}_1" for i in range(2)]
        limit = time_limit(programs=STEP.nnodes * (1 + STEP.nproc))  # per container a torchrun agent and its rank
        waited = run_command(["podman", "wait", *nodes], env=env, timeout=limit)
        if waited.returncode is None:
            pytest.fail(f"the two-node job did not end in {limit:.0f} s ({limit.how})\n"
                        f"{podman('logs', nodes[0], env=env).stdout}")
        logs = [podman("logs", node, env=env) for node in nodes]
        output = "\n".join(f"--- {node} ---\n{log.stdout}{log.stderr}" for node, log in zip(nodes, logs, strict=True))
        codes = waited.stdout.split()
        run = Run(["podman-compose", "up"], 0 if waited.returncode == 0 and set(codes) == {"0"} else 1,
                  output, waited.stderr, waited.seconds, tmp_path)
        check(run)
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):  # the session removes what is left
            subprocess.run([*compose, "down"], env={**os.environ, **env}, capture_output=True, timeout=120)
    s = run.summary
    # Two hosts as the job saw them: each container has its own hostname and network namespace.
    assert s["nodes"] == 2 and sorted(r["host"] for r in s["layout"]) == ["node0", "node1"], s["layout"]
    assert run.stdout.count("held-out:") == 1, run.stdout  # one global rank 0 in the whole job
    assert_same_training(run, runs["01"])
