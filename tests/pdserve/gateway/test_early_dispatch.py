"""Early dispatch: the gateway sends prefill and decode at once to a pair that registered kv_streaming, and
signs decode's kv_transfer_params itself with the params key.

The prefill and decode here are recording HTTP upstreams on real sockets, registered with a real scheduler, in
front of a real gateway process: they stand in for vLLM instances with the streaming connector so the test can
see exactly what each was sent and when (tests/vllm/fleet/test_vllm_gateway.py drives real vLLM). The prefill
upstream holds its answer until decode's request has arrived: a gateway that waited for prefill first would never
see it come.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.kv import params as signed_params
from pdserve.scheduler.client import bearer
from tests.support.cluster import KEYS, metric, wait_for, write_keys_file
from tests.support.ports import free_port
from tests.support.services import Service, gateway_token_file, principal_token, start_scheduler

HOLD_SECONDS = 10.0


@dataclass
class Upstream:
    """An OpenAI-ish server that records each request body and the moment it came."""

    role: str
    port: int = field(default_factory=free_port)
    received: list[dict[str, Any]] = field(default_factory=list)
    decode_arrived: threading.Event | None = None
    """prefill only: set by the decode upstream; early-dispatched prefills answer once it is set (or after a hold)"""
    saw_decode_first: list[bool] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.received.append(body)
        if self.role == "decode":
            assert self.decode_arrived is not None
            self.decode_arrived.set()
            return self.answer(body, "decoded")
        transfer = (body.get("kv_transfer_params") or {}).get("pdstack_transfer_id")
        if transfer is not None:
            assert self.decode_arrived is not None
            self.saw_decode_first.append(await asyncio.to_thread(self.decode_arrived.wait, HOLD_SECONDS))
        if body.get("prompt") == "fail prefill":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        params = {
            "do_remote_prefill": True,
            "remote_engine_id": "p",
            "remote_request_id": "r-seq",
            "remote_host": "127.0.0.1",
            "remote_port": 9,
            "remote_block_ids": [0],
        }
        return JSONResponse({"choices": [{"text": "p", "finish_reason": "length"}], "kv_transfer_params": params})

    @staticmethod
    def answer(body: dict[str, Any], text: str) -> Response:
        if not body.get("stream"):
            return JSONResponse({"id": "cmpl-1", "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

        async def events() -> Any:
            for part in (text[:3], text[3:]):
                chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": part, "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    def serve(self) -> uvicorn.Server:
        app = Starlette(routes=[Route("/v1/completions", self.handle, methods=["POST"])])
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        threading.Thread(target=server.run, daemon=True).start()
        wait_for(lambda: server.started, what=f"{self.role} upstream")
        return server


@dataclass
class Setup:
    tmp: Path
    scheduler: Service
    prefill: Upstream
    decode: Upstream
    key: bytes
    gateways: dict[str, Service]

    def ask(self, gateway: str, prompt: str = "hello there", **extra: Any) -> httpx.Response:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, **extra}
        return httpx.post(
            self.gateways[gateway].url + "/v1/completions",
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {KEYS['bulk']}"},
        )


def register(tmp: Path, scheduler: Service, instance_id: str, upstream: Upstream, streaming: bool) -> None:
    auth = bearer(principal_token(tmp, f"instance:{instance_id}"))
    info = {
        "instance_id": instance_id,
        "role": upstream.role,
        "version": "v1",
        "kv_fingerprint": "sha256:fp",
        "url": upstream.url,
        "model": "tiny",
        "kv_streaming": streaming,
    }
    if upstream.role == "prefill":
        info.update(kv_host="10.0.1.5", kv_port=14600)
    assert httpx.post(f"{scheduler.url}/v1/instances", json=info, headers=auth).status_code == 201
    beat = {"load": {"ready": True, "max_concurrency": 64}}
    beaten = httpx.post(f"{scheduler.url}/v1/instances/{instance_id}/heartbeat", json=beat, headers=auth)
    assert beaten.status_code == 200


def start_gateway(tmp: Path, scheduler: Service, name: str, *flags: str) -> Service:
    token_file = tmp / "server.token"
    token_file.write_text(secrets.token_urlsafe(16))
    args = [
        "--scheduler-url",
        scheduler.url,
        "--api-keys-file",
        str(write_keys_file(tmp / "keys.json")),
        "--scheduler-token-file",
        str(gateway_token_file(tmp)),
        "--server-token-file",
        str(token_file),
        "--routing-poll-interval",
        "0.1",
        "--offload-threshold-tokens",
        "0",
        *flags,
    ]
    gateway = Service("pdserve.gateway", args, tmp / f"gateway-{name}.log").start()
    wait_for(lambda: httpx.get(gateway.url + "/health/ready").json()["instances"] == 2, what="routable pair")
    return gateway


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("early")
    scheduler, _ = start_scheduler(tmp, heartbeat_interval=60.0)  # dead only after 3 min without heartbeats
    arrived = threading.Event()
    prefill, decode = Upstream("prefill", decode_arrived=arrived), Upstream("decode", decode_arrived=arrived)
    servers = [prefill.serve(), decode.serve()]
    register(tmp, scheduler, "prefill-s", prefill, streaming=True)
    register(tmp, scheduler, "decode-s", decode, streaming=True)
    key = secrets.token_bytes(32)
    key_file = tmp / "params.key"
    key_file.write_text(key.hex())
    gateways: dict[str, Service] = {}
    try:
        gateways["early"] = start_gateway(tmp, scheduler, "early", "--kv-params-key-file", str(key_file))
        gateways["sequential"] = start_gateway(tmp, scheduler, "sequential")
        yield Setup(tmp, scheduler, prefill, decode, key, gateways)
    finally:
        for gateway in gateways.values():
            gateway.stop()
        for server in servers:
            server.should_exit = True
        scheduler.stop()


@pytest.fixture(autouse=True)
def fresh(setup: Setup) -> None:
    for upstream in (setup.prefill, setup.decode):
        upstream.received.clear()
    setup.prefill.saw_decode_first.clear()
    assert setup.decode.decode_arrived is not None
    setup.decode.decode_arrived.clear()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_prefill_and_decode_go_out_together(setup: Setup, stream: bool) -> None:
    response = setup.ask("early", stream=stream)
    assert response.status_code == 200, response.text
    assert "oded" in response.text  # decode's answer ("decoded", or its two streamed parts "dec", "oded")
    if stream:
        assert response.text.count("data:") == 3
    wait_for(lambda: setup.prefill.saw_decode_first == [True], what="prefill answered after decode arrived")
    [prefill_body], [decode_body] = setup.prefill.received, setup.decode.received
    asked = prefill_body["kv_transfer_params"]
    assert (prefill_body["max_tokens"], prefill_body["stream"], asked["do_remote_decode"]) == (1, False, True)
    transfer_id = asked["pdstack_transfer_id"]
    assert len(transfer_id) == 32 and int(transfer_id, 16) >= 0
    params = signed_params.verify(setup.key, decode_body["kv_transfer_params"])
    assert {k: v for k, v in params.items() if k != signed_params.SIGNATURE_FIELD} == {
        "do_remote_prefill": True,
        "remote_request_id": transfer_id,
        "remote_engine_id": "prefill-s",
        "remote_host": "10.0.1.5",
        "remote_port": 14600,
        "remote_block_ids": None,
        "kv_fingerprint": "sha256:fp",
        "pdstack_streamed": True,
    }
    assert (decode_body["max_tokens"], decode_body["stream"]) == (8, stream)


def test_each_request_gets_its_own_transfer(setup: Setup) -> None:
    for count in range(1, 4):
        assert setup.ask("early").status_code == 200
        # decode's answer can reach the client before prefill's request reaches its upstream
        wait_for(lambda n=count: len(setup.prefill.saw_decode_first) == n, what=f"prefill {count} answered")
        setup.decode.decode_arrived.clear()  # type: ignore[union-attr]
    ids = {body["kv_transfer_params"]["pdstack_transfer_id"] for body in setup.prefill.received}
    assert len(ids) == 3


def test_a_failing_prefill_leaves_decode_to_answer_and_is_counted(setup: Setup) -> None:
    """Decode's own load-failure policy recomputes when prefill fails; the gateway answers from decode and
    records prefill's failure."""
    response = setup.ask("early", prompt="fail prefill")
    assert response.status_code == 200 and "decoded" in response.text

    def counted() -> bool:
        text = httpx.get(setup.gateways["early"].url + "/metrics").text
        return metric(text, "pdserve_gateway_early_dispatch_prefills_total", outcome="http_500") == 1

    wait_for(counted, what="the failed prefill counted")


