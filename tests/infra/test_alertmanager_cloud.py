"""The cloud's Alertmanager: the control-plane stack's webhook reaches its configuration, which is a Kubernetes Secret
given to Pulumi as a secret (the URL may hold a token), and which Alertmanager's own checker accepts; the web
configuration it is started with makes a real Alertmanager serve TLS to clients with a certificate from the CA only."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import pulumi
import pytest
import yaml

from infra.prometheus import UNDECRYPTED_WEBHOOK, alertmanager_yaml, web_config, webhook_url
from pdstack.contract.alerting import receiver_name
from pdstack.contract.components import TLS_DIR
from pdstack.local.tls import Leaf, LocalCA
from pdstack.synth.synthesis import synthesize
from tests.support import STACKS
from tests.support.ports import free_port
from tests.support.process import Daemon

from .conftest import mounted_tls

AMTOOL = shutil.which("amtool")
ALERTMANAGER = shutil.which("prometheus-alertmanager")
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
    assert hooks == {
        "pdstack-prod": [],
        receiver_name("prod", "critical"): [HOOK],
        receiver_name("prod", "warning"): [HOOK],
    }
    assert AMTOOL is not None, "apt-get install prometheus-alertmanager"
    (tmp_path / "alertmanager.yml").write_text(text)
    check = subprocess.run(
        [AMTOOL, "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True, text=True, check=False
    )
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


def test_the_web_configuration_admits_only_clients_with_a_certificate_from_the_ca(tmp_path: Path) -> None:
    """web_config(client_auth=True), as the cluster's Alertmanager gets it, with the Secret's files (TLS_DIR) here."""
    assert ALERTMANAGER is not None, "apt-get install prometheus-alertmanager"
    ca = LocalCA(tmp_path / "tls")
    ca.ensure([Leaf("alertmanager", ("localhost",), ("127.0.0.1",)), Leaf("prometheus", ("prometheus.test",), ())])
    served = mounted_tls(ca, "alertmanager", tmp_path / "run-tls")
    web = yaml.safe_dump(web_config(client_auth=True)).replace(TLS_DIR, str(served))
    (tmp_path / "web.yml").write_text(web)
    (tmp_path / "alertmanager.yml").write_text(
        yaml.safe_dump({"route": {"receiver": "none"}, "receivers": [{"name": "none"}]})
    )
    port = free_port()
    client = ssl.create_default_context(cafile=str(ca.ca_cert))
    client.load_cert_chain(ca.cert("prometheus"), ca.key("prometheus"))
    url = f"https://127.0.0.1:{port}"
    daemon = Daemon(
        "alertmanager",
        [
            ALERTMANAGER,
            f"--config.file={tmp_path / 'alertmanager.yml'}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            f"--web.config.file={tmp_path / 'web.yml'}",
        ],
        url,
        tmp_path / "alertmanager.log",
        verify=client,
    )
    daemon.start()
    try:
        assert httpx.get(f"{url}/api/v2/status", verify=client, timeout=5).status_code == 200
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/-/ready", verify=ssl.create_default_context(cafile=str(ca.ca_cert)), timeout=5)
        assert httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=5).status_code == 400
    finally:
        daemon.stop()
