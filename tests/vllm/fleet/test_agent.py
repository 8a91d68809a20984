"""`pdserve agent` beside real vLLM instances: what it registers, when it reports ready, the load it heartbeats
from vLLM's own /metrics, and its drain on SIGTERM (the scheduler stops routing, in-flight requests finish, the
instance deregisters, the agent exits 0).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.agent.instance import InstanceFileError, find
from tests.support.services import Service
from tests.vllm.agenthelpers import API_KEY, MODEL_NAME, Fleet, prompt_of

LONG_TOKENS = 600


@pytest.fixture(scope="module")
def gateway(fleet: Fleet) -> Iterator[Service]:
    with fleet.routed_gateway() as service:
        yield service


def stream_tokens(gateway: Service, max_tokens: int, arrivals: list[tuple[float, int]] | None = None) -> dict[str, Any]:
    """A streamed completion through the gateway: how many tokens came and the last finish_reason; `arrivals`
    gets (arrival time, tokens so far) for each chunk (vLLM may put several tokens in one chunk)."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt_of(50, seed=3),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    tokens, finish = 0, None
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", gateway.url + "/v1/completions", json=body, headers=headers, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += len(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
            if arrivals is not None:
                arrivals.append((time.monotonic(), tokens))
    return {"tokens": tokens, "finish_reason": finish}


def in_background(
    gateway: Service, max_tokens: int
) -> tuple[threading.Thread, dict[str, Any], list[tuple[float, int]]]:
    result: dict[str, Any] = {}
    arrivals: list[tuple[float, int]] = []
    thread = threading.Thread(target=lambda: result.update(stream_tokens(gateway, max_tokens, arrivals)))
    thread.start()
    deadline = time.monotonic() + 120
    while not arrivals:
        assert thread.is_alive() and time.monotonic() < deadline, "the stream never started"
        time.sleep(0.05)
    return thread, result, arrivals


def test_unready_while_vllm_starts(fleet: Fleet) -> None:
    """While vLLM's /health was not yet 200, the scheduler never had the agent's instance ready."""
    assert fleet.unready_samples, "vLLM was healthy at once: nothing sampled"
    assert {state for _, state in fleet.unready_samples} <= {"absent", "starting"}


def test_registration_carries_the_connectors_instance(fleet: Fleet) -> None:
    instances = fleet.instances()
    for role, server in (("prefill", fleet.prefill), ("decode", fleet.decode)):
        info = instances[fleet.agents[role].instance_id]["info"]
        run_dir = fleet.agents[role].run_dir
        files = [path for path in (run_dir / "instance.json", *run_dir.glob("*/instance.json")) if path.exists()]
        assert len(files) == 1, files
        written = json.loads(files[0].read_text())
        assert info["kv_fingerprint"] == written["fingerprint"]
        assert info["kv_streaming"] == (written.get("kv_streaming") is True)
        assert (info["url"], info["model"], info["role"], info["version"]) == (server.url, MODEL_NAME, role, "v1")
        assert info["max_model_len"] == 2048
    prefill = instances[fleet.agents["prefill"].instance_id]["info"]
    assert (prefill["kv_host"], prefill["kv_port"]) == ("127.0.0.1", fleet.prefill.extra["kv_port"])
    decode = instances[fleet.agents["decode"].instance_id]["info"]
    assert prefill["kv_fingerprint"] == decode["kv_fingerprint"]


def test_load_comes_from_vllms_metrics(fleet: Fleet, gateway: Service) -> None:
    decode_id = fleet.agents["decode"].instance_id
    thread, result, _ = in_background(gateway, LONG_TOKENS)
    try:
        deadline = time.monotonic() + 30
        while (load := fleet.instances()[decode_id]["load"])["active_requests"] < 1:
            assert time.monotonic() < deadline, f"decode's load never showed the request: {load}"
            time.sleep(0.2)
        assert load["kv_capacity_bytes"] > 0 and 0 < load["kv_used_bytes"] <= load["kv_capacity_bytes"]
    finally:
        thread.join(300)
    assert result["finish_reason"] == "length"
    deadline = time.monotonic() + 30
    while fleet.instances()[decode_id]["load"]["active_requests"] != 0:
        assert time.monotonic() < deadline, "decode's load never went back to 0 active requests"
        time.sleep(0.2)


