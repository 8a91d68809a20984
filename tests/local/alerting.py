"""An alert from the local environment reaches a webhook: called by tests/local/test_local_env.py right after its
killed-decode test, whose kill leaves PdstackContainerRestarting firing for 15 minutes (up went 1, 0, 1).

The control node's Alertmanager (roles/alertmanager) is pointed at a receiver this test runs on the host's service
address, which every node reaches through its router, by running the role again with alertmanager_webhook_url; the
alert then arrives through the warning route once the new receivers' group wait (30 s) has passed.
"""

from __future__ import annotations

import json
from typing import Any

from pdstack.contract.alerting import receiver_name
from pdstack.local.topology import SERVICE_ADDRESS
from tests.support.webhook import Webhook

DELIVERY_TIMEOUT_S = 120.0  # the role's reload, the 30 s group wait, and a loaded 2-core host


def assert_a_restarted_decode_reaches_the_webhook(local: Any) -> None:
    """`local` is test_local_env.Local after a decode container was killed and came back."""
    webhook = Webhook(host=str(SERVICE_ADDRESS)).start()
    try:
        extra = json.dumps({"alertmanager_webhook_url": webhook.url})
        local.env.play("serving.yml", "--tags", "alertmanager", "--limit", "control", "-e", extra, say=lambda _: None)
        receiver, alert = webhook.wait_for(
            "PdstackContainerRestarting", timeout=DELIVERY_TIMEOUT_S, job="pdserve-decode"
        )[0]
        assert receiver == receiver_name("local", "warning")
        assert alert["status"] == "firing" and alert["labels"]["datacenter"] == "dc2", alert
        assert webhook.refused == 0
    finally:
        webhook.stop()
