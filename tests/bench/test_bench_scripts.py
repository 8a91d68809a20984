"""Every benchmark script of the main environment starts from the checkout as docs/bench.md shows it: its imports
resolve and its command line parses (bench/vllm_*.py run in .venv-vllm: tests/vllm runs bench/vllm_ttft.py's
code)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

SCRIPTS = sorted(
    path.name for path in (REPO / "bench").glob("*.py") if not path.name.startswith(("vllm_", "provenance", "_"))
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_script_starts_and_describes_its_options(script: str) -> None:
    done = subprocess.run(
        [sys.executable, f"bench/{script}", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout


def test_every_main_environment_script_is_covered() -> None:
    assert {"kv_channel.py", "gateway_overhead.py", "decode_batching.py"} <= set(SCRIPTS)
