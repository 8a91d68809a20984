"""Names of the stack outputs one stack exports and another reads through a StackReference: the contract."""

from __future__ import annotations

REGION = "region"
ACCOUNT_ID = "account_id"
CIDR = "cidr"
VPC_ID = "vpc_id"
PRIVATE_ROUTE_TABLE_IDS = "private_route_table_ids"
TRANSIT_GATEWAY_ID = "transit_gateway_id"
TRANSIT_GATEWAY_ROUTE_TABLE_ID = "transit_gateway_route_table_id"

# Exported by the control-plane stack only.
ENV_KEY_ARN = "env_key_arn"
SECRET_ARNS = "secret_arns"  # noqa: S105 (an output name)
REPOSITORY_ARNS = "repository_arns"
REPOSITORY_URLS = "repository_urls"
CLUSTER_NAME = "cluster_name"
SCHEDULER_URL = "scheduler_url"  # also in SSM Parameter Store (pdstack.contract.components.SCHEDULER_URL_PARAMETER)
PROMETHEUS_URL = "prometheus_url"  # also in SSM Parameter Store (pdstack.contract.components.PROMETHEUS_URL_PARAMETER)
PRIVATE_ZONE_ID = "private_zone_id"  # the environment's Route53 private zone (infra/dns.py)
PRIVATE_ZONE_NAME = "private_zone_name"
CA_CERTIFICATE = "ca_certificate"  # the environment CA's certificate (PEM, public): what clients trust
TLS_SECRET_ARNS = "tls_secret_arns"  # noqa: S105 (an output name): datacenter -> pool -> its certificate's secret

# Exported by datacenter stacks only.
MODEL_BUCKET = "model_bucket"
NODE_POOLS = "node_pools"
TRANSFER_BUCKET = "transfer_bucket"  # the aws_ssm connection's file transfers (infra/operator_access.py)
SESSION_DOCUMENT = "session_document"  # the SSM session document operators and Ansible connect with
DATA_KEY_ARN = "data_key_arn"

# What a stack reads from a peer it links to, and from the control plane.
PEER_NETWORK = (
    REGION,
    ACCOUNT_ID,
    CIDR,
    VPC_ID,
    PRIVATE_ROUTE_TABLE_IDS,
    TRANSIT_GATEWAY_ID,
    TRANSIT_GATEWAY_ROUTE_TABLE_ID,
)
CONTROL_FOR_DATACENTERS = (
    ENV_KEY_ARN,
    SECRET_ARNS,
    REPOSITORY_ARNS,
    PRIVATE_ZONE_ID,
    PRIVATE_ZONE_NAME,
    TLS_SECRET_ARNS,
)
