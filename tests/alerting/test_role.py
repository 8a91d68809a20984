"""roles/alertmanager without a node: a bad webhook URL is refused naming the variable, and never shows in the
output (a webhook URL may hold a token)."""

from __future__ import annotations

from pathlib import Path

from tests.deploy.test_roles_static import include, play

TOKEN = "tok-3f9a1c"  # a marker the output must not show


def test_a_bad_webhook_url_is_refused_naming_it_and_not_shown(tmp_path: Path) -> None:
    code, output = play(
        tmp_path, include("alertmanager"), {"alertmanager_webhook_url": f"ftp://hooks.example.com/{TOKEN}"}
    )
    assert code != 0, output
    assert "alertmanager_webhook_url must be an http:// or https:// URL with a host (value not shown)" in output
    assert TOKEN not in output


def test_a_listener_beyond_loopback_without_client_certificates_is_refused(tmp_path: Path) -> None:
    code, output = play(tmp_path, include("alertmanager"), {"alertmanager_address": "10.0.0.5"})
    assert code != 0, output
    assert "alertmanager_address 10.0.0.5 is not loopback" in output
