"""The gauges routers read (queue depth and KV-cache usage, as vLLM's): real servers, real load, real cancellations.

An endpoint picker schedules on pdserve_num_requests_waiting and pdserve_kv_cache_usage_ratio; a gauge that stuck
above zero after a cancelled or failed request would steer traffic away from an idle server for ever.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.serverproc import AUTH, ServerProcess, metric_value, prefill

from .test_server_faults import resigned

LONG_PROMPT = " ".join(f"token{i}" for i in range(400))  # 2291 tokens of the test tokenizer
WAITING = "pdserve_num_requests_waiting"
USAGE = "pdserve_kv_cache_usage_ratio"


@dataclass
class Sample:
    text: str
    waiting: float
    usage: float
    admitted: float
    reserved: float
    limit: float


def sample(server: ServerProcess) -> Sample:
    text = server.metrics()
    return Sample(
        text,
        *(
            metric_value(text, name)
            for name in (
                WAITING,
                USAGE,
                "pdserve_admitted_requests",
                "pdserve_kv_memory_reserved_bytes",
                "pdserve_kv_memory_limit_bytes",
            )
        ),
    )


def wait_for_baseline(server: ServerProcess, timeout: float = 60.0) -> Sample:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = sample(server)
        if seen.admitted == 0:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"requests still admitted after {timeout} s: {sample(server)}")


def in_threads(calls: list[Callable[[], Any]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=call, daemon=True) for call in calls]
    for thread in threads:
        thread.start()
    return threads


def promtool_problems(text: str) -> str:
    checked = subprocess.run(["promtool", "check", "metrics"], input=text.encode(), capture_output=True, check=False)
    return "" if checked.returncode == 0 else checked.stdout.decode() + checked.stderr.decode()


@pytest.fixture(scope="module")
def chunked(make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess]) -> ServerProcess:
    """A colocated server feeding one 16-token prompt chunk per step: concurrent long prompts queue behind the
    oldest, as requests queue in vLLM's waiting list."""
    long_context = make_checkpoint("dense", overrides={"max_position_embeddings": 8192})
    return spawn("colocated", long_context, "--prefill-token-budget", "16", "--max-num-seqs", "16")


def test_gauges_are_exported_at_zero_when_idle(chunked: ServerProcess) -> None:
    text = chunked.metrics()
    assert f"# TYPE {WAITING} gauge" in text and f"# TYPE {USAGE} gauge" in text
    assert (metric_value(text, WAITING), metric_value(text, USAGE)) == (0.0, 0.0)


def test_gauges_move_with_load_and_return_to_baseline(chunked: ServerProcess) -> None:
    answers: list[int] = []

    def complete() -> None:
        answer = httpx.post(
            chunked.url + "/v1/completions",
            headers=AUTH,
            timeout=120,
            json={"prompt": LONG_PROMPT, "max_tokens": 16, "ignore_eos": True},
        )
        answers.append(answer.status_code)

    threads = in_threads([complete] * 6)
    samples: list[Sample] = []
    while any(thread.is_alive() for thread in threads):
        samples.append(sample(chunked))
        time.sleep(0.01)
    assert answers == [200] * 6
    busiest = max(samples, key=lambda s: s.waiting)
    assert busiest.waiting >= 2, "six long prompts at one chunk per step: several must wait"
    assert all(s.waiting <= s.admitted for s in samples)
    assert all(s.usage == pytest.approx(s.reserved / s.limit) for s in samples)
    assert max(s.usage for s in samples) > 0
    assert promtool_problems(busiest.text) == ""
    after = wait_for_baseline(chunked)
    assert (after.waiting, after.usage) == (0.0, 0.0)


def test_cancelled_requests_leave_no_gauge_behind(chunked: ServerProcess) -> None:
    """Streams dropped mid-generation and non-streaming clients that time out while their request still waits."""
    streaming = threading.Barrier(4, timeout=60)
    leave = threading.Event()

    def stream_then_drop() -> None:
        body = {"prompt": LONG_PROMPT, "max_tokens": 5000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", chunked.url + "/v1/completions", json=body, timeout=120, headers=AUTH) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()  # held: a dropped iterator would close the connection now
            next(lines)
            streaming.wait()
            leave.wait(60)

    def give_up_while_waiting() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(
                chunked.url + "/v1/completions",
                headers=AUTH,
                timeout=0.5,
                json={"prompt": LONG_PROMPT, "max_tokens": 5000, "ignore_eos": True},
            )

    streams = in_threads([stream_then_drop] * 3)
    streaming.wait()  # three streams are generating
    impatient = in_threads([give_up_while_waiting] * 3)
    loaded = sample(chunked)
    while loaded.admitted < 6 and any(thread.is_alive() for thread in impatient):
        loaded = sample(chunked)
    leave.set()
    for thread in [*streams, *impatient]:
        thread.join(60)
    assert loaded.admitted == 6 and loaded.waiting >= 2 and loaded.usage > 0
    after = wait_for_baseline(chunked)
    assert (after.waiting, after.usage, after.reserved) == (0.0, 0.0, 0.0)


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port that accepts connections and never answers: a KV pull to it hangs until decode's read timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    for connection in accepted:
        connection.close()
    listener.close()


def test_a_failed_kv_pull_counts_as_waiting_then_returns_to_baseline(
    make_checkpoint: Callable[..., Path], spawn: Callable[..., ServerProcess], kv_key_file: Path, black_hole: int
) -> None:
    model = make_checkpoint("dense")
    prefill_server = spawn("prefill", model)
    decode_server = spawn("decode", model, "--kv-load-failure-policy", "fail", "--kv-read-timeout-seconds", "0.5")
    body = {"prompt": LONG_PROMPT[:600], "max_tokens": 4}
    params = resigned(prefill(prefill_server.url, body), kv_key_file, remote_port=black_hole)
    answers: list[httpx.Response] = []
    pulling = in_threads(
        [lambda: answers.append(decode_server.post("/v1/completions", {**body, "kv_transfer_params": params}))]
    )[0]
    seen: list[Sample] = []
    while pulling.is_alive():
        seen.append(sample(decode_server))
        time.sleep(0.02)
    assert answers[0].status_code == 502, answers[0].text
    assert any(s.waiting == 1 and s.usage > 0 for s in seen), "a request pulling its KV waits, as in vLLM"
    after = wait_for_baseline(decode_server)
    assert (after.waiting, after.usage) == (0.0, 0.0)
    assert promtool_problems(after.text) == ""
