#!/usr/bin/env bash
# Install and configure what `make up` and the node-container tests need on a Debian 12 host: podman with Debian's runc,
# debootstrap (to build the node base image without a public image registry), the losetup/mkfs tools, and for the
# local environment the image registry, the network tools and git (images are tagged by a hash of their sources).
# Idempotent: a second run installs nothing and rewrites nothing that is already right.
set -euo pipefail

PACKAGES=(podman runc debootstrap uidmap slirp4netns fuse-overlayfs util-linux e2fsprogs xfsprogs openssh-client
  docker-registry iproute2 iptables git)
CONTAINERS_CONF=/etc/containers/containers.conf

missing_packages() {
  local pkg
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || echo "$pkg"
  done
}

install_packages() {
  local missing
  missing=$(missing_packages)
  if [[ -z "$missing" ]]; then
    echo "host-setup: packages present"
    return
  fi
  echo "host-setup: installing $missing"
  apt-get update -qq
  # shellcheck disable=SC2086
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing
}

# crun refuses this host's hybrid cgroups and the default ulimits exceed the sandbox's; see DESIGN.md.
write_containers_conf() {
  local wanted
  wanted=$(cat <<'EOF'
# Written by pdstack scripts/host-setup.sh
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=4096:4096"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
)
  mkdir -p /etc/containers
  if [[ -f "$CONTAINERS_CONF" ]] && [[ "$(cat "$CONTAINERS_CONF")" == "$wanted" ]]; then
    echo "host-setup: $CONTAINERS_CONF already configured"
    return
  fi
  printf '%s\n' "$wanted" > "$CONTAINERS_CONF"
  echo "host-setup: wrote $CONTAINERS_CONF"
}

install_packages
write_containers_conf
podman --version
