"""The OpenAI-compatible surface: validation, streaming, the official client, limits, health and metrics."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.serverproc import API_TOKEN, AUTH, ServerProcess, metric_value, prefill

from .conftest import Deployment

PROMPT = "a request joins the running batch and leaves it when done"


def post(url: str, body: Any, endpoint: str = "/v1/completions") -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + endpoint, content=content, headers={"content-type": "application/json", **AUTH}, timeout=60)


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        ("{not json", 400, "not valid JSON"),
        ({"prompt": PROMPT, "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": "word " * 700, "max_tokens": 4}, 400, "context length"),
        ({"prompt": PROMPT, "max_tokens": 600}, 400, "max_tokens"),
        ({"max_tokens": 4}, 400, "prompt"),
        ({"prompt": PROMPT, "n": 2}, 400, "n:"),
        ({"prompt": PROMPT, "temperature": -1}, 400, "temperature"),
        ({"prompt": [99999]}, 400, "prompt: token id 99999"),
        ({"prompt": PROMPT, "model": "some-other-model"}, 404, "model"),
        ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}}, 400, "do_remote_decode"),
        ([1, 2, 3], 400, "JSON object"),
        ({"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ],
)
def test_malformed_requests_get_a_clear_error(dense: Deployment, body: Any, status: int, names: str) -> None:
    response = post(dense.colocated.url, body)
    assert response.status_code == status, response.text
    assert names in response.json()["error"]["message"]


def test_min_tokens_is_honoured_as_vllm_does(dense: Deployment) -> None:
    """vLLM's proxies (vllm-router among them) send min_tokens; the first min_tokens tokens never end the request."""
    body = {"prompt": PROMPT, "max_tokens": 6, "min_tokens": 6, "temperature": 0}
    answer = post(dense.colocated.url, body).json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 6


def test_chat_without_messages_names_the_field(dense: Deployment) -> None:
    response = post(dense.colocated.url, {"messages": []}, "/v1/chat/completions")
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"


def test_decode_refuses_kv_params_missing_remote_fields(dense: Deployment) -> None:
    """As vLLM's decode: no remote_engine_id/remote_request_id/remote_host/remote_port, no transfer."""
    params = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_request_id": "r"}
    response = post(dense.decode.url, {"prompt": PROMPT, "kv_transfer_params": params})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "remote_host" in message and "remote_port" in message


def test_a_request_transfers_at_most_once(dense: Deployment) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
    params = prefill(dense.prefill.url, body)
    assert post(dense.decode.url, {**body, "kv_transfer_params": params}).status_code == 200
    again = post(dense.decode.url, {**body, "kv_transfer_params": params})
    assert again.status_code == 409
    assert "at most once" in again.json()["error"]["message"]


def sse_events(response: httpx.Response) -> Iterator[Any]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def test_streaming_equals_non_streaming(dense: Deployment) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = post(dense.colocated.url, body).json()
    with httpx.stream(
        "POST",
        dense.colocated.url + "/v1/completions",
        timeout=60,
        headers=AUTH,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"] == whole["usage"]


def test_official_openai_client_against_pd(dense: Deployment) -> None:
    """The openai client speaks to prefill then decode (kv_transfer_params via extra_body), sync and streaming."""
    prefill_client = openai.OpenAI(base_url=dense.prefill.url + "/v1", api_key=API_TOKEN)
    decode_client = openai.OpenAI(base_url=dense.decode.url + "/v1", api_key=API_TOKEN)
    colocated = openai.OpenAI(base_url=dense.colocated.url + "/v1", api_key=API_TOKEN)
    messages: list[Any] = [{"role": "user", "content": "tell me about caches"}]
    model = colocated.models.list().data[0].id
    expected = colocated.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    for stream in (False, True):
        first = prefill_client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=1,
            temperature=0,
            extra_body={"kv_transfer_params": {"do_remote_decode": True}},
        )
        params = (first.model_extra or {})["kv_transfer_params"]
        if stream:
            pieces = decode_client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=8,
                temperature=0,
                stream=True,
                extra_body={"kv_transfer_params": params},
            )
            text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
        else:
            answer = decode_client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=8,
                temperature=0,
                extra_body={"kv_transfer_params": params},
            )
            text = answer.choices[0].message.content or ""
        assert text == expected.choices[0].message.content


