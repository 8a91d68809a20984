"""bench/kv_channel.py, the KV channel's goodput figures, at a tiny size on loopback: it runs from a checkout as the
docs show it, moves the KV through a real server and pull processes beside iperf3, and records what it measured
and where (the machine's CPUs and the ones the run was allowed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def test_the_loopback_bench_records_kv_and_iperf3_figures_for_each_stream_count(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "bench/kv_channel.py",
        "--no-wan",
        "--mib",
        "4",
        "--repeats",
        "1",
        "--stream-counts",
        "1,2",
        "--iperf-seconds",
        "1",
        "--output",
        str(tmp_path),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    (report_file,) = tmp_path.glob("kv_channel-*.json")
    report = json.loads(report_file.read_text())
    rows = report["loopback"]["rows"]
    assert [row["streams"] for row in rows] == [1, 2]
    for row in rows:
        assert row["iperf3_mbit"] > 0 and row["warm_mbit_median"] > 0 and row["cold_mbit"] > 0, row
    assert report["machine"]["cpus_allowed"] == sorted(os.sched_getaffinity(0))
    markdown = report_file.with_suffix(".md").read_text()
    assert "| 2 |" in markdown and "run on CPUs" in markdown
