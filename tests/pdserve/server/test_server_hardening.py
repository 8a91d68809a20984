"""Issue 13 on real sockets: no request leaks capacity, steers decode's KV pulls, or reaches a server without the
API token; what the engine cannot honour or represent is refused by name."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from pdserve.engine import Engine
from pdserve.scheduler.protocol import ENGINE_OPTIONAL_PARAMS
from pdserve.server import ServerSettings, create_app
from tests.support.ports import free_port
from tests.support.serverproc import AUTH, ServerProcess, api_token_file, metric_value, prefill

from .conftest import Deployment

PROMPT = "a request that fails after admission gives its slot back"
SIGNATURE = "kv_transfer_params.pdstack_signature"


def post_raw(server: ServerProcess, content: str | bytes, endpoint: str = "/v1/completions") -> httpx.Response:
    return httpx.post(
        server.url + endpoint, content=content, timeout=60, headers={"content-type": "application/json", **AUTH}
    )


def assert_nothing_reserved(server: ServerProcess) -> None:
    text = server.metrics()
    assert metric_value(text, "pdserve_admitted_requests") == 0
    assert metric_value(text, "pdserve_kv_memory_reserved_bytes") == 0


def wait_until_nothing_reserved(metrics: Callable[[], str]) -> None:
    """Requests whose client left end on the server a little later; wait (bounded) for their slots to return."""
    for _ in range(300):
        text = metrics()
        if (
            metric_value(text, "pdserve_admitted_requests") == 0
            and metric_value(text, "pdserve_kv_memory_reserved_bytes") == 0
        ):
            return
        threading.Event().wait(0.1)
    pytest.fail(f"slots still held: {[line for line in text.splitlines() if 'admitted' in line]}")


@pytest.fixture(scope="module")
def small(dense_checkpoint: Path, spawn: Callable[..., ServerProcess]) -> ServerProcess:
    """A colocated server with two slots, so any leak shows within a few requests."""
    return spawn("colocated", dense_checkpoint, "--max-num-seqs", "2")


# -- finding 1: admission slots ---------------------------------------------------------------------------------------


def test_negative_seeds_never_leak_a_slot(small: ServerProcess) -> None:
    for _ in range(2 + 5):
        refused = small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": -1})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "seed"
    too_big = small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": 2**63})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "seed"
    largest = small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "seed": 2**63 - 1})
    assert largest.status_code == 200, largest.text
    assert small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert_nothing_reserved(small)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"prompt": "x", "temperature": NaN}', "temperature"),
        ('{"prompt": "x", "top_p": Infinity}', "top_p"),
        ('{"prompt": "x", "seed": 1e999}', "seed"),
        ('{"prompt": "x", "frequency_penalty": -Infinity}', "frequency_penalty"),
        ('{"prompt": "\\ud800 lone surrogate"}', "prompt"),
        ('{"prompt": "x", "stop": ' + "[" * 40 + "]" * 40 + "}", None),
        ('{"prompt": "x", "stop": ' + "[" * 100000 + "]" * 100000 + "}", "body"),
    ],
)
def test_unrepresentable_values_get_400_naming_the_field(small: ServerProcess, body: str, param: str | None) -> None:
    before = metric_value(small.metrics(), "pdserve_requests_total", {"endpoint": "/v1/completions", "status": "400"})
    response = post_raw(small, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param and param in error["message"]
    after = metric_value(small.metrics(), "pdserve_requests_total", {"endpoint": "/v1/completions", "status": "400"})
    assert after == before + 1
    assert_nothing_reserved(small)


def test_lone_surrogate_in_a_chat_message_names_it(small: ServerProcess) -> None:
    response = post_raw(small, '{"messages": [{"role": "user", "content": "\\udfff"}]}', "/v1/chat/completions")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages[0].content"


def test_streams_whose_client_left_before_streaming_give_their_slot_back(small: ServerProcess) -> None:
    """A client that is gone before its stream starts: the response is cancelled before its body iterator runs."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    for _ in range(2 + 5):
        with socket.create_connection(("127.0.0.1", small.port), timeout=30) as sock:
            sock.sendall(head + body)
            sock.shutdown(socket.SHUT_WR)
    wait_until_nothing_reserved(small.metrics)
    assert small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def in_process(dense_checkpoint: Path) -> Iterator[str]:
    """A colocated server in this process (real sockets), so a test can make the engine fail after admission."""
    settings = ServerSettings(role="colocated", model=dense_checkpoint, port=free_port(), max_num_seqs=2)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=settings.port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        for _ in range(1200):
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            threading.Event().wait(0.1)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_failure_after_admission_gives_the_slot_back(in_process: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mechanism behind finding 1: whatever raises after the reservation (here the engine setting a request up,
    where seed -1 used to raise) releases it."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("engine cannot set this request up")

    monkeypatch.setattr(Engine, "new_request", broken)
    for _ in range(2 + 5):
        failed = httpx.post(in_process + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "internal_error"
    monkeypatch.undo()
    assert (
        httpx.post(in_process + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60).status_code
        == 200
    )
    wait_until_nothing_reserved(lambda: httpx.get(in_process + "/metrics").text)


# -- contract §4: what the engine does not honour ----------------------------------------------------------------------

UNHONOURED: dict[str, Any] = {
    "best_of": 2,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "response_format": {"type": "json_object"},
    "logit_bias": {"42": 5},
    "repetition_penalty": 1.2,
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": "g",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "parallel_tool_calls": False,
    "presence_penalty": 0.5,
    "frequency_penalty": -1.0,
    "suffix": "and so on",
}


def test_every_unhonoured_param_is_refused_by_name(small: ServerProcess) -> None:
    assert set(UNHONOURED) == set(ENGINE_OPTIONAL_PARAMS)
    for name, value in UNHONOURED.items():
        response = small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, name: value})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name
    for name, value in (("top_logprobs", 3), ("logprobs", 2), ("echo", True)):  # vLLM honours them, pdserve refuses
        response = small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, name: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == name, (name, response.text)
    for body in ("null", "[]", "123", '"text"'):
        response = post_raw(small, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "body", (body, response.text)
    neutral = {
        "best_of": 1,
        "repetition_penalty": 1.0,
        "tools": None,
        "logit_bias": {},
        "tool_choice": "none",
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "suffix": "",
        "top_logprobs": 0,
    }
    assert small.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, **neutral}).status_code == 200
    assert_nothing_reserved(small)


