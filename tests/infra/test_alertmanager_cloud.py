"""The cloud's Alertmanager: the control-plane stack's webhook reaches its configuration, which is a Kubernetes Secret
given to Pulumi as a secret (the URL may hold a token), and which Alertmanager's own checker accepts."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pulumi
import pytest
import yaml

from infra.prometheus import UNDECRYPTED_WEBHOOK, alertmanager_yaml, webhook_url
from pdstack.alerting import receiver_name
from pdstack.synth import synthesize

from .conftest import STACKS

AMTOOL = shutil.which("amtool")
HOOK = "https://hooks.example.com/pdstack"


@pytest.mark.slow  # a synthesis and amtool
def test_the_stacks_webhook_is_in_a_secret_alertmanager_checks(tmp_path: Path) -> None:
    graph = synthesize(STACKS / "Pulumi.prod-control.yaml", {"pdstack:alerting": {"webhook_url": HOOK}})
    secrets = {r.inputs["metadata"]["name"]: r for r in graph.of_type("kubernetes:core/v1:Secret")}
    config_maps = {r.inputs["metadata"]["name"] for r in graph.of_type("kubernetes:core/v1:ConfigMap")}
    assert "alertmanager" not in config_maps
    secret = secrets["alertmanager"]
    assert "stringData" in secret.secret_inputs
    text = secret.inputs["stringData"]["alertmanager.yml"]
    config = yaml.safe_load(text)
    hooks = {r["name"]: [w["url"] for w in r.get("webhook_configs", [])] for r in config["receivers"]}
    assert hooks == {"pdstack-prod": [], receiver_name("prod", "critical"): [HOOK],
                     receiver_name("prod", "warning"): [HOOK]}  # fmt: skip
    assert AMTOOL is not None, "apt-get install prometheus-alertmanager"
    (tmp_path / "alertmanager.yml").write_text(text)
    check = subprocess.run([AMTOOL, "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True,
                           text=True, check=False)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_webhook_url_pulumi_has_not_decrypted_renders_a_stand_in() -> None:
    """Offline (pdstack synth, mocks) the stack's secret is ciphertext: the receivers point at a .invalid host."""
    assert webhook_url({"webhook_url": {"secure": "v1:abc"}}) == UNDECRYPTED_WEBHOOK
    assert webhook_url({"webhook_url": HOOK}) == HOOK
    assert webhook_url(None) is None and webhook_url({}) is None


@pulumi.runtime.test
def test_the_rendered_configuration_is_a_secret_output() -> pulumi.Output[None]:
    rendered = alertmanager_yaml("dev", pulumi.Output.from_input({"webhook_url": HOOK}))

    def check(args: list[object]) -> None:
        text, is_secret = args
        assert is_secret is True
        assert HOOK in str(text) and "PdstackDatacenterLinkDown" in str(text)

    return pulumi.Output.all(rendered, pulumi.Output.from_input(rendered.is_secret())).apply(check)
