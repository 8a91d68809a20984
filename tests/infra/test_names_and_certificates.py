"""Names and certificates in the prod graph (#17): one private zone associated with every datacenter's VPC, records
and certificates with the contract's names, keys only ever secret."""

from __future__ import annotations

import json

import pytest
import yaml

from infra import outputs
from pdstack.contract.components import cloud_names, operator_tls_secret_name
from pdstack.model import DatacenterRole
from pdstack.policy.core import NLB_TLS_CERT, TLS_PASSTHROUGH
from pdstack.synth.synthesis import SynthError, Synthesis, mock_zone_id, synthesize
from tests.support import STACKS

from .conftest import CLOUD_STACKS, stack_config

PROD = [n for n in CLOUD_STACKS if n.startswith("prod-")]
NAMES = cloud_names("prod")


def test_one_zone_per_environment_associated_with_every_datacenter_vpc(graphs: dict[str, Synthesis]) -> None:
    zones = [z for n in PROD for z in graphs[n].of_type("aws:route53/zone:Zone")]
    assert [z.inputs["name"] for z in zones] == ["prod.pdstack.internal"]  # made once, by the control stack
    (zone,) = graphs["prod-control"].of_type("aws:route53/zone:Zone")
    assert zone.inputs["vpcs"] == [{"vpcId": "control-vpc-id", "vpcRegion": "us-east-1"}]
    zone_id = mock_zone_id(NAMES.zone)
    assert graphs["prod-control"].outputs[outputs.PRIVATE_ZONE_ID] == zone_id
    for name in PROD:
        dc = stack_config(name).datacenter
        associations = graphs[name].of_type("aws:route53/zoneAssociation:ZoneAssociation")
        if dc.role is DatacenterRole.CONTROL:
            assert associations == []  # its VPC is the zone's own
            continue
        (association,) = associations
        assert association.inputs == {"zoneId": zone_id, "vpcId": f"{dc.name}-vpc-id", "vpcRegion": dc.region}


def test_records_name_the_control_planes_load_balancers_by_the_contracts_names(graphs: dict[str, Synthesis]) -> None:
    graph = graphs["prod-control"]
    records = {r.inputs["name"]: r.inputs for r in graph.of_type("aws:route53/record:Record")}
    expected = {NAMES.host(app, "control") for app in ("gateway", "scheduler", "prometheus")}
    assert set(records) == expected == {"gateway.control.prod.pdstack.internal", *expected}
    assert {(r["type"], r["zoneId"]) for r in records.values()} == {("CNAME", mock_zone_id(NAMES.zone))}
    # the URLs the GPU nodes and the canary judge get speak those names, over TLS
    assert graph.outputs[outputs.SCHEDULER_URL] == f"https://{NAMES.host('scheduler', 'control')}:8100"
    assert graph.outputs[outputs.PROMETHEUS_URL].startswith(f"https://{NAMES.host('prometheus', 'control')}:")


def _requests(graph: Synthesis) -> dict[str, list[str]]:
    return {
        r.name.removeprefix("tls-"): r.inputs["dnsNames"] for r in graph.of_type("tls:index/certRequest:CertRequest")
    }


