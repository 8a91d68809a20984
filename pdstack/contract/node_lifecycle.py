"""What a self-joining GPU node and the cloud agree on about its life, with no Pulumi: the name of its pool's Auto
Scaling group, the termination lifecycle hook its drain completes and how long that hook waits, and where in its
datacenter's model bucket the release's objects live.

infra/node_pool.py makes the group and the hook with these names, and scopes the node role by them; the node side
(pdstack/node, and the local environment's Auto Scaling in moto) imports them to call SetInstanceHealth,
RecordLifecycleActionHeartbeat and CompleteLifecycleAction, knowing the group's name from node.json's environment,
datacenter and pool alone (docs/cloud.md, "Scale-in is a drain").
"""

from __future__ import annotations

import math

from pdstack.model import Serving

# The termination hook of every GPU pool's group: an instance chosen for scale-in waits in Terminating:Wait until
# its node completes the action (CONTINUE) after draining, or the heartbeat timeout passes.
DRAIN_HOOK = "pdstack-drain"
DRAIN_TRANSITION = "autoscaling:EC2_INSTANCE_TERMINATING"
# What the group does when the timeout passes without an answer: terminate anyway. A node that died (or hung) while
# draining must still leave the group; ABANDON would mean the same for a termination hook, CONTINUE says it.
DRAIN_DEFAULT_RESULT = "CONTINUE"
# Auto Scaling takes heartbeat timeouts of 30 s to 7,200 s
HEARTBEAT_MIN_S, HEARTBEAT_MAX_S = 30, 7200
# Past the longest request and the KV lease: deregistering, the gateways polling the new table, stopping containers
DRAIN_SETTLE_S = 60

# Key prefixes of the release's objects in a datacenter's model bucket (the record's model prefix and bundle key live
# under them): what a node may read there, and nothing else of the bucket.
MODEL_PREFIX = "models/"
BUNDLE_PREFIX = "bundles/"
NODE_READABLE_PREFIXES = (MODEL_PREFIX, BUNDLE_PREFIX)


def node_group_name(env: str, datacenter: str, pool: str) -> str:
    """The Auto Scaling group of one GPU pool: fixed, so the node role can be scoped to it before it exists and a
    node finds it from node.json."""
    return f"pdstack-{env}-{datacenter}-{pool}"


def node_role_name(env: str, datacenter: str, pool: str) -> str:
    """The instance role of one GPU pool's nodes: fixed, so the control plane's scheduler can name it in join_node_roles
    (its ARN from the datacenter's account alone) without reading the datacenter stack's outputs. IAM role names are
    at most 64 characters."""
    return f"{node_group_name(env, datacenter, pool)}-node"[:64]


def node_role_arn(account: str, env: str, datacenter: str, pool: str, partition: str = "aws") -> str:
    return f"arn:{partition}:iam::{account}:role/{node_role_name(env, datacenter, pool)}"


def drain_timeout_seconds(serving: Serving) -> int:
    """How long the drain hook waits for a node to complete it: a request admitted just before the drain may run for
    serving.timeouts.request_s, KV prefill handed out is held for kv_lease_s, then DRAIN_SETTLE_S to deregister
    and stop; within Auto Scaling's bounds. A node that needs longer records a heartbeat."""
    timeouts = serving.timeouts
    wanted = math.ceil(timeouts.request_s + timeouts.kv_lease_s) + DRAIN_SETTLE_S
    return max(HEARTBEAT_MIN_S, min(HEARTBEAT_MAX_S, wanted))
