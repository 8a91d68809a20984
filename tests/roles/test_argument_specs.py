"""Bad role variables fail at role start, through meta/argument_specs.yml, with a message naming the variable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.ansible import PlaybookRun, run_local_playbook


def run_role(tmp_path: Path, role: str, variables: dict[str, object]) -> PlaybookRun:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": f"validate {role}",
                    "hosts": "localhost",
                    "connection": "local",
                    "gather_facts": False,
                    "roles": [role],
                }
            ]
        )
    )
    return run_local_playbook(playbook, tmp_path, json.dumps(variables))


@pytest.mark.parametrize(
    ("role", "variables", "message"),
    [
        ("kernel_tuning", {"kernel_tuning_link_bandwidth_gbps": "fast"}, "kernel_tuning_link_bandwidth_gbps"),
        ("kernel_tuning", {"kernel_tuning_nofile": [1]}, "kernel_tuning_nofile"),
        ("gpu_driver", {"gpu_driver_branch": "999"}, "gpu_driver_branch must be one of"),
        ("gpu_driver", {"gpu_driver_fabric_manager": "sometimes"}, "gpu_driver_fabric_manager must be one of"),
        (
            "storage",
            {"storage_network_mounts": [{"path": "/mnt/shared"}]},
            "missing required arguments: src found in storage_network_mounts",
        ),
        ("storage", {"storage_fstype": "btrfs"}, "storage_fstype must be one of"),
        ("time_sync", {"time_sync_servers": {"pool": "ntp.test"}}, "time_sync_servers"),
        ("time_sync", {"time_sync_maxdistance": "far"}, "time_sync_maxdistance"),
        ("numa", {"numa_cpu_governor": "turbo"}, "numa_cpu_governor must be one of"),
        ("container_runtime", {"container_runtime_engine": "docker"}, "container_runtime_engine must be one of"),
        ("node_exporter", {"node_exporter_port": "ninety-one hundred"}, "node_exporter_port"),
        (
            "redis",
            {"redis_password_file": "/nonexistent", "redis_tls_client_auth": "sometimes"},
            "redis_tls_client_auth",
        ),
        (
            "container_runtime",
            {"container_runtime_registry_auths": [{"registry": "r.test", "username": "u"}]},
            "missing required arguments: password found in container_runtime_registry_auths",
        ),
    ],
)
def test_bad_variable_fails_naming_it(tmp_path: Path, role: str, variables: dict[str, object], message: str) -> None:
    result = run_role(tmp_path, role, variables)
    output = result.output
    assert result.returncode != 0
    assert "Validating arguments against arg spec" in output
    assert message in output, output[-3000:]


def test_zero_rtt_fails_naming_the_link_settings(tmp_path: Path) -> None:
    # Zero passes the type check; the role's own assertion names the variable before anything is written.
    result = run_role(tmp_path, "kernel_tuning", {"kernel_tuning_link_rtt_ms": 0.0})
    output = result.output
    assert result.returncode != 0
    assert "kernel_tuning_link_rtt_ms (0.0) must be positive" in " ".join(output.split())