def test_unanswering_vllm_is_not_ready(fleet: Fleet, gateway: Service) -> None:
    """vLLM's API server stopped (SIGSTOP: /health no longer answers) takes the instance out of routing; it comes
    back once /health answers again."""
    prefill_id = fleet.agents["prefill"].instance_id
    assert fleet.prefill.process is not None
    os.kill(fleet.prefill.process.pid, signal.SIGSTOP)
    try:
        assert fleet.wait_state(prefill_id, {"starting", "dead"}) in {"starting", "dead"}
        fleet.wait_routable(gateway, instances=1)
    finally:
        os.kill(fleet.prefill.process.pid, signal.SIGCONT)
    fleet.wait_state(prefill_id, {"ready"})
    fleet.wait_routable(gateway, instances=2)


def test_sigterm_drains_then_deregisters(fleet: Fleet, gateway: Service) -> None:
    """SIGTERM during a long stream: the instance is draining at once (new requests find no decode: 503), the
    stream runs to its end, and only after its last tokens does the instance leave the scheduler; the agent
    exits 0. Registered again, the same vLLM serves again."""
    agent = fleet.agents["decode"]
    assert agent.process is not None
    thread, result, arrivals = in_background(gateway, LONG_TOKENS)
    try:
        agent.process.send_signal(signal.SIGTERM)
        fleet.wait_state(agent.instance_id, {"draining"}, timeout=10)
        fleet.wait_routable(gateway, instances=1)
        refused = httpx.post(
            gateway.url + "/v1/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2},
            timeout=30,
        )
        assert refused.status_code == 503, refused.text
        fleet.wait_state(agent.instance_id, {"absent"}, timeout=120)
        deregistered = time.monotonic()
    finally:
        thread.join(300)
    assert result == {"tokens": LONG_TOKENS, "finish_reason": "length"}
    nearly_done = next(at for at, tokens in arrivals if tokens >= LONG_TOKENS - 20)
    assert deregistered > nearly_done, "deregistered while vLLM was still generating"
    assert agent.process.wait(30) == 0
    assert "drained: vLLM has no running or waiting request" in agent.log()
    agent.start()  # the same vLLM, registered again, serves again
    fleet.wait_state(agent.instance_id, {"ready"})
    fleet.wait_routable(gateway, instances=2)
    assert stream_tokens(gateway, 4) == {"tokens": 4, "finish_reason": "length"}


def test_a_missing_instance_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "e1-0").mkdir()
    (tmp_path / "e1-0" / "instance.json").write_text(json.dumps({"role": "kv_producer", "fingerprint": "sha256:a"}))
    with pytest.raises(InstanceFileError, match=r"no instance\.json of a kv_consumer") as missing:
        find(tmp_path, "decode")
    assert str(tmp_path) in str(missing.value)
    (tmp_path / "e1-0" / "instance.json").write_text(
        json.dumps({"role": "kv_consumer", "kv_port": 0, "fingerprint": "sha256:a"})
    )
    with pytest.raises(InstanceFileError, match=r"instance\.json: kv_port: must be a port number"):
        find(tmp_path, "decode")


def test_an_unreadable_token_file_stops_the_agent_naming_it(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "agent",
            "--engine-url",
            "http://127.0.0.1:9",
            "--role",
            "decode",
            "--scheduler-url",
            "http://127.0.0.1:9",
            "--scheduler-token-file",
            str(tmp_path / "absent.token"),
            "--advertise-url",
            "http://127.0.0.1:9",
            "--version",
            "v1",
            "--connector-run-dir",
            str(tmp_path),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "scheduler_token_file" in done.stderr and "absent.token" in done.stderr
