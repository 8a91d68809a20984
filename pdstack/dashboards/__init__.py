"""Grafana dashboards as code: built from Python (boards, with grafana-foundation-sdk), committed as JSON under
monitoring/dashboards/ (files), provisioned by the grafana_dashboards role and as ConfigMaps in the cloud.

promql needs only the standard library, so the vLLM environment's tests can read the committed files with it."""

from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "monitoring" / "dashboards"
"""Where the generated dashboards are committed."""
