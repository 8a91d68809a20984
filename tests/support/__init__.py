"""What the tests share (docs/testing.md), one copy of each: the repository's paths here; in the modules beside,
the lifecycle of the server processes tests start (`process`: Daemon and ChildProcess) and the pdserve harnesses
built on it (`serverproc`, `services`, `cluster`), free ports (`ports`), ansible-playbook and its recaps (`ansible`),
edits of the example stacks (`stackedit`), TLS files (`tlsfiles`), an OTLP receiver (`otlp`), a webhook receiver
(`webhook`) and the dashboards' queries (`dashboardcheck`); the fixtures every folder may use (`fixtures`: a plugin
of tests/conftest.py, so loaded by .venv-vllm's runs of tests/vllm too: what it and the modules tests/vllm imports
need must be in both environments)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STACKS = REPO / "stacks"
