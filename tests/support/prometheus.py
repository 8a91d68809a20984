"""A real Prometheus on loopback scraping the given targets every second, as roles/prometheus labels them."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx

from tests.support.cluster import wait_for
from tests.support.ports import free_port
from tests.support.process import Daemon

Targets = dict[str, tuple[str, dict[str, str]]]
"""job -> (the target's http:// base URL, the labels the job's static config gives it)."""
Credentials = Mapping[str, Path]
"""job -> the file holding the Bearer token its target's /metrics requires (the gateway's metrics token)."""


def scrape_config(targets: Targets, credentials: Credentials | None = None) -> str:
    """One job per component with the labels roles/prometheus gives it, and the `authorization` block the
    deployed configs give a job whose target requires a token (pdstack.contract.components.ScrapeGroup); scraped every
    second."""
    tokens = credentials or {}
    jobs = [
        {
            "job_name": job,
            "static_configs": [{"targets": [url.removeprefix("http://")], "labels": labels}],
            **({"authorization": {"type": "Bearer", "credentials_file": str(tokens[job])}} if job in tokens else {}),
        }
        for job, (url, labels) in targets.items()
    ]
    return json.dumps({"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "scrape_configs": jobs})


def all_targets_up(url: str, count: int) -> bool:
    active = httpx.get(url + "/api/v1/targets").json()["data"]["activeTargets"]
    return len(active) == count and all(t["health"] == "up" for t in active)


@contextlib.contextmanager
def scraping(folder: Path, targets: Targets, credentials: Credentials | None = None) -> Iterator[str]:
    """Prometheus' URL once it has scraped every target (presenting `credentials` where given); stopped after."""
    assert shutil.which("prometheus"), "prometheus is not installed: apt-get install prometheus"
    (folder / "prometheus.yml").write_text(scrape_config(targets, credentials))
    port = free_port()
    argv = [
        "prometheus",
        f"--config.file={folder / 'prometheus.yml'}",
        f"--storage.tsdb.path={folder / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ]
    url = f"http://127.0.0.1:{port}"
    prometheus = Daemon("prometheus", argv, url, folder / "prometheus.log").start(timeout=60)
    try:
        wait_for(lambda: all_targets_up(url, len(targets)), timeout=60, what="every target scraped")
        yield url
    finally:
        prometheus.stop(grace=20)