def test_continuous_batching_gives_each_request_its_own_output(dense: Deployment) -> None:
    """Requests of different lengths run concurrently (joining and leaving the batch); each gets what it gets alone."""
    bodies = [
        {
            "prompt": PROMPT * (1 + i % 3),
            "max_tokens": 40 + 10 * i,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        for i in range(6)
    ]
    alone = [post(dense.colocated.url, body).json()["choices"][0]["token_ids"] for body in bodies]
    batched_before = _multi_sequence_steps(dense.colocated)
    start = threading.Barrier(len(bodies))  # sent together, so they overlap however slow the client threads are

    def together_with_the_others(body: dict[str, Any]) -> list[int]:
        start.wait()
        token_ids: list[int] = post(dense.colocated.url, body).json()["choices"][0]["token_ids"]
        return token_ids

    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(together_with_the_others, bodies))
    assert together == alone
    assert _multi_sequence_steps(dense.colocated) > batched_before


def _multi_sequence_steps(server: ServerProcess) -> float:
    text = server.metrics()
    return metric_value(text, "pdserve_step_batch_size_count") - metric_value(
        text, "pdserve_step_batch_size_bucket", {"le": "1.0"}
    )


def test_concurrency_limit_answers_429_and_frees_on_disconnect(
    make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess]
) -> None:
    # A long context, so the slot stays taken for seconds however slow the machine: the holder leaves when done.
    long_context = make_checkpoint("dense", overrides={"max_position_embeddings": 8192})
    single = spawn("colocated", long_context, "--max-num-seqs", "1")
    streaming = threading.Event()
    done = threading.Event()

    def hold_a_slot() -> None:
        body = {"prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", single.url + "/v1/completions", json=body, timeout=60, headers=AUTH) as response:
            for _ in response.iter_lines():
                streaming.set()
                if done.is_set():
                    break  # disconnect mid-stream

    holder = threading.Thread(target=hold_a_slot)
    holder.start()
    assert streaming.wait(30)
    refused = post(single.url, {"prompt": PROMPT, "max_tokens": 2})
    done.set()
    holder.join(30)
    assert refused.status_code == 429
    assert "server busy" in refused.json()["error"]["message"]
    assert metric_value(single.metrics(), "pdserve_requests_rejected_total", {"reason": "concurrency"}) == 1
    for _ in range(50):  # the abandoned request is cancelled and its slot freed
        if post(single.url, {"prompt": PROMPT, "max_tokens": 2}).status_code == 200:
            break
    else:
        pytest.fail("the slot of a disconnected client was never freed")


def test_non_streaming_request_is_cancelled_when_the_client_leaves(
    make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess]
) -> None:
    long_context = make_checkpoint("dense", overrides={"max_position_embeddings": 8192})
    single = spawn("colocated", long_context, "--max-num-seqs", "1")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            single.url + "/v1/completions",
            timeout=1.0,
            headers=AUTH,
            json={"prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True},
        )
    for _ in range(100):  # without cancellation the slot stays taken for all 8000 tokens
        answer = post(single.url, {"prompt": PROMPT, "max_tokens": 2})
        if answer.status_code == 200:
            break
        threading.Event().wait(0.1)
    assert answer.status_code == 200
    assert metric_value(single.metrics(), "pdserve_generation_tokens_total") < 8000


def test_kv_memory_limit_answers_503(dense: Deployment, spawn: Callable[..., ServerProcess]) -> None:
    small = spawn("colocated", dense.model, "--kv-memory-bytes", "50000")
    assert post(small.url, {"prompt": PROMPT, "max_tokens": 4}).status_code == 200
    refused = post(small.url, {"prompt": PROMPT, "max_tokens": 200})
    assert refused.status_code == 503
    assert "KV memory full" in refused.json()["error"]["message"]


