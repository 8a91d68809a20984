"""A KV server process kept off the CPU for longer than decode's read timeout is alive, and its pull completes.

This is the stall tests/vllm/test_tensor_parallel.py met on 2 shared cores: prefill's KV threads, pinned to their
rank's core beside its forward, sat runnable in the run queue for seconds (measured 4-9 s of run-queue wait in a
0.1 s sleep, KEEPALIVEs 13 s apart against keepalive_s 1), so decode saw no frame for its read timeout and gave up
although both ends were alive. Here the server process is stopped (SIGSTOP: the extreme of being kept off the CPU;
its kernel still acknowledges TCP, as a busy host's does) mid-handshake or mid-transfer for several read timeouts,
then continued. The pull must succeed with every byte verified, and still end, cause `timeout`, when the silence
outlasts stall_timeout_s.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from pdserve.kv import KVTransferError, SecretKey, pull

from .kvtestlib import proxy_to, server_process

READ_TIMEOUT_S = 0.5
STOPPED_S = 5 * READ_TIMEOUT_S  # the server gets no CPU for five read timeouts
OPTIONS = {"connect_timeout_s": 2.0, "read_timeout_s": READ_TIMEOUT_S, "retries": 0, "stall_timeout_s": 20.0}
GUARD_S = 60  # guards against a hang only


def stop_for(process: subprocess.Popen[str], seconds: float) -> None:
    """Stop the process now and continue it `seconds` later (from a timer thread)."""
    os.kill(process.pid, signal.SIGSTOP)
    threading.Timer(seconds, resume, (process,)).start()


def resume(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the test already ended and killed it
        os.kill(process.pid, signal.SIGCONT)


def digest(layers: list[tuple[object, object]]) -> str:
    sha = hashlib.sha256()
    for pair in layers:
        for array in pair:
            sha.update(memoryview(array).cast("B"))  # type: ignore[arg-type]
    return sha.hexdigest()


def test_a_pull_outlasts_a_server_stopped_during_its_handshake(kv_key_file: Path, key: SecretKey) -> None:
    with server_process(kv_key_file, "req-stopped", 4) as (process, port, checksum):

        async def scenario() -> None:
            stop_for(process, STOPPED_S)  # the pull connects (the kernel accepts) and waits for CHALLENGE
            async with asyncio.timeout(GUARD_S):
                blob = await pull("127.0.0.1", port, "req-stopped", checksum, key=key, streams=2, **OPTIONS)
            assert blob.meta.request_id == "req-stopped"
            again = await pull("127.0.0.1", port, "req-stopped", checksum, key=key, streams=1, **OPTIONS)
            assert digest(blob.layers) == digest(again.layers)

        asyncio.run(scenario())


def test_a_pull_outlasts_a_server_stopped_mid_transfer(kv_key_file: Path, key: SecretKey) -> None:
    """The pull's checksum (sha256 over the BLAKE3 unit digests, all verified) is the one the server computed."""
    with server_process(kv_key_file, "req-mid", 16) as (process, port, checksum):
        stopped: list[bool] = []

        def stop_after_the_first_mebibyte(forwarded: int) -> None:
            if forwarded > 1 << 20 and not stopped:
                stopped.append(True)
                stop_for(process, STOPPED_S)

        async def scenario() -> None:
            # A slow link, so the stop lands mid-transfer; the proxy's own TCP keeps answering, as a busy host's does.
            async with proxy_to(port, bytes_per_second=16e6, on_forward=stop_after_the_first_mebibyte) as proxy:
                async with asyncio.timeout(GUARD_S):
                    blob = await pull("127.0.0.1", proxy.port, "req-mid", checksum, key=key, streams=2, **OPTIONS)
                assert stopped and proxy.forwarded > 16 << 20
            assert blob.meta.request_id == "req-mid"

        asyncio.run(scenario())


def test_a_silence_past_stall_timeout_still_ends_the_pull_with_timeout(kv_key_file: Path, key: SecretKey) -> None:
    with server_process(kv_key_file, "req-gone", 1) as (process, port, checksum):

        async def scenario() -> None:
            os.kill(process.pid, signal.SIGSTOP)  # never continued: killed when the test ends
            with pytest.raises(KVTransferError) as raised:
                async with asyncio.timeout(GUARD_S):
                    await pull("127.0.0.1", port, "req-gone", checksum, key=key, **{**OPTIONS, "stall_timeout_s": 1.5})
            assert raised.value.cause == "timeout"
            assert "stall_timeout_s" in raised.value.message

        asyncio.run(scenario())
