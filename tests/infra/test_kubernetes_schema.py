"""Every Kubernetes object the control-plane stacks create validates against the OpenAPI schema of the pinned
Kubernetes version (kubernetes-validate ships the schemas: offline), strictly: unknown fields are errors."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from infra.environment import InfraSettings
from pdstack.synth.synthesis import Synthesis

from .conftest import CLOUD_STACKS

KUBERNETES_VERSION = InfraSettings.kubernetes_version + ".0"  # the EKS version the program asks for
CONTROL_STACKS = [n for n in CLOUD_STACKS if n.endswith("-control")]


def manifests(graph: Synthesis) -> list[dict[str, Any]]:
    return [r.inputs for r in graph.resources if r.type.startswith("kubernetes:") and "kind" in r.inputs]


@pytest.mark.parametrize("name", CONTROL_STACKS)
def test_every_kubernetes_object_matches_the_pinned_schema(graphs: dict[str, Synthesis], name: str) -> None:
    objects = manifests(graphs[name])
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace",
        "Deployment",
        "StatefulSet",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "Secret",
        "ConfigMap",
        "StorageClass",
    } <= kinds
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_refuses_a_misspelled_field(graphs: dict[str, Synthesis]) -> None:
    deployment = next(o for o in manifests(graphs["prod-control"]) if o["kind"] == "Deployment")
    broken = {**deployment, "spec": {**deployment["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