def test_ready_only_once_the_model_is_loaded(tmp_path: Path, spawn: Callable[..., ServerProcess]) -> None:
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    server = spawn("colocated", broken, ready=False)
    for _ in range(600):  # up to 60 s: interpreter start-up crawls on a loaded machine
        try:
            if httpx.get(server.url + "/health/live").status_code == 200:
                break
        except httpx.TransportError:
            pass
        threading.Event().wait(0.1)
    assert httpx.get(server.url + "/health/live").status_code == 200
    ready = httpx.get(server.url + "/health/ready")
    assert ready.status_code == 503
    assert post(server.url, {"prompt": PROMPT}).status_code == 503


def test_the_open_readiness_probe_says_ready_and_nothing_more(dense: Deployment) -> None:
    """/health/ready answers without a token, so it names no KV port, engine id or model (issue #33): the scheduler
    registration carries what peers need, and the server's "ready" log line the rest."""
    for server in (dense.prefill, dense.decode, dense.colocated):
        ready = httpx.get(server.url + "/health/ready")
        assert (ready.status_code, ready.json()) == (200, {"status": "ready"})
    logged = dense.prefill.ready_info()
    assert logged["kv_port"] and logged["engine_id"]


def test_prefill_listens_for_kv_only_on_the_address_it_tells_decode_to_pull_from(dense: Deployment) -> None:
    """The KV listener binds the advertised host (here 127.0.0.1), not every address of the machine."""
    port = int(str(dense.prefill.ready_info()["kv_port"]))
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5)


def test_models_endpoint(dense: Deployment) -> None:
    listing = httpx.get(dense.decode.url + "/v1/models", headers=AUTH).json()
    assert listing["object"] == "list"
    assert listing["data"][0]["max_model_len"] == 512


def test_request_id_is_echoed(dense: Deployment) -> None:
    response = httpx.post(
        dense.colocated.url + "/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers={"X-Request-Id": "req-1234", **AUTH},
    )
    assert response.headers["x-request-id"] == "req-1234"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_metrics_pass_promtool(dense: Deployment) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    post(dense.decode.url, {**body, "kv_transfer_params": prefill(dense.prefill.url, body)})
    for server in (dense.colocated, dense.prefill, dense.decode):
        text = server.metrics()
        assert "pdserve_time_to_first_token_seconds_bucket" in text
        checked = subprocess.run(
            ["promtool", "check", "metrics"], input=text.encode(), capture_output=True, check=False
        )
        assert checked.returncode == 0, (server.role, checked.stdout.decode() + checked.stderr.decode())


def test_environment_variables_configure_the_server(dense: Deployment, spawn: Callable[..., ServerProcess]) -> None:
    env_only = spawn(
        "colocated",
        dense.model,
        env={"PDSERVE_SERVED_MODEL_NAME": "from-env", "PDSERVE_MAX_NUM_SEQS": "not-a-number"},
        ready=False,
    )
    assert env_only.process is not None and env_only.process.wait(30) != 0
    assert "max_num_seqs" in env_only.log_tail()
    named = spawn("colocated", dense.model, env={"PDSERVE_SERVED_MODEL_NAME": "from-env"})
    assert httpx.get(named.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "from-env"


def test_cli_errors_are_clear() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, check=False)

    unknown = run("bogus")
    assert unknown.returncode != 0 and "unknown role 'bogus'" in unknown.stderr
    no_key = run("prefill", "--model", "/nonexistent")
    assert no_key.returncode != 0 and "kv_key_file" in no_key.stderr
    no_model = run("colocated")
    assert no_model.returncode != 0 and "model: Field required" in no_model.stderr
    no_token = run("colocated", "--model", "/nonexistent", "--scheduler-url", "http://127.0.0.1:9")
    assert no_token.returncode != 0 and "scheduler_token_file" in no_token.stderr