def test_every_component_and_pool_has_a_certificate_with_its_names(graphs: dict[str, Synthesis]) -> None:
    graph = graphs["prod-control"]
    requests = _requests(graph)
    assert requests["gateway"][0] == "gateway.control.prod.pdstack.internal"
    assert "gateway.pdstack-prod.svc.cluster.local" in requests["gateway"]
    assert requests["scheduler"][0] == NAMES.host("scheduler", "control")
    for name in PROD:
        dc = stack_config(name).datacenter
        for pool in dc.pools if dc.role is not DatacenterRole.CONTROL else ():
            assert requests[f"{dc.name}-{pool.name}"] == [
                NAMES.host(pool.name, dc.name),
                NAMES.instances(pool.name, dc.name),
            ]
    signed = {
        c.name.removeprefix("tls-"): c.inputs for c in graph.of_type("tls:index/locallySignedCert:LocallySignedCert")
    }
    assert set(signed) == set(requests)
    for cert in signed.values():
        assert {"server_auth", "client_auth"} <= set(cert["allowedUses"])
        assert cert["earlyRenewalHours"] < cert["validityPeriodHours"]
    (ca,) = graph.of_type("tls:index/selfSignedCert:SelfSignedCert")
    assert ca.inputs["isCaCertificate"] is True and "cert_signing" in ca.inputs["allowedUses"]
    # the load balancers' TLS listeners carry the gateway's, scheduler's and Prometheus' own certificates
    acm = {c.name: c for c in graph.of_type("aws:acm/certificate:Certificate")}
    assert set(acm) == {"gateway-tls", "scheduler-tls", "prometheus-tls"}
    services = {s.inputs["metadata"]["name"]: s.inputs for s in graph.of_type("kubernetes:core/v1:Service")}
    for app in ("gateway", "scheduler", "prometheus"):
        annotations = services[app]["metadata"]["annotations"]
        assert annotations["service.beta.kubernetes.io/aws-load-balancer-ssl-cert"].endswith(f":{app}-tls")
        assert annotations["service.beta.kubernetes.io/aws-load-balancer-ssl-ports"] == str(
            services[app]["spec"]["ports"][0]["port"]
        )


def test_keys_are_only_ever_secret(graphs: dict[str, Synthesis]) -> None:
    graph = graphs["prod-control"]
    for acm in graph.of_type("aws:acm/certificate:Certificate"):
        assert "privateKey" in acm.secret_inputs and acm.inputs["privateKey"].startswith("mock-privateKeyPem-")
    pool_secrets = [s for s in graph.of_type("aws:secretsmanager/secret:Secret") if "/tls/" in s.inputs["name"]]
    assert len(pool_secrets) == 3 and all(s.inputs["kmsKeyId"] for s in pool_secrets)
    for version in graph.of_type("aws:secretsmanager/secretVersion:SecretVersion"):
        assert "secretString" in version.secret_inputs
    stored = [
        json.loads(v.inputs["secretString"])
        for v in graph.of_type("aws:secretsmanager/secretVersion:SecretVersion")
        if v.name.startswith("tls-")
    ]
    assert len(stored) == 3 and all(set(s) == {"tls.crt", "tls.key", "ca.crt"} for s in stored)
    # No key appears anywhere it is not marked secret, nor in a plain output; the CA certificate is public.
    for resource in graph.resources:
        plain = {k: v for k, v in resource.inputs.items() if k not in resource.secret_inputs}
        assert "mock-privateKeyPem-" not in repr(plain), resource.name
    plain_outputs = {k: v for k, v in graph.outputs.items() if k not in graph.secret_outputs}
    assert "mock-privateKeyPem-" not in repr(plain_outputs)
    assert outputs.CA_CERTIFICATE in plain_outputs


@pytest.mark.slow  # two syntheses of a control stack
def test_a_bad_dns_domain_is_refused_naming_the_setting() -> None:
    with pytest.raises(SynthError, match=r"pdstack-infra:dns_domain: 'Pdstack_Internal' is not"):
        synthesize(STACKS / "Pulumi.dev-control.yaml", {"pdstack-infra:dns_domain": "Pdstack_Internal"})
    graph = synthesize(STACKS / "Pulumi.dev-control.yaml", {"pdstack-infra:dns_domain": "corp.example"})
    assert [z.inputs["name"] for z in graph.of_type("aws:route53/zone:Zone")] == ["dev.corp.example"]


