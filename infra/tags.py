"""The tags every pdstack resource carries; the Ansible aws_ec2 inventory groups instances by them."""

from __future__ import annotations

from pdstack.policy.core import IMAGES_TAG

ENV, DC, ROLE, POOL = "pdstack:env", "pdstack:dc", "pdstack:role", "pdstack:pool"
INSTANCE_TAG_KEYS = (ENV, DC, ROLE, POOL)
IMAGES = IMAGES_TAG  # on a GPU pool's instances: the repositories of the images they run, space-separated
PURPOSE = "pdstack:purpose"  # on security group rules: what the opening is for (the policy pack reads it)


def datacenter_tags(env: str, dc: str, role: str) -> dict[str, str]:
    return {ENV: env, DC: dc, ROLE: role, "managed-by": "pulumi"}


def pool_tags(env: str, dc: str, role: str, pool: str) -> dict[str, str]:
    return {**datacenter_tags(env, dc, role), POOL: pool}
