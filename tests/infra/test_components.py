"""The pure parts of the program: address plan, security openings, scrape config, secret rotation, names."""

from __future__ import annotations

import dataclasses
from ipaddress import IPv4Network, ip_network
from itertools import combinations

import pytest

from infra.network import plan_subnets
from infra.prometheus import DatacenterTarget, scrape_config
from infra.secrets import DAY_S, rotation_period
from infra.security import NodeAccess, node_openings
from infra.storage import bucket_name
from pdstack.contract.components import NODE_EXPORTER_PORT, contract
from pdstack.contract.files import environment_serving
from pdstack.model import DatacenterRole, Model, PoolRole, Ports, Serving
from tests.support import STACKS

CONTRACT = contract(Serving(model=Model(name="m", path="/m")))


@pytest.mark.parametrize("cidr", ["10.31.0.0/16", "10.10.16.0/20", "10.210.1.0/24"])
def test_subnet_plan_fits_disjoint_subnets_of_at_least_slash_28(cidr: str) -> None:
    vpc = IPv4Network(cidr)
    plan = plan_subnets(vpc)
    subnets = plan.service + plan.management + plan.public + plan.transit
    assert len(subnets) == 8
    assert all(s.subnet_of(vpc) and s.prefixlen <= 28 for s in subnets)
    assert not any(a.overlaps(b) for a, b in combinations(subnets, 2))
    assert plan.service[0].num_addresses == vpc.num_addresses // 4  # the GPU/pod tier gets half the VPC


def _access(role: DatacenterRole, pools: set[PoolRole], peers: tuple[str, ...], efa: bool = False) -> NodeAccess:
    return NodeAccess(
        pool_roles=frozenset(pools),
        datacenter_role=role,
        contract=CONTRACT,
        own_cidr="10.1.0.0/16",
        control_cidr="10.0.0.0/20",
        kv_peer_cidrs=peers,
        efa=efa,
    )


def test_prefill_nodes_open_kv_to_their_decode_peers_only() -> None:
    openings = {
        o.purpose: o for o in node_openings(_access(DatacenterRole.PREFILL, {PoolRole.PREFILL}, ("10.2.0.0/16",)))
    }
    assert openings["kv"].cidrs == ("10.2.0.0/16",) and openings["kv"].from_port == Ports().kv
    assert openings["serving-prefill"].cidrs == ("10.0.0.0/20",)
    assert "efa" not in openings


def test_a_vllm_prefill_opens_one_kv_port_per_worker_to_its_peers() -> None:
    """PdstackConnector: each TP rank of each DP engine serves its KV on its own port (kv_port_of); prod's prefill
    is TP 8 x DP 1."""
    prod = contract(environment_serving(STACKS, "prod"))
    access = dataclasses.replace(_access(DatacenterRole.PREFILL, {PoolRole.PREFILL}, ("10.2.0.0/16",)), contract=prod)
    kv = next(o for o in node_openings(access) if o.purpose == "kv")
    assert (kv.from_port, kv.to_port, kv.cidrs) == (Ports().kv, Ports().kv + 7, ("10.2.0.0/16",))


def test_decode_nodes_do_not_open_the_kv_port() -> None:
    purposes = {o.purpose for o in node_openings(_access(DatacenterRole.DECODE, {PoolRole.DECODE}, ()))}
    assert purposes == {"serving-decode", "metrics"}


def test_mixed_datacenters_admit_their_own_decode_to_kv_and_efa_within_the_group() -> None:
    openings = {
        o.purpose: o
        for o in node_openings(
            _access(DatacenterRole.MIXED, {PoolRole.PREFILL, PoolRole.DECODE}, ("10.2.0.0/16",), efa=True)
        )
    }
    assert openings["kv"].cidrs == ("10.1.0.0/16", "10.2.0.0/16")
    assert openings["efa"].self_only and openings["efa"].protocol == "-1" and not openings["efa"].cidrs


def test_no_opening_is_ever_to_the_internet() -> None:
    for opening in node_openings(_access(DatacenterRole.MIXED, set(PoolRole), ("10.2.0.0/16",), efa=True)):
        assert all(ip_network(c).prefixlen > 0 for c in opening.cidrs)


def test_scrape_config_has_one_job_per_component_with_a_discovery_per_datacenter() -> None:
    config = scrape_config(
        "prod",
        "pdstack-prod",
        CONTRACT,
        [
            DatacenterTarget("a", "us-east-1", (PoolRole.PREFILL,)),
            DatacenterTarget("b", "us-west-2", (PoolRole.PREFILL, PoolRole.DECODE)),
        ],
        "prod.pdstack.internal",
    )
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    assert set(jobs) == {
        "prometheus",
        "pdserve-gateway",
        "pdserve-scheduler",
        "pdserve-prefill",
        "pdserve-decode",
        "node",
    }
    assert [sd["region"] for sd in jobs["pdserve-prefill"]["ec2_sd_configs"]] == ["us-east-1", "us-west-2"]
    assert jobs["pdserve-decode"]["ec2_sd_configs"][0]["port"] == Ports().decode
    assert {sd["port"] for sd in jobs["node"]["ec2_sd_configs"]} == {NODE_EXPORTER_PORT}
    for job in ("pdserve-prefill", "pdserve-decode", "node"):  # the nodes by their own names, over TLS
        assert jobs[job]["scheme"] == "https" and "server_name" not in jobs[job]["tls_config"]
        assert jobs[job]["relabel_configs"][-1]["target_label"] == "__address__"
    assert config["global"]["external_labels"] == {"environment": "prod"}
    assert config["rule_files"] == ["alerts.yml"]
    alerting = config["alerting"]["alertmanagers"][0]["static_configs"][0]
    assert alerting["targets"] == ["alertmanager.pdstack-prod.svc:9093"]


def test_rotation_period_changes_once_per_rotation_interval() -> None:
    start = 1000 * 30 * DAY_S
    assert rotation_period(30, start) == rotation_period(30, start + 30 * DAY_S - 1)
    assert rotation_period(30, start + 30 * DAY_S) == rotation_period(30, start) + 1


def test_bucket_names_are_valid_s3_names_even_for_the_longest_datacenter_name() -> None:
    assert bucket_name("prod", "decode-us-west-2", "123456789012") == "pdstack-prod-decode-us-west-2-123456789012"
    longest = bucket_name("staging", "d" * 32, "123456789012")  # the model caps names at 32 characters
    assert len(longest) <= 63 and longest == longest.lower()
