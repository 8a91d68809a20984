"""The network rules: nothing open to the world, the KV ports to peer datacenters only, TLS on everything that listens
beyond the cluster."""

from __future__ import annotations

from typing import Any

from pdstack.policy.core import (
    EKS_CLUSTER,
    INGRESS_RULE,
    K8S_INGRESS,
    K8S_SERVICE,
    KV_WIDEST_PREFIX,
    LB_LISTENERS,
    LEGACY_TLS_POLICIES,
    NLB_TLS_CERT,
    NLB_TLS_POLICY,
    NLB_TLS_PORTS,
    PRIVATE_NETWORKS,
    PURPOSE_TAG,
    SECURITY_GROUP,
    SECURITY_GROUP_RULE,
    TLS_PASSTHROUGH,
    PolicyConfig,
    get,
    is_open,
    is_true,
    network,
)

# --- no-open-ingress --------------------------------------------------------------------------------------------


def _ingress_cidrs(type_: str, props: dict[str, Any]) -> list[str]:
    """Every CIDR an ingress resource admits, whatever the resource flavour."""
    if type_ == INGRESS_RULE:
        return [c for c in (props.get("cidrIpv4"), props.get("cidrIpv6")) if c]
    if type_ == SECURITY_GROUP_RULE and props.get("type") == "ingress":
        return [*props.get("cidrBlocks", []), *props.get("ipv6CidrBlocks", [])]
    if type_ == SECURITY_GROUP:
        return [
            c
            for rule in props.get("ingress", []) or []
            for c in [*rule.get("cidrBlocks", []), *rule.get("ipv6CidrBlocks", [])]
        ]
    return []


