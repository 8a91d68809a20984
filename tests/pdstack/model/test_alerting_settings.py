"""The stack's alerting settings: a webhook URL in plain text or as a Pulumi secret, refused naming the field when
it is not a usable URL or carries a credential in plain text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdstack.model import PulumiSecret
from pdstack.stacks.files import load_stack_file
from tests.support.stackedit import edit, problems_of


def alerting(value: Any) -> Any:
    return lambda c: c.update({"pdstack:alerting": value})


def test_a_plain_webhook_url_and_a_pulumi_secret_are_accepted(stacks_dir: Path) -> None:
    control = stacks_dir / "Pulumi.prod-control.yaml"
    edit(control, alerting({"webhook_url": "https://hooks.example.com/pdstack"}))
    assert problems_of(stacks_dir) == []
    loaded = load_stack_file(control).config.alerting
    assert loaded is not None and loaded.webhook_url == "https://hooks.example.com/pdstack"
    # what `pulumi config set --secret --path pdstack:alerting.webhook_url URL` writes into the stack file
    edit(control, alerting({"webhook_url": {"secure": "v1:Zm9v:YmFy"}}))
    assert problems_of(stacks_dir) == []
    loaded = load_stack_file(control).config.alerting
    assert loaded is not None and loaded.webhook_url == PulumiSecret(secure="v1:Zm9v:YmFy")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            {"webhook_url": "https://hooks.example.com/x?token=abc"},
            "pdstack:alerting.webhook_url: the URL carries a credential (user:password@, a query string or a fragment) "
            "in plain text: store it as a secret",
        ),
        ({"webhook_url": "https://bot:hunter2@hooks.example.com/x"}, "carries a credential"),
        (
            {"webhook_url": "ftp://hooks.example.com/x"},
            "pdstack:alerting.webhook_url: the URL must be an http:// or https:// URL with a host",
        ),
        ({"webhook_url": "https:///nohost"}, "must be an http:// or https:// URL with a host"),
        ({"webhook_url": "https://hooks.example.com:99999/x"}, "pdstack:alerting.webhook_url: the URL is not a URL"),
        ({"webhook_url": {"secure": ""}}, "pdstack:alerting.webhook_url.PulumiSecret.secure"),
        ({"webhook": "https://hooks.example.com/x"}, "pdstack:alerting.webhook: unknown key"),
    ],
)
def test_a_bad_webhook_setting_is_refused_naming_its_field(stacks_dir: Path, value: Any, expected: str) -> None:
    edit(stacks_dir / "Pulumi.prod-control.yaml", alerting(value))
    found = problems_of(stacks_dir)
    assert any(expected in p for p in found), found


def test_alerting_belongs_to_the_control_plane_stack(stacks_dir: Path) -> None:
    edit(stacks_dir / "Pulumi.prod-decode-us-west-2.yaml", alerting({"webhook_url": "https://hooks.example.com/x"}))
    found = problems_of(stacks_dir)
    assert any("pdstack:alerting must be set in the control-plane stack" in p for p in found), found
