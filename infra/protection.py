"""Stateful resources' protection (docs/cloud.md, "Protected resources"): KMS keys, the private zone, the EKS cluster,
buckets and secrets are created `protect=True`, so neither `pulumi destroy` nor a replacement removes them without an
operator's `pulumi state unprotect`; those whose loss loses data are also `retain_on_delete`, so a replacement that
gets past protection leaves the old one in the account. pdstack-infra:protect (infra/environment.py validates it:
only a dev stack may turn it off) decides for the whole stack."""

from __future__ import annotations

import pulumi

SETTINGS_NAMESPACE = "pdstack-infra"  # infra.environment's; not imported, which would import this module's users


def protected() -> bool:
    """Whether this stack protects its stateful resources (pdstack-infra:protect, default true)."""
    return pulumi.Config(SETTINGS_NAMESPACE).get_bool("protect") is not False


def stateful(opts: pulumi.ResourceOptions | None = None, *, retain: bool = False) -> pulumi.ResourceOptions:
    """`opts` with protection (and, if `retain`, retain_on_delete) when the stack protects its stateful resources."""
    if not protected():
        return opts or pulumi.ResourceOptions()
    return pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(protect=True, retain_on_delete=retain or None))
