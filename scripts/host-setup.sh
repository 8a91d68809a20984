#!/usr/bin/env bash
# Install and configure what this machine needs, idempotently: a second run installs nothing and rewrites nothing.
#   host-setup.sh          what `make up` needs on a Debian 12 host: podman with Debian's runc, debootstrap (to build
#                          the node base image without a public image registry), the losetup/mkfs tools, the image
#                          registry and htpasswd (apache2-utils: the registry's login), the network tools of the
#                          emulated WAN and git (images are tagged by a hash of their sources);
#   host-setup.sh --tests  that and what the tests run for real (`make test`, `make test-unit`, CI): Prometheus and
#                          promtool, Alertmanager and amtool with node_exporter (tests/alerting runs them on loopback),
#                          iperf3, ping, openssl and redis-server (the gateways' shared rate-limit store; tests start
#                          their own on loopback).
# A package apt cannot install stops the run at once, naming it.
set -euo pipefail

PACKAGES=(podman runc debootstrap uidmap slirp4netns fuse-overlayfs util-linux e2fsprogs xfsprogs openssh-client
  docker-registry apache2-utils iproute2 iptables git)
TEST_PACKAGES=(make python3-venv prometheus prometheus-alertmanager prometheus-node-exporter iperf3 iputils-ping
  openssl redis-server)
if [[ "${1:-}" == "--tests" ]]; then
  PACKAGES+=("${TEST_PACKAGES[@]}")
elif [[ $# -gt 0 ]]; then
  echo "usage: host-setup.sh [--tests]" >&2
  exit 2
fi
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
  if [[ $EUID -ne 0 ]]; then
    echo "host-setup: missing packages:" $missing "- run as root (or install them) first" >&2
    exit 1
  fi
  echo "host-setup: installing" $missing
  apt-get update -qq
  # shellcheck disable=SC2086
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null; then
    local pkg
    for pkg in $missing; do
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 ||
        { echo "host-setup: cannot install the package $pkg" >&2; exit 1; }
    done
  fi
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