def test_models_report_the_context_length(dense: Deployment) -> None:
    for server in (dense.colocated, dense.prefill, dense.decode):
        entry = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]
        assert entry["max_model_len"] == 512


# -- contract §2: the API token ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_pd_servers_serve_only_token_holders(dense: Deployment, role: str) -> None:
    server: ServerProcess = getattr(dense, role)
    body = {"prompt": PROMPT, "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": AUTH["Authorization"] + "x"}):
        for method, path in (
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"),
            ("GET", "/not-a-route"),
        ):
            response = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (method, path, response.text)
            assert response.json()["error"]["type"] == "authentication_error"
    for probe in ("/health", "/health/live", "/health/ready", "/metrics"):
        assert httpx.get(server.url + probe, timeout=30).status_code == 200, probe
    assert (
        metric_value(server.metrics(), "pdserve_requests_total", {"endpoint": "/v1/completions", "status": "401"}) >= 3
    )
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200


def test_401_is_decided_before_the_body_is_read(dense: Deployment) -> None:
    """Headers announcing 8 MB that never come: the answer is 401 at once, not a wait for the body."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: 8000000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", dense.decode.port), timeout=30) as sock:
        sock.sendall(head + b'{"prompt": "')
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]


def test_pd_servers_do_not_start_without_a_token(tmp_path: Path, kv_key_file: Path) -> None:
    def run(role: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                role,
                "--model",
                str(tmp_path),
                "--kv-key-file",
                str(kv_key_file),
                "--port",
                str(free_port()),
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )

    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    for role in ("prefill", "decode"):
        missing = run(role)
        assert missing.returncode != 0 and "api_token_file" in missing.stderr
        blank = run(role, "--api-token-file", str(empty))
        assert blank.returncode != 0 and "api_token_file" in blank.stderr and "empty" in blank.stderr


def test_colocated_takes_an_optional_token(dense: Deployment, spawn: Callable[..., ServerProcess]) -> None:
    guarded = spawn("colocated", dense.model, "--api-token-file", str(api_token_file()))
    body = {"prompt": PROMPT, "max_tokens": 2}
    assert httpx.post(guarded.url + "/v1/completions", json=body, timeout=60).status_code == 401
    assert guarded.post("/v1/completions", body).status_code == 200
    assert httpx.post(dense.colocated.url + "/v1/completions", json=body, timeout=60).status_code == 200


def test_health_is_200_once_ready_and_503_before(
    dense: Deployment, tmp_path: Path, spawn: Callable[..., ServerProcess]
) -> None:
    assert httpx.get(dense.decode.url + "/health").status_code == 200
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    server = spawn("colocated", broken, ready=False)
    for _ in range(600):
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(server.url + "/health/live").status_code == 200:
                break
        threading.Event().wait(0.1)
    assert httpx.get(server.url + "/health").status_code == 503


# -- contract §3 / finding 2: decode pulls only from where a prefill server said ---------------------------------------


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A loopback listener nothing should ever connect to; connections complete in its backlog unaccepted."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.setblocking(False)
    yield listener
    listener.close()


def connections_to(listener: socket.socket) -> int:
    count = 0
    while True:
        try:
            accepted, _ = listener.accept()
        except BlockingIOError:
            return count
        accepted.close()
        count += 1


def test_decode_never_connects_where_unsigned_or_edited_params_point(dense: Deployment, trap: socket.socket) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    prompt_tokens = len(dense.colocated.post("/v1/completions", body).json()["choices"][0]["prompt_token_ids"])
    port = trap.getsockname()[1]
    genuine = prefill(dense.prefill.url, body)
    unsigned = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "attacker",
        "remote_request_id": "r-1",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [],
        "kv_checksum": "0" * 64,
        "kv_fingerprint": dense.decode.ready_info()["fingerprint"],
        "num_tokens": prompt_tokens,
    }
    attempts = {
        "unsigned": unsigned,
        "forged": {**unsigned, "pdstack_signature": "ab" * 32},
        "signature of other params": {**unsigned, "pdstack_signature": genuine["pdstack_signature"]},
        "replayed, port edited": {**genuine, "remote_port": port},
        "replayed, host and port edited": {**genuine, "remote_host": "localhost", "remote_port": port},
    }
    for name, params in attempts.items():
        response = dense.decode.post("/v1/completions", {**body, "kv_transfer_params": params})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == SIGNATURE, name
    assert connections_to(trap) == 0
    # the genuine params still work, once
    assert dense.decode.post("/v1/completions", {**body, "kv_transfer_params": genuine}).status_code == 200
    assert_nothing_reserved(dense.decode)


def test_prefill_signs_the_params_it_returns(dense: Deployment) -> None:
    params = prefill(dense.prefill.url, {"prompt": PROMPT, "max_tokens": 3})
    assert isinstance(params["pdstack_signature"], str) and len(params["pdstack_signature"]) == 64


def test_other_bad_kv_fields_are_named(dense: Deployment) -> None:
    params = {**prefill(dense.prefill.url, {"prompt": PROMPT, "max_tokens": 3}), "remote_port": 70000}
    response = dense.decode.post("/v1/completions", {"prompt": PROMPT, "kv_transfer_params": params})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params.remote_port"
