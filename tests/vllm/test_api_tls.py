"""vLLM's API server with the TLS flags pdstack renders for a node with a certificate (pdstack.vllm.command NodeTls,
under the stack's mutual TLS): it serves the node's pair, the agent's own engine client reaches it presenting a
certificate from the CA (health, the served model, the load it heartbeats), and a caller without one or in plain
HTTP is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pdserve.agent.engine import Engine
from pdserve.common.tls import TLSClientSettings, client_context
from pdstack.local.tls import Leaf, LocalCA
from pdstack.vllm.command import NodeTls
from tests.vllm.conftest import VLLMServer


async def engine_view(engine: Engine) -> tuple[bool, str]:
    try:
        healthy, model = await engine.healthy(), await engine.model()
        await engine.load()  # its /metrics parse: what the agent heartbeats
        return healthy, model.name
    finally:
        await engine.aclose()


def test_vllm_serves_the_nodes_pair_and_admits_only_callers_with_a_certificate_from_the_ca(
    model_dir: Path, tmp_path: Path
) -> None:
    ca = LocalCA(tmp_path / "ca")
    ca.ensure([Leaf("node", ("vllm.node.test",), ("127.0.0.1",)), Leaf("caller", ("caller.test",), ())])
    tls = NodeTls(cert=str(ca.cert("node")), key=str(ca.key("node")), ca=str(ca.ca_cert), mutual=True)
    caller = client_context(
        TLSClientSettings(tls_ca=ca.ca_cert, tls_client_cert=ca.cert("caller"), tls_client_key=ca.key("caller"))
    )
    server = VLLMServer(
        "tls",
        model_dir,
        "",
        0,
        {},
        tmp_path / "vllm.log",
        args=tuple(tls.server_flags()),
        connector=False,
        verify=caller,
    )
    server.start()
    try:
        server.wait_ready()
        assert asyncio.run(engine_view(Engine(server.url, None, 10, caller))) == (True, str(model_dir))
        without_certificate = client_context(TLSClientSettings(tls_ca=ca.ca_cert))
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", verify=without_certificate, timeout=5)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    finally:
        server.stop()
