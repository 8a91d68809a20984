"""The GPU node pools of the example stacks as EC2 and Auto Scaling would take them: launch templates EC2 accepts,
groups that wait for their capacity, images the nodes may pull, a pinned node image, and the operators' way in."""

from __future__ import annotations

import pytest

from pdstack.synth.synthesis import Synthesis

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
