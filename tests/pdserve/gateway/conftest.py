"""Fixtures for the gateway tests: the tiny checkpoints (the KV key is tests/support's kv_key_file); each test module
builds its own cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cluster import Cluster
from tests.support.fixtures import CheckpointFactory


@pytest.fixture(scope="session")
def model_v1(make_checkpoint: CheckpointFactory) -> Path:
    return make_checkpoint("dense")


@pytest.fixture(scope="session")
def model_v2(make_checkpoint: CheckpointFactory) -> Path:
    """Other weights, hence another KV fingerprint: a v2 release."""
    return make_checkpoint("dense", seed=1)


@pytest.fixture(scope="session")
def model_long(make_checkpoint: CheckpointFactory) -> Path:
    """The v1 architecture with an 8K context, so one stream can run for seconds (about 1 ms per token here)."""
    return make_checkpoint("dense", overrides={"max_position_embeddings": 8192})


@pytest.fixture(scope="module")
def gateway_url(cluster: Cluster) -> str:
    """The first gateway of the module's own `cluster` fixture."""
    return cluster.gateways[0].url
