"""Certificates: one CA per environment whose key is a Pulumi secret, and a certificate per component (gateway,
scheduler, Prometheus) and per server pool, with the names pdstack.contract.components.Names gives them.

The control-plane stack holds the CA and issues every certificate (it reads every datacenter's pools from the stack
files), so the CA key never leaves that stack's encrypted state. The components' keys are generated here too and
handed on only as secret Outputs: to the cluster as kubernetes.io/tls Secrets (infra/workloads/), to the GPU nodes
through Secrets Manager under the environment's KMS key, one secret per pool that only that pool's nodes may read
(and, under the stack's mutual TLS, one for the operator's client certificate, which the controller presents).
The gateway's certificate is also imported into ACM for the TLS listener of its load balancer.

Rotation: a certificate is re-signed by the first `pulumi up` inside its last EARLY_RENEWAL_DAYS (the nightly drift
preview shows it pending); the mounted Secret changes in place and the component reloads it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_tls as tls

from infra.protection import stateful
from pdstack.contract.components import (
    TLS_CA_FILE,
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    operator_tls_secret_name,
    tls_secret_name,
)

HOURS_PER_DAY = 24
CA_VALIDITY_DAYS = 3650
CA_EARLY_RENEWAL_DAYS = 365
VALIDITY_DAYS = 180
EARLY_RENEWAL_DAYS = 45
KEY_ALGORITHM, KEY_CURVE = "ECDSA", "P256"
# server_auth for its listeners, client_auth so the same certificate identifies it to its peers under mutual TLS
LEAF_USES = ("digital_signature", "key_encipherment", "server_auth", "client_auth")
CA_USES = ("cert_signing", "crl_signing", "digital_signature")


@dataclass(frozen=True)
class TlsFiles:
    """A component's certificate, its key (a secret Output) and the CA that signed it, as PEM."""

    cert_pem: pulumi.Output[str]
    key_pem: pulumi.Output[str]
    ca_pem: pulumi.Output[str]

    def files(self) -> dict[str, pulumi.Output[str]]:
        """The kubernetes.io/tls Secret's keys (the files under pdstack.contract.components.TLS_DIR)."""
        return {TLS_CERT_FILE: self.cert_pem, TLS_KEY_FILE: self.key_pem, TLS_CA_FILE: self.ca_pem}


@dataclass(frozen=True)
class CertificateSpec:
    name: str  # gateway, scheduler, prometheus, or <datacenter>-<pool>
    dns_names: Sequence[str]  # the first is its common name


@dataclass(frozen=True)
class EnvironmentCertificatesArgs:
    env: str
    components: Sequence[CertificateSpec]  # served in the cluster: kubernetes.io/tls Secrets
    pools: Mapping[str, Mapping[str, CertificateSpec]]  # datacenter -> pool -> spec: Secrets Manager, for the nodes
    operator: CertificateSpec | None  # the controller's: Secrets Manager, for the operator's credentials
    secrets_key_arn: pulumi.Input[str]
    tags: Mapping[str, str]
    recovery_window_days: int


class EnvironmentCertificates(pulumi.ComponentResource):
    ca_cert_pem: pulumi.Output[str]
    issued: dict[str, TlsFiles]  # component -> files
    pool_secret_arns: dict[str, dict[str, pulumi.Output[str]]]  # datacenter -> pool -> Secrets Manager ARN

    def __init__(
        self, name: str, args: EnvironmentCertificatesArgs, opts: pulumi.ResourceOptions | None = None
    ) -> None:
        super().__init__("pdstack:tls:EnvironmentCertificates", name, None, opts)
        self.args = args
        self.child = pulumi.ResourceOptions(parent=self)
        self._ca_key = tls.PrivateKey(f"{name}-ca", algorithm=KEY_ALGORITHM, ecdsa_curve=KEY_CURVE, opts=self.child)
        ca = tls.SelfSignedCert(
            f"{name}-ca",
            private_key_pem=self._ca_key.private_key_pem,
            subject=tls.SelfSignedCertSubjectArgs(common_name=f"pdstack {args.env} CA", organization="pdstack"),
            is_ca_certificate=True,
            max_path_length=0,  # signs leaves only
            validity_period_hours=CA_VALIDITY_DAYS * HOURS_PER_DAY,
            early_renewal_hours=CA_EARLY_RENEWAL_DAYS * HOURS_PER_DAY,
            allowed_uses=list(CA_USES),
            opts=self.child,
        )
        self._ca = ca
        self.ca_cert_pem = ca.cert_pem
        self.issued = {spec.name: self._issue(name, spec) for spec in args.components}
        self.pool_secret_arns = {
            dc: {
                pool: self._stored(
                    f"{name}-{dc}-{pool}",
                    tls_secret_name(args.env, dc, pool),
                    f"{dc}'s pool {pool}",
                    self._issue(name, spec),
                )
                for pool, spec in pools.items()
            }
            for dc, pools in args.pools.items()
        }
        if args.operator is not None:
            files = self._issue(name, args.operator)
            self._stored(f"{name}-operator", operator_tls_secret_name(args.env), "the operator (the controller)", files)
        self.register_outputs({"ca_cert_pem": self.ca_cert_pem, "pool_secret_arns": self.pool_secret_arns})

    def _issue(self, name: str, spec: CertificateSpec) -> TlsFiles:
        key = tls.PrivateKey(f"{name}-{spec.name}", algorithm=KEY_ALGORITHM, ecdsa_curve=KEY_CURVE, opts=self.child)
        request = tls.CertRequest(
            f"{name}-{spec.name}",
            private_key_pem=key.private_key_pem,
            subject=tls.CertRequestSubjectArgs(common_name=spec.dns_names[0], organization="pdstack"),
            dns_names=list(spec.dns_names),
            opts=self.child,
        )
        cert = tls.LocallySignedCert(
            f"{name}-{spec.name}",
            cert_request_pem=request.cert_request_pem,
            ca_private_key_pem=self._ca_key.private_key_pem,
            ca_cert_pem=self._ca.cert_pem,
            validity_period_hours=VALIDITY_DAYS * HOURS_PER_DAY,
            early_renewal_hours=EARLY_RENEWAL_DAYS * HOURS_PER_DAY,
            allowed_uses=list(LEAF_USES),
            opts=self.child,
        )
        # Said out loud: the engine marks a tls key secret, but only when a real provider answers.
        return TlsFiles(cert.cert_pem, pulumi.Output.secret(key.private_key_pem), self._ca.cert_pem)

    def _stored(self, resource: str, secret_name: str, owner: str, files: TlsFiles) -> pulumi.Output[str]:
        a = self.args
        secret = aws.secretsmanager.Secret(
            resource,
            name=secret_name,
            description=f"pdstack {a.env}: TLS certificate and key of {owner}",
            kms_key_id=a.secrets_key_arn,
            recovery_window_in_days=a.recovery_window_days,
            tags=dict(a.tags),
            opts=stateful(self.child, retain=True),
        )
        aws.secretsmanager.SecretVersion(
            resource,
            secret_id=secret.id,
            secret_string=pulumi.Output.secret(pulumi.Output.all(**files.files()).apply(json.dumps)),
            opts=self.child,
        )
        return secret.arn

    def load_balancer_certificate(self, component: str) -> aws.acm.Certificate:
        """`component`'s certificate imported into ACM, for its load balancer's TLS listener."""
        files = self.issued[component]
        return aws.acm.Certificate(
            f"{component}-tls",
            certificate_body=files.cert_pem,
            private_key=files.key_pem,
            certificate_chain=files.ca_pem,
            tags={**self.args.tags, "pdstack:component": component},
            opts=self.child,
        )