def check_no_open_ingress(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    problems = [f"ingress from {c} opens it to the whole internet" for c in _ingress_cidrs(type_, props) if is_open(c)]
    if type_ == K8S_SERVICE and get(props, "spec.type") == "LoadBalancer":
        ranges = get(props, "spec.loadBalancerSourceRanges") or []
        if not ranges or any(is_open(c) for c in ranges):
            problems.append("a LoadBalancer Service needs loadBalancerSourceRanges, none of them 0.0.0.0/0")
        annotations = get(props, "metadata.annotations") or {}
        if annotations.get("service.beta.kubernetes.io/aws-load-balancer-internal") != "true":
            problems.append('a LoadBalancer Service must be internal (aws-load-balancer-internal: "true")')
    if type_ == EKS_CLUSTER and is_true(get(props, "vpcConfig.endpointPublicAccess")):
        cidrs = get(props, "vpcConfig.publicAccessCidrs") or []
        if not cidrs or any(is_open(c) for c in cidrs):
            problems.append("the public API endpoint must be limited by publicAccessCidrs, never 0.0.0.0/0")
    return problems


# --- kv-port-peers-only -------------------------------------------------------------------------------------------


def _covers(props: dict[str, Any], ports: range) -> bool:
    """The rule opens at least one of `ports`."""
    if str(props.get("ipProtocol", props.get("protocol"))) in ("-1", "all"):
        return True
    low, high = props.get("fromPort"), props.get("toPort")
    # Numbers reach policies as JSON numbers: 8400 or 8400.0.
    return isinstance(low, int | float) and isinstance(high, int | float) and low <= ports[-1] and ports[0] <= high


def check_kv_port_peers_only(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    """The KV ports admit only the peer datacenters' private networks, through rules that say so."""
    problems = []
    if type_ == INGRESS_RULE:
        cidrs = _ingress_cidrs(type_, props)
        if not cidrs or not _covers(props, config.kv_ports):
            return []  # group-to-group rules (EFA within its own group) carry no address range
        purpose = (props.get("tags") or {}).get(PURPOSE_TAG)
        if purpose != "kv":
            problems.append(f"opens the {config.describe_kv_ports()} as part of a {purpose or 'untagged'} rule")
        for cidr in cidrs:
            net = network(cidr)
            if net is None or not any(net.subnet_of(p) for p in PRIVATE_NETWORKS):
                problems.append(f"the KV port is open to {cidr}, which is not a private peer network")
            elif net.prefixlen < KV_WIDEST_PREFIX:
                problems.append(f"the KV port is open to {cidr}, wider than a datacenter (/{KV_WIDEST_PREFIX})")
    elif type_ in (SECURITY_GROUP, SECURITY_GROUP_RULE):
        rules = (
            props.get("ingress", []) if type_ == SECURITY_GROUP else [props] if props.get("type") == "ingress" else []
        )
        if any(_covers(r, config.kv_ports) and (r.get("cidrBlocks") or r.get("ipv6CidrBlocks")) for r in rules):
            problems.append("the KV port may only be opened by a tagged SecurityGroupIngressRule per peer network")
    return problems


# --- tls-listeners ------------------------------------------------------------------------------------------------


def _modern_policy(policy: Any) -> bool:
    return bool(policy) and str(policy) not in LEGACY_TLS_POLICIES


def _service_tls(props: dict[str, Any]) -> list[str]:
    """A load-balanced Service listens with TLS on every port: a certificate, the ports it covers, TLS 1.2+; or it
    passes TLS through to its pods (which end it, seeing their callers' certificates) and ends none itself."""
    annotations = get(props, "metadata.annotations") or {}
    if str(annotations.get(TLS_PASSTHROUGH, "")).lower() == "true":
        ends_too = bool(annotations.get(NLB_TLS_CERT))
        return [f"a Service passing TLS through ({TLS_PASSTHROUGH}) cannot end it too ({NLB_TLS_CERT})"] * ends_too
    if not annotations.get(NLB_TLS_CERT):
        return [f"a {get(props, 'spec.type')} Service must listen with TLS ({NLB_TLS_CERT})"]
    covered = {p.strip() for p in str(annotations.get(NLB_TLS_PORTS, "*")).split(",")}
    problems = [
        f"port {port.get('port')} listens without TLS (not in {NLB_TLS_PORTS})"
        for port in get(props, "spec.ports") or []
        if "*" not in covered and not {str(port.get("port")), str(port.get("name"))} & covered
    ]
    if not _modern_policy(annotations.get(NLB_TLS_POLICY)):
        problems.append(f"{NLB_TLS_POLICY} must name a policy without TLS 1.0/1.1")
    return problems


def _listener_tls(props: dict[str, Any]) -> list[str]:
    protocol = str(props.get("protocol", "")).upper()
    if protocol == "HTTP":
        actions = props.get("defaultActions") or []
        redirects = all(
            a.get("type") == "redirect" and str(get(a, "redirect.protocol", "")).upper() == "HTTPS" for a in actions
        )
        return [] if actions and redirects else ["an HTTP listener may only redirect to HTTPS"]
    if protocol not in ("HTTPS", "TLS"):
        return [f"a {protocol or 'TCP'} listener carries plaintext: listen with TLS or HTTPS"]
    problems = [] if props.get("certificateArn") else ["a TLS listener needs a certificate"]
    if not _modern_policy(props.get("sslPolicy")):
        problems.append("the listener's sslPolicy must not allow TLS 1.0/1.1")
    return problems


def check_tls_listeners(type_: str, props: dict[str, Any], config: PolicyConfig) -> list[str]:
    """Everything that listens beyond the cluster does so with TLS: load balancers made from Services, ELB
    listeners (HTTP only to redirect), Ingresses."""
    if type_ == K8S_SERVICE and get(props, "spec.type") in ("LoadBalancer", "NodePort"):
        return _service_tls(props)
    if type_ in LB_LISTENERS:
        return _listener_tls(props)
    if type_ == K8S_INGRESS:
        hosts = {h for rule in get(props, "spec.rules") or [] if (h := rule.get("host"))}
        covered = {h for t in get(props, "spec.tls") or [] for h in t.get("hosts") or []}
        if not get(props, "spec.tls") or not hosts <= covered:
            return ["an Ingress must serve TLS for every host (spec.tls)"]
    return []
