#!/usr/bin/env bash
# Build the pdserve runtime image: the debootstrap Debian 12 base (pdstack.local.nodes, skipped when present), a
# wheelhouse of pdserve and its pinned dependencies built on the host, then `podman build` of serving/Containerfile.
# Usage: serving/build-image.sh [IMAGE]   (default localhost/pdserve:latest; PYTHON overrides the interpreter)
set -euo pipefail

IMAGE=${1:-localhost/pdserve:latest}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$HERE/../.venv/bin/python}
CONTEXT=$(mktemp -d /tmp/pdserve-image-XXXXXX)
trap 'rm -rf "$CONTEXT"' EXIT

BASE=$("$PYTHON" -c 'from pdstack.local.nodes import build_base_image; print(build_base_image())')
MIRROR=$("$PYTHON" -c 'from pdstack.local.nodes import host_mirror; print(host_mirror())')
"$PYTHON" -m pip wheel --quiet --constraint "$HERE/constraints.txt" --wheel-dir "$CONTEXT/wheels" "$HERE"
# Wheels whose markers hold for the image's Python (Debian 12's python3) but not for the host's.
IMAGE_PYTHON=$(apt-cache show python3.11 | sed -n 's/^Version: \([0-9.]*\).*/\1/p' | head -n1)
"$PYTHON" "$HERE/image_requirements.py" "$IMAGE_PYTHON" > "$CONTEXT/image-requirements.txt"
if [ -s "$CONTEXT/image-requirements.txt" ]; then
    "$PYTHON" -m pip download --quiet --only-binary=:all: --no-deps --dest "$CONTEXT/wheels" \
        -r "$CONTEXT/image-requirements.txt"
fi
cp "$HERE/Containerfile" "$CONTEXT/Containerfile"
podman build --format docker --network host --build-arg "BASE_IMAGE=$BASE" --build-arg "DEBIAN_MIRROR=$MIRROR" \
    -t "$IMAGE" "$CONTEXT"
