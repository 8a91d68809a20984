"""The node's container runtime hands a CDI device to a container: what `--device nvidia.com/gpu=all` relies on.

No GPU exists here, so a spec for a fake vendor stands in for the one gpu_driver generates with nvidia-ctk: podman
on the converged node must find it in the configured CDI directory, create its device node in the container and apply
its container edits. The node's own podman runs it, inside the node container the baseline converged.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import testinfra

from tests.roles.conftest import NODE_A, Cluster

pytestmark = pytest.mark.timeout(600)

PROBE_IMAGE = "localhost/pdstack-cdi-probe:latest"
# Nested in a node container on this cgroup v1/hybrid host, runc cannot mount the cgroup tree itself (as for pdserve).
RUN = "podman run --rm --network none -v /sys/fs/cgroup:/sys/fs/cgroup:ro --device pdstack.test/dev=fake"
SPEC_PATH = "/etc/cdi/pdstack-test.yaml"
SPEC = {
    "cdiVersion": "0.5.0",
    "kind": "pdstack.test/dev",
    "devices": [
        {
            "name": "fake",
            "containerEdits": {"deviceNodes": [{"path": "/dev/pdstack-test", "hostPath": "/dev/null"}]},
        }
    ],
    "containerEdits": {"env": ["PDSTACK_CDI_PROBE=passed-through"]},
}
# The probe image: the node's own dash and the libraries it links, a root of a few hundred KiB (no registry needed).
BUILD_PROBE = f"""set -e
root=$(mktemp -d)
for file in /usr/bin/dash $(ldd /usr/bin/dash | grep -o '/[^ ]*'); do
  mkdir -p "$root$(dirname "$file")"; cp -L "$file" "$root$file"
done
mkdir -p "$root/bin" "$root/dev" "$root/proc" "$root/sys"
ln -s /usr/bin/dash "$root/bin/sh"
tar -C "$root" -c . | podman import - {PROBE_IMAGE} >/dev/null
rm -rf "$root"
"""


@pytest.fixture
def fake_cdi_device(cluster: Cluster) -> Iterator[testinfra.host.Host]:
    assert cluster.first_run.returncode == 0, cluster.first_run.output[-4000:]
    node = testinfra.get_host(f"podman://{NODE_A}")
    node.check_output(f"cat > {SPEC_PATH} <<'EOF'\n{json.dumps(SPEC, indent=2)}\nEOF")
    node.check_output(BUILD_PROBE)
    yield node
    node.run(f"rm -f {SPEC_PATH}; podman rmi -f {PROBE_IMAGE}")


def test_podman_on_the_node_resolves_cdi_devices(fake_cdi_device: testinfra.host.Host) -> None:
    node = fake_cdi_device
    version = node.check_output("podman --version").split()[-1]
    assert tuple(int(part) for part in version.split(".")[:2]) >= (4, 1), version  # CDI arrived in podman 4.1
    conf = node.file("/etc/containers/containers.conf").content_string
    assert 'cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]' in conf
    assert node.file("/etc/cdi").is_directory and node.file("/var/run/cdi").is_directory
    probe = node.run(
        f"{RUN} {PROBE_IMAGE} /bin/sh -c 'test -c /dev/pdstack-test && echo device=char; echo env=$PDSTACK_CDI_PROBE'"
    )
    assert probe.rc == 0, probe.stderr
    assert probe.stdout.split() == ["device=char", "env=passed-through"]
    # Without the spec the same device is refused: the runtime really resolved it from the CDI directory.
    node.check_output(f"mv {SPEC_PATH} {SPEC_PATH}.off")
    try:
        refused = node.run(f"{RUN} {PROBE_IMAGE} /bin/sh -c true")
    finally:
        node.check_output(f"mv {SPEC_PATH}.off {SPEC_PATH}")
    assert refused.rc != 0 and "unresolvable CDI devices pdstack.test/dev=fake" in refused.stderr, refused.stderr
