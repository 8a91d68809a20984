"""tests/local/test_local_vllm.py runs only when asked (PDSTACK_LOCAL_VLLM=1, or `make test-local-vllm`): it builds
the vLLM-cpu image and starts four vLLM engines, more than CI's time budget holds. Without the switch its module is
not collected, so no skipped test stands in for it.

`local`: each module brings the environment up (from nothing, or a warm `up` that changes nothing) and leaves it up
(test_local_vllm.py brings it up on vLLM with its own)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.local.environment import Local, brought_up

collect_ignore = [] if os.environ.get("PDSTACK_LOCAL_VLLM") == "1" else ["test_local_vllm.py"]


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    yield from brought_up()
