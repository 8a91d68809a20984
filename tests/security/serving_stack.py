"""A whole pdserve stack on loopback for the adversarial tests, built with tests/support's Cluster."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import KEYS, Cluster

KEY = KEYS["bulk"]  # limits far above what these tests send: they probe inputs, not the rate limiter
AUTH = {"Authorization": f"Bearer {KEY}"}
NORMAL = {"model": "dense", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4, "temperature": 0}


@contextmanager
def pd_stack(tmp: Path, kv_key: Path, model: Path, env: Mapping[str, str] | None = None) -> Iterator[Cluster]:
    """Scheduler, prefill `p`, decode `d` and one gateway (prompts of 8 tokens or more go to remote prefill);
    `env` is set in the environment of every process."""
    cluster = Cluster(tmp, kv_key)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        try:
            cluster.start_pd(
                [("p", "prefill", model, "v1"), ("d", "decode", model, "v1")],
                "--tokenizer-file",
                str(model / "tokenizer.json"),
                "--offload-threshold-tokens",
                "8",
            )
            yield cluster
        finally:
            cluster.stop()


def normal_completion(gateway_url: str) -> httpx.Response:
    """A well-formed completion through the gateway, on a fresh connection."""
    return httpx.post(f"{gateway_url}/v1/completions", json=NORMAL, headers=AUTH, timeout=60)
