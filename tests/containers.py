"""The container image the suite builds, and the removal of everything the container test made.

docker/Dockerfile is built by a real engine (podman: Docker's daemon does not run here), on a Debian base
made by docker/debian-base.sh (no registry is reachable), with torch from a wheelhouse instead of an index:
only build arguments differ from a reader's build. The build takes 100-250 s here but keeps only about half a
core busy (it waits on debootstrap's downloads and on dpkg), so it starts with the session, in the background
beside the tour (conftest.background); tests/test_containers.py runs the compose job on the image.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from harness import ROOT, Run, check, run_command

TAG = f"{os.getpid()}-{os.urandom(3).hex()}"  # this run's names: a second run beside it does not collide
PROJECT = f"ddptest{TAG.replace('-', '')}"  # the compose project: its containers and network
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


def engine_env(tmp: Path) -> dict[str, str]:
    """The environment every engine command runs in (its own containers.conf)."""
    conf = tmp / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    return {"CONTAINERS_CONF": str(conf)}


def podman(*args: str, env: dict[str, str], timeout: float = 60.0) -> Run:
    """One engine command, bounded; fails with its output unless it exits 0."""
    return check(run_command(["podman", *args], env=env, timeout=timeout))


def build_image(env: dict[str, str], tmp: Path) -> str:
    """docker/Dockerfile built on a debootstrapped Debian, torch from the host's pinned wheel: the image's name."""
    check(run_command([str(ROOT / "docker" / "debian-base.sh"), BASE], env=env, timeout=600))
    # The wheels the image's pip installs, fetched as docker/README.md's offline build does: its Python
    # (Debian 12's 3.11) and requirements.txt's pins.
    wheels = tmp / "wheels"
    check(run_command([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                       "--python-version", "3.11", "--dest", str(wheels), "torch", "numpy",
                       "--constraint", str(ROOT / "requirements.txt")], timeout=600))
    build = podman("build", "--file", "docker/Dockerfile", "--tag", IMAGE, "--build-arg", f"BASE={BASE}",
                   "--build-arg", "PIP_OPTIONS=--no-index --find-links /wheels", "--volume", f"{wheels}:/wheels:ro",
                   ".", env=env, timeout=900)
    assert "torch 2." in build.stdout, build.describe()  # the build's own check that torch imports
    return IMAGE


def remove_everything(env: dict[str, str]) -> None:
    """Remove the compose project's containers and network and both images, whatever state they are in."""
    full = {**os.environ, **env}
    with contextlib.suppress(subprocess.TimeoutExpired):
        ids = subprocess.run(["podman", "ps", "-aq", "--filter", f"label=io.podman.compose.project={PROJECT}"],
                             env=full, capture_output=True, text=True, timeout=60).stdout.split()
        for cmd in (["rm", "-f", *ids] if ids else None, ["network", "rm", "-f", f"{PROJECT}_default"],
                    ["rmi", "-f", IMAGE, BASE]):
            if cmd:
                subprocess.run(["podman", *cmd], env=full, capture_output=True, timeout=120)
