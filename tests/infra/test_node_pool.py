"""The GPU node pools of the example stacks as EC2 and Auto Scaling would take them: launch templates EC2 accepts,
groups that wait for their capacity, images the nodes may pull, a pinned node image, and the operators' way in."""

from __future__ import annotations

import pytest

from pdstack.policy import core, rules
from pdstack.synth.synthesis import SynthError, Synthesis, synthesize
from tests.support import STACKS

from .conftest import CLOUD_STACKS

LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
GPU_STACKS = [n for n in CLOUD_STACKS if not n.endswith("-control")]


@pytest.mark.parametrize("name", GPU_STACKS)
def test_only_a_single_interface_template_says_anything_about_public_addresses(
    graphs: dict[str, Synthesis], name: str
) -> None:
    """EC2 refuses AssociatePublicIpAddress when a launch names several interfaces (an EFA template has one per
    network card): those leave it unset; a one-interface template says false."""
    templates = graphs[name].of_type(LAUNCH_TEMPLATE)
    assert templates
    for template in templates:
        interfaces = template.inputs["networkInterfaces"]
        if len(interfaces) > 1:
            assert all("associatePublicIpAddress" not in i for i in interfaces), template.name
        else:
            assert interfaces[0]["associatePublicIpAddress"] == "false", template.name


def test_the_examples_hold_both_kinds_of_template(graphs: dict[str, Synthesis]) -> None:
    counts = {len(t.inputs["networkInterfaces"]) for n in GPU_STACKS for t in graphs[n].of_type(LAUNCH_TEMPLATE)}
    assert 1 in counts and max(counts) == 32  # p5.48xlarge: 32 EFA cards


GROUP = "aws:autoscaling/group:Group"


@pytest.mark.parametrize("name", GPU_STACKS)
def test_pulumi_up_waits_for_each_pools_instances_with_ec2_health_checks(
    graphs: dict[str, Synthesis], name: str
) -> None:
    groups = graphs[name].of_type(GROUP)
    assert groups
    for group in groups:
        assert group.inputs["waitForCapacityTimeout"] == "30m", group.name  # the default of the setting
        assert group.inputs["healthCheckType"] == "EC2"
        assert not group.inputs.get("ignoreFailedScalingActivities")  # a failed launch fails the update at once


def test_the_capacity_wait_is_the_stacks_setting_and_never_zero() -> None:
    path = STACKS / "Pulumi.dev-decode-us-east-2.yaml"
    graph = synthesize(path, {"pdstack-infra:capacity_wait_minutes": 45})
    assert {g.inputs["waitForCapacityTimeout"] for g in graph.of_type(GROUP)} == {"45m"}
    with pytest.raises(SynthError, match=r"pdstack-infra:capacity_wait_minutes: 0 is not between 1 and 240"):
        synthesize(path, {"pdstack-infra:capacity_wait_minutes": 0})


@pytest.mark.parametrize(
    ("timeout", "waits"), [(None, True), ("30m", True), ("1h0m", True), ("0", False), ("0s", False)]
)
def test_the_policy_refuses_a_group_that_does_not_wait(timeout: str | None, waits: bool) -> None:
    props = {} if timeout is None else {"waitForCapacityTimeout": timeout}
    found = rules.evaluate([core.PolicyResource(GROUP, "g", "urn:g", props)])
    assert [v.policy for v in found if v.policy == "group-waits-for-capacity"] == (
        [] if waits else ["group-waits-for-capacity"]
    )
