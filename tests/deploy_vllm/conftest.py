"""The vLLM converge test runs only when asked (PDSTACK_VLLM_CONVERGE=1, or `make test-vllm-deploy`): it needs the
3.78 GB vLLM-cpu image (about 10 minutes to build the first time) and two vLLM engines in node containers, more
than CI's time budget holds. Without the switch its module is not collected, so no skipped test stands in for it.
CI runs the role's fast checks instead: tests/deploy/test_vllm_engine_static.py, tests/pdstack/vllm/test_deploy.py."""

from __future__ import annotations

import os

collect_ignore_glob = [] if os.environ.get("PDSTACK_VLLM_CONVERGE") == "1" else ["test_*.py"]