def test_the_control_planes_pods_listen_with_their_own_certificates(graphs: dict[str, Synthesis]) -> None:
    """Behind the TLS listeners of their load balancers (which re-encrypt), the gateway, scheduler and Prometheus
    serve TLS themselves from their kubernetes.io/tls Secret; their probes use it, and Prometheus scrapes the
    pods over TLS by the names their certificates carry."""
    graph = graphs["prod-control"]
    secrets = {s.inputs["metadata"]["name"]: s for s in graph.of_type("kubernetes:core/v1:Secret")}
    workloads = {
        w.inputs["metadata"]["name"]: w.inputs["spec"]["template"]["spec"]
        for w in graph.of_type("kubernetes:apps/v1:Deployment") + graph.of_type("kubernetes:apps/v1:StatefulSet")
    }
    services = {s.inputs["metadata"]["name"]: s.inputs for s in graph.of_type("kubernetes:core/v1:Service")}
    for app in ("gateway", "scheduler", "prometheus"):
        secret = secrets[f"{app}-tls"]
        assert secret.inputs["type"] == "kubernetes.io/tls" and "stringData" in secret.secret_inputs
        assert set(secret.inputs["stringData"]) == {"tls.crt", "tls.key", "ca.crt"}
        pod = workloads[app]
        (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == f"{app}-tls"]
        (container,) = pod["containers"]
        assert {"name": volume["name"], "mountPath": "/run/tls", "readOnly": True} in container["volumeMounts"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["scheme"] == "HTTPS"
        annotations = services[app]["metadata"]["annotations"]
        assert annotations["service.beta.kubernetes.io/aws-load-balancer-backend-protocol"] == "ssl"
    env = {e["name"]: e["value"] for e in workloads["gateway"]["containers"][0]["env"]}
    assert env["PDSERVE_TLS_CERT"] == "/run/tls/tls.crt" and env["PDSERVE_TLS_CA"] == "/run/tls/ca.crt"
    assert env["PDSERVE_SCHEDULER_URL"] == "https://scheduler.pdstack-prod.svc.cluster.local:8100"
    assert "scheduler.pdstack-prod.svc.cluster.local" in _requests(graph)["scheduler"]
    config_map = next(
        c.inputs["data"]
        for c in graph.of_type("kubernetes:core/v1:ConfigMap")
        if c.inputs["metadata"]["name"] == "prometheus"
    )
    jobs = {j["job_name"]: j for j in yaml.safe_load(config_map["prometheus.yml"])["scrape_configs"]}
    for job, app in (("pdserve-gateway", "gateway"), ("pdserve-scheduler", "scheduler")):
        assert jobs[job]["scheme"] == "https"
        assert jobs[job]["tls_config"]["server_name"] in _requests(graph)[app]
        assert jobs[job]["tls_config"]["ca_file"] == "/run/tls/ca.crt"
    assert yaml.safe_load(config_map["web.yml"])["tls_server_config"]["cert_file"] == "/run/tls/tls.crt"
    args = workloads["prometheus"]["containers"][0]["args"]
    assert "--web.config.file=/etc/prometheus/web.yml" in args


def test_the_clusters_alertmanager_takes_alerts_from_prometheus_over_mutual_tls(graphs: dict[str, Synthesis]) -> None:
    """Inside the cluster too (#17): Alertmanager serves TLS from its own Secret and requires a client certificate
    from the CA, Prometheus sends over TLS by the name that certificate carries and presents its own, and the
    kubelet, which has no certificate to present, probes the port only."""
    graph = graphs["prod-control"]
    secrets = {s.inputs["metadata"]["name"]: s for s in graph.of_type("kubernetes:core/v1:Secret")}
    assert set(secrets["alertmanager-tls"].inputs["stringData"]) == {"tls.crt", "tls.key", "ca.crt"}
    assert _requests(graph)["alertmanager"][0] == "alertmanager.pdstack-prod.svc.cluster.local"
    web = yaml.safe_load(secrets["alertmanager"].inputs["stringData"]["web.yml"])["tls_server_config"]
    assert web["client_auth_type"] == "RequireAndVerifyClientCert" and web["client_ca_file"] == "/run/tls/ca.crt"
    (deployment,) = [d for d in graph.of_type("kubernetes:apps/v1:Deployment") if d.name.endswith("-alertmanager")]
    pod = deployment.inputs["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--web.config.file=/etc/alertmanager/web.yml" in container["args"]
    assert any(v.get("secret", {}).get("secretName") == "alertmanager-tls" for v in pod["volumes"])
    assert {"name": "tls", "mountPath": "/run/tls", "readOnly": True} in container["volumeMounts"]
    assert container["livenessProbe"]["tcpSocket"] == container["readinessProbe"]["tcpSocket"] == {"port": "https"}
    config_map = next(
        c.inputs["data"]
        for c in graph.of_type("kubernetes:core/v1:ConfigMap")
        if c.inputs["metadata"]["name"] == "prometheus"
    )
    (sender,) = yaml.safe_load(config_map["prometheus.yml"])["alerting"]["alertmanagers"]
    assert sender["scheme"] == "https" and sender["tls_config"]["server_name"] in _requests(graph)["alertmanager"]
    assert sender["tls_config"]["cert_file"] == "/run/tls/tls.crt"


def test_under_mutual_tls_the_scheduler_and_prometheus_end_tls_themselves(
    graphs: dict[str, Synthesis], mutual_tls_graph: Synthesis
) -> None:
    """Their load balancers pass TLS through to the pods, which require their callers' certificates with
    certificates carrying the load balancers' names; the kubelet probes from inside the scheduler's pod with the
    pod's pair and Prometheus' port only; the gateway's load balancer still ends the clients' TLS; the operator's
    certificate waits in Secrets Manager. Without the setting none of it."""
    graph = mutual_tls_graph
    assert not graph.violations
    services = {s.inputs["metadata"]["name"]: s.inputs for s in graph.of_type("kubernetes:core/v1:Service")}
    names = cloud_names("prod")
    for app in ("scheduler", "prometheus"):
        annotations = services[app]["metadata"]["annotations"]
        assert annotations[TLS_PASSTHROUGH] == "true" and NLB_TLS_CERT not in annotations
        assert _requests(graph)[app][0] == names.host(app, "control")
    assert NLB_TLS_CERT in services["gateway"]["metadata"]["annotations"]
    workloads = {
        w.inputs["metadata"]["name"]: w.inputs["spec"]["template"]["spec"]["containers"][0]
        for w in graph.of_type("kubernetes:apps/v1:Deployment") + graph.of_type("kubernetes:apps/v1:StatefulSet")
    }
    scheduler = workloads["scheduler"]
    env = {e["name"]: e["value"] for e in scheduler["env"]}
    assert env["PDSERVE_TLS_CLIENT_AUTH"] == "required"
    for probe in ("livenessProbe", "readinessProbe"):
        assert scheduler[probe]["exec"]["command"][:2] == ["python3", "-c"]
        assert "load_cert_chain('/run/tls/tls.crt', '/run/tls/tls.key')" in scheduler[probe]["exec"]["command"][2]
        assert set(workloads["prometheus"][probe]) >= {"tcpSocket"}
    config_map = next(
        c.inputs["data"]
        for c in graph.of_type("kubernetes:core/v1:ConfigMap")
        if c.inputs["metadata"]["name"] == "prometheus"
    )
    assert (
        yaml.safe_load(config_map["web.yml"])["tls_server_config"]["client_auth_type"] == "RequireAndVerifyClientCert"
    )
    secret_names = {s.inputs["name"] for s in graph.of_type("aws:secretsmanager/secret:Secret")}
    assert operator_tls_secret_name("prod") in secret_names
    assert _requests(graph)["operator"] == [names.host("operator", "control")]

    plain = graphs["prod-control"]
    assert operator_tls_secret_name("prod") not in {
        s.inputs["name"] for s in plain.of_type("aws:secretsmanager/secret:Secret")
    }
    for service in plain.of_type("kubernetes:core/v1:Service"):
        assert TLS_PASSTHROUGH not in (service.inputs["metadata"].get("annotations") or {})
