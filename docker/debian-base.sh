#!/usr/bin/env bash
# Make a Debian base image from Debian's package archive, for machines that reach no image registry:
#   docker/debian-base.sh [TAG] [ENGINE]          (default: localhost/ddp-debian-base:bookworm, podman)
# then build with --build-arg BASE=TAG. It holds Debian's Python 3 and its venv module, nothing else.
# Needs root and debootstrap; takes about a minute (measured in docker/README.md).
set -euo pipefail
tag=${1:-localhost/ddp-debian-base:bookworm}
engine=${2:-podman}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

rootfs=$(mktemp -d) log=$(mktemp)
trap 'rm -rf "$rootfs" "$log"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$mirror" >"$log" 2>&1 \
    || { tail -n 20 "$log" >&2; exit 1; }
# What an image does not need: package lists and caches, documentation.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/*
tar -C "$rootfs" -c . | "$engine" import --change 'CMD ["python3"]' - "$tag" >/dev/null
echo "$tag"