def test_without_the_params_key_the_flow_stays_sequential(setup: Setup) -> None:
    """A gateway that holds no params key runs vLLM's proxy flow: decode gets the params prefill returned."""
    assert setup.ask("sequential").status_code == 200
    [prefill_body], [decode_body] = setup.prefill.received, setup.decode.received
    assert "pdstack_transfer_id" not in prefill_body["kv_transfer_params"]
    assert decode_body["kv_transfer_params"]["remote_request_id"] == "r-seq"
    assert setup.prefill.saw_decode_first == []


def test_a_bad_params_key_file_is_refused_at_start(setup: Setup, tmp_path: Path) -> None:
    bad = tmp_path / "params.key"
    bad.write_text("not hex")
    gateway = Service(
        "pdserve.gateway",
        [
            "--scheduler-url",
            setup.scheduler.url,
            "--api-keys-file",
            str(setup.tmp / "keys.json"),
            "--scheduler-token-file",
            str(setup.tmp / "tokens/gateway.token"),
            "--server-token-file",
            str(setup.tmp / "server.token"),
            "--kv-params-key-file",
            str(bad),
        ],
        tmp_path / "gateway.log",
    )
    gateway.launch()
    assert gateway.process is not None and gateway.process.wait(30) != 0
    assert "kv_params_key_file" in gateway.logs() and "64 hex characters" in gateway.logs()
