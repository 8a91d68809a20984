"""What the tests share (docs/testing.md): the repository's paths here; in the modules beside, the harnesses that
start pdserve processes (`serverproc`, `services`, `cluster`), free ports, TLS files, an OTLP receiver and the
dashboards' queries; the fixtures every folder may use in `fixtures` (a plugin of tests/conftest.py, so loaded by
.venv-vllm's runs of tests/vllm too: what it and the modules tests/vllm imports need must be in both environments)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STACKS = REPO / "stacks"
