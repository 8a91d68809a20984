"""Alerts reach someone: a real pdserve decode server scraped by a real Prometheus (Debian's) is killed, the rule
fires, Debian's Alertmanager routes it by severity to the webhook of the stack; a silence made through Alertmanager's
API stops its delivery; a datacenter's link-down alert inhibits that datacenter's KV alerts and no other's.

Prometheus and Alertmanager run with the configurations roles/prometheus and roles/alertmanager render (Ansible, the
contract's local variables), the routing from pdstack/contract/alerting.py with its intervals shortened, and the rules
of monitoring/alerts.yml without their `for:` waits.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from pdserve.engine.testmodels import make_test_checkpoint
from pdstack.contract.alerting import LINK_DOWN_ALERT, Timing, alertmanager_config, receiver_name
from pdstack.contract.components import ALERTMANAGER_API
from tests.alerting.stack import (
    CONTRACT_VARS,
    alert_state,
    create_silence,
    fast_rules,
    post_alert,
    render,
    wait_until,
)
from tests.support.ports import free_port
from tests.support.process import Daemon
from tests.support.serverproc import ServerProcess
from tests.support.webhook import Webhook

PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager")
AMTOOL = shutil.which("amtool")
NODE_EXPORTER = shutil.which("prometheus-node-exporter")
# Notifications within a second of an alert, repeated every 2 s while it fires (production: 30s/10s, 5m, 4h/1h).
FAST = Timing(
    group_wait="1s", group_interval="1s", repeat_interval="2s", critical_group_wait="1s", critical_repeat_interval="2s"
)
CRITICAL, WARNING = receiver_name("local", "critical"), receiver_name("local", "warning")


@dataclass
class Monitoring:
    prometheus: str
    alertmanager: str
    webhook: Webhook
    decode: ServerProcess
    folder: Path


def _node_exporter(port: int, log: Path) -> Daemon:
    argv = [
        str(NODE_EXPORTER),
        f"--web.listen-address=127.0.0.1:{port}",
        "--collector.disable-defaults",
        "--collector.meminfo",
    ]
    return Daemon("node_exporter", argv, f"http://127.0.0.1:{port}", log)


@pytest.fixture(scope="module")
def monitoring(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Monitoring]:
    for binary, package in (
        (PROMETHEUS, "prometheus"),
        (ALERTMANAGER, "prometheus-alertmanager"),
        (NODE_EXPORTER, "prometheus-node-exporter"),
    ):
        assert binary is not None, f"apt-get install {package}"
    folder = tmp_path_factory.mktemp("monitoring")
    key = folder / "kv.key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)
    model = make_test_checkpoint("dense", folder / "model", dtype="float32")
    decode = ServerProcess("decode", model, args=["--kv-key-file", str(key)], log_path=folder / "decode.log")
    webhook = Webhook().start()
    ports = {"prometheus": free_port(), "alertmanager": free_port(), "node": free_port()}
    started: list[Daemon] = []
    try:
        decode.start().wait_ready()
        started.append(_node_exporter(ports["node"], folder / "node_exporter.log").start())
        # one decode node in dc2, as the local inventory names its hosts
        host = {
            "pdstack_address": "127.0.0.1",
            "pdstack_datacenter": "dc2",
            "pdstack_pool": "decode",
            "pdstack_role": "decode",
        }
        render(
            folder,
            {"all": {"children": {"decode": {"hosts": {"dc2-decode-1": host}}}}},
            {
                "prometheus_address": "127.0.0.1",
                "prometheus_port": ports["prometheus"],
                "prometheus_scrape_interval": "1s",
                "prometheus_scrape_groups": [{"job": "pdserve-decode", "group": "decode", "port": decode.port}],
                "prometheus_node_exporter_targets": [f"127.0.0.1:{ports['node']}"],
                "prometheus_alertmanager_targets": [f"127.0.0.1:{ports['alertmanager']}"],
                "alertmanager_config": alertmanager_config("local", timing=FAST),
                "alertmanager_webhook_url": webhook.url,
            },
        )
        fast_rules(folder / "rules")
        am = f"http://127.0.0.1:{ports['alertmanager']}"
        started.append(
            Daemon(
                "alertmanager",
                [
                    str(ALERTMANAGER),
                    f"--config.file={folder / 'alertmanager.yml'}",
                    f"--storage.path={folder / 'am-data'}",
                    f"--web.listen-address=127.0.0.1:{ports['alertmanager']}",
                    "--cluster.listen-address=",
                ],
                am,
                folder / "alertmanager.log",
            ).start()
        )
        prom = f"http://127.0.0.1:{ports['prometheus']}"
        started.append(
            Daemon(
                "prometheus",
                [
                    str(PROMETHEUS),
                    f"--config.file={folder / 'prometheus.yml'}",
                    f"--storage.tsdb.path={folder / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                ],
                prom,
                folder / "prometheus.log",
            ).start()
        )
        yield Monitoring(prom, am, webhook, decode, folder)
    finally:
        for daemon in reversed(started):
            daemon.stop()
        decode.stop()
        webhook.stop()


def _up(prometheus: str, job: str) -> list[float]:
    result = httpx.get(f"{prometheus}/api/v1/query", params={"query": f'up{{job="{job}"}}'}, timeout=5).json()
    return [float(r["value"][1]) for r in result["data"]["result"]]


def test_amtool_accepts_the_contracts_configuration_and_the_rendered_one(
    monitoring: Monitoring, tmp_path: Path
) -> None:
    assert AMTOOL is not None, "apt-get install prometheus-alertmanager"
    contract_config = tmp_path / "contract.yml"  # as the role gets it with no webhook (no webhook_configs at all)
    contract_config.write_text(yaml.safe_dump(yaml.safe_load(CONTRACT_VARS.read_text())["alertmanager_config"]))
    for path in (contract_config, monitoring.folder / "alertmanager.yml"):
        check = subprocess.run([AMTOOL, "check-config", str(path)], capture_output=True, text=True, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "3 receivers" in check.stdout and "2 inhibit rules" in check.stdout, check.stdout
    rendered = yaml.safe_load((monitoring.folder / "alertmanager.yml").read_text())
    hooks = {r["name"]: [w["url"] for w in r.get("webhook_configs", [])] for r in rendered["receivers"]}
    assert hooks == {"pdstack-local": [], CRITICAL: [monitoring.webhook.url], WARNING: [monitoring.webhook.url]}


def test_prometheus_sends_to_the_alertmanager_the_role_names(monitoring: Monitoring) -> None:
    def active() -> list[str]:
        found = httpx.get(f"{monitoring.prometheus}/api/v1/alertmanagers", timeout=5).json()["data"]
        return [a["url"] for a in found["activeAlertmanagers"]]

    wait_until(lambda: active() != [], "Prometheus discovers its Alertmanager")
    assert active() == [f"{monitoring.alertmanager}{ALERTMANAGER_API}/alerts"]
    status = httpx.get(f"{monitoring.alertmanager}{ALERTMANAGER_API}/status", timeout=5).json()
    assert status["cluster"]["status"] == "disabled"  # what roles/alertmanager's verify checks


def test_a_killed_decode_reaches_the_webhook_through_the_critical_route(monitoring: Monitoring) -> None:
    wait_until(lambda: _up(monitoring.prometheus, "pdserve-decode") == [1.0], "Prometheus scrapes the decode server")
    assert monitoring.webhook.alerts("PdstackTargetDown") == []  # nothing pages while it is up
    monitoring.decode.kill()
    receiver, alert = monitoring.webhook.wait_for("PdstackTargetDown", job="pdserve-decode")[0]
    assert receiver == CRITICAL
    assert alert["status"] == "firing"
    assert alert["labels"]["datacenter"] == "dc2" and alert["labels"]["severity"] == "critical"
    # the node answering keeps dc2 from looking cut off: no link-down alert
    assert monitoring.webhook.alerts(LINK_DOWN_ALERT) == []
    assert monitoring.webhook.refused == 0


def test_a_silence_made_through_the_api_stops_delivery(monitoring: Monitoring) -> None:
    monitoring.decode.kill()  # already dead when the previous test ran
    monitoring.webhook.wait_for("PdstackTargetDown", job="pdserve-decode")
    silence = create_silence(monitoring.alertmanager, {"alertname": "PdstackTargetDown"})
    wait_until(
        lambda: alert_state(monitoring.alertmanager, "PdstackTargetDown")["silencedBy"] == [silence],
        "Alertmanager marks the alert silenced",
    )
    # A control alert on the same repeat cycle: once it has been delivered twice, a notification of the silenced
    # alert would have been due at least once more.
    post_alert(monitoring.alertmanager, "PdstackKVLoadFailures", datacenter="dc2", instance="control:1")
    monitoring.webhook.wait_for("PdstackKVLoadFailures", datacenter="dc2")
    before = len(monitoring.webhook.alerts("PdstackTargetDown"))
    first_control = len(monitoring.webhook.alerts("PdstackKVLoadFailures", datacenter="dc2"))
    receiver, _ = monitoring.webhook.wait_for("PdstackKVLoadFailures", count=first_control + 2, datacenter="dc2")[0]
    assert receiver == WARNING
    assert len(monitoring.webhook.alerts("PdstackTargetDown")) == before
    assert alert_state(monitoring.alertmanager, "PdstackTargetDown")["state"] == "suppressed"


def test_a_datacenters_link_down_inhibits_its_kv_alerts_and_no_others(monitoring: Monitoring) -> None:
    post_alert(monitoring.alertmanager, LINK_DOWN_ALERT, datacenter="dc1")
    receiver, _ = monitoring.webhook.wait_for(LINK_DOWN_ALERT, datacenter="dc1")[0]
    assert receiver == CRITICAL
    for datacenter in ("dc1", "dc3"):
        post_alert(
            monitoring.alertmanager,
            "PdstackKVTransferFailures",
            datacenter=datacenter,
            instance=f"{datacenter}-decode:8300",
            cause="connect",
        )
    # dc3's is delivered, and again on its repeat; dc1's, posted at the same moment, never
    first = len(monitoring.webhook.wait_for("PdstackKVTransferFailures", datacenter="dc3"))
    monitoring.webhook.wait_for("PdstackKVTransferFailures", count=first + 1, datacenter="dc3")
    assert monitoring.webhook.alerts("PdstackKVTransferFailures", datacenter="dc1") == []
    state = alert_state(monitoring.alertmanager, "PdstackKVTransferFailures", datacenter="dc1")
    assert state["state"] == "suppressed" and state["inhibitedBy"], state
    assert alert_state(monitoring.alertmanager, "PdstackKVTransferFailures", datacenter="dc3")["state"] == "active"


def test_the_webhook_refuses_a_caller_without_its_token(monitoring: Monitoring) -> None:
    """The receiver the test stands up is a listener too: without the URL's token it takes nothing."""
    wrong = monitoring.webhook.url.rsplit("/", 1)[0] + "/not-the-token"
    assert httpx.post(wrong, json={"alerts": []}, timeout=5).status_code == 404
    assert monitoring.webhook.refused == 1
