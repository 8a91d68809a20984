"""The example stacks' resource graphs, built once per session by running infra/ under Pulumi mocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from pdstack.local.tls import LocalCA
from pdstack.stacks.files import load_stack_file
from pdstack.synth.synthesis import Synthesis, synthesize
from tests.support import STACKS

CLOUD_STACKS = sorted(
    p.name[len("Pulumi.") : -len(".yaml")]
    for p in STACKS.glob("Pulumi.*.yaml")
    if load_stack_file(p).config.environment != "local"
)


@pytest.fixture(scope="session")
def graphs() -> dict[str, Synthesis]:
    return {name: synthesize(STACKS / f"Pulumi.{name}.yaml") for name in CLOUD_STACKS}


@pytest.fixture(scope="session")
def mutual_tls_graph() -> Synthesis:
    """The prod control-plane stack with serving.mutual_tls on."""
    path = STACKS / "Pulumi.prod-control.yaml"
    serving = {**load_stack_file(path).pulumi_config["pdstack:serving"], "mutual_tls": True}
    return synthesize(path, {"pdstack:serving": serving})


def stack_config(name: str):
    return load_stack_file(STACKS / f"Pulumi.{name}.yaml").config


def mounted_tls(ca: LocalCA, name: str, folder: Path) -> Path:
    """`name`'s pair and the CA in `folder` as its kubernetes.io/tls Secret is mounted at TLS_DIR (the contract's
    file names), for a real daemon started with a rendered configuration whose TLS_DIR is replaced by `folder`."""
    folder.mkdir()
    for source, file in ((ca.cert(name), TLS_CERT_FILE), (ca.key(name), TLS_KEY_FILE), (ca.ca_cert, TLS_CA_FILE)):
        (folder / file).write_bytes(source.read_bytes())
    return folder
