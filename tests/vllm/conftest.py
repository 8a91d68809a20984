"""vLLM prefill and decode instances with PdstackConnector, started once per module (or per package) on loopback.

These tests run in vLLM's own environment (`make test-vllm`), not in the main suite (pyproject ignores this folder).
Each vLLM instance is three processes and takes 1-3 minutes to start on a 2-core machine, so a module starts one
prefill and one decode and every test of the module reuses them, and the packages fleet/ and pair/ share theirs
across their modules; at most two run at once (a shared pair waits idle while test_models starts its others).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Interface
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from pdserve.engine.testmodels import make_test_checkpoint
from pdserve.gateway.proxy import prefill_kv_transfer_params
from pdserve.kv import params as signed_params
from pdserve.kv.auth import SecretKey
from pdserve.vllm.consumer import VLLM_ADDED_FIELDS
from pdserve.vllm.release import MIDDLEWARE as RELEASE_MIDDLEWARE
from pdstack.local.wan import LinkProcess, LinkShape, create_namespace, default_endpoints, delete_namespace, run_ip
from tests.support.ports import free_port

# TP 2 puts four workers, two EngineCores and two API servers on 2 cores: there a KV frame sometimes stalls for
# more than 20 s (the CI rehearsal of 83cad20 failed 2 of its 5 tests that way), so it runs on request:
# `make test-vllm-tp` (PDSTACK_VLLM_TP=1), not in `make test`.
collect_ignore = [] if os.environ.get("PDSTACK_VLLM_TP") == "1" else ["test_tensor_parallel.py"]

START_TIMEOUT_S = 420
MAX_TOKENS = 16  # what test_connector and test_tensor_parallel generate per request
LEASE_SECONDS = 20
RELEASE = "vllm-test-1"  # the pair's kv_connector_extra_config.release_version, as pdstack's deploy sets it
BLOCK_SIZE = 32
# head_dim 64: vLLM's CPU attention has kernels for head sizes 32, 48, 64, ... only.
MODEL_CONFIG = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
}
# The same llama with a long context, for ~4K-token prompts in the tests and 8K in bench/vllm_ttft.py.
LONG_CONTEXT = 16384
LONG_MODEL_CONFIG = {**MODEL_CONFIG, "max_position_embeddings": LONG_CONTEXT}
DO_REMOTE_DECODE = prefill_kv_transfer_params()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_test_checkpoint(
        "dense", tmp_path_factory.mktemp("llama"), "float32", overrides=MODEL_CONFIG, vocab_size=512
    )


@pytest.fixture(scope="session")
def kv_key(kv_key_file: Path) -> SecretKey:
    return SecretKey.from_file(kv_key_file)


@dataclass(frozen=True)
class Site:
    """Where an instance runs: its network namespace (None: the test's own), the address its API server binds
    (reachable from the test process) and the address its KV listener binds and advertises."""

    netns: str | None = None
    http_host: str = "127.0.0.1"
    kv_host: str = "127.0.0.1"

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns] if self.netns else []


LOOPBACK = Site()


# Not a tests.support.process harness, on purpose: an instance is three processes (API server, EngineCore, worker)
# started in a session of their own and signalled as a group (os.killpg), given a minute to stop, and a start that
# fails is pytest.fail with the log's end; the other harnesses start and signal one process.
@dataclass
class VLLMServer:
    """One `python -m vllm.entrypoints.openai.api_server` with PdstackConnector, its log in a file."""

    name: str
    model: Path
    role: str
    core: int
    extra: dict[str, Any]
    log_path: Path
    args: tuple[str, ...] = ()
    policy: str = "recompute"
    max_model_len: int = 2048
    site: Site = LOOPBACK
    connector: bool = True
    """False: no --kv-transfer-config at all (role, policy and extra unused), a colocated baseline."""
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    verify: ssl.SSLContext | None = None
    """A client context for an API server started with --ssl-* in `args`: it is then reached over https."""

    @property
    def url(self) -> str:
        return f"{'https' if self.verify else 'http'}://{self.site.http_host}:{self.port}"

    def start(self) -> None:
        config = {
            "kv_connector": "PdstackConnector",
            "kv_connector_module_path": "pdserve.vllm.connector",
            "kv_role": self.role,
            "kv_load_failure_policy": self.policy,
            "kv_connector_extra_config": self.extra,
        }
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        # All three processes on `core`, not only the worker's OMP threads: the API server and EngineCore would
        # otherwise float onto the other instance's core (a decode waiting for remote KV steps without pause).
        command = [
            *self.site.exec_prefix(),
            "taskset",
            "-c",
            str(self.core),
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            self.site.http_host,
            "--port",
            str(self.port),
            "--enforce-eager",
            "--dtype",
            "float32",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(self.max_model_len),
            *(("--kv-transfer-config", json.dumps(config)) if self.connector else ()),
            "--enable-log-requests",
            *(("--middleware", RELEASE_MIDDLEWARE) if self.connector and self.role == "kv_producer" else ()),
            *self.args,
        ]
        with self.log_path.open("wb") as log:
            # Its own session, so stopping it reaches the EngineCore and worker processes it spawns.
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def wait_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"vLLM {self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2, verify=self.verify or True).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        pytest.fail(f"vLLM {self.name} not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def kill(self) -> None:
        """SIGKILL to the API server, its EngineCore and its worker at once (a crashed or lost host)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)

    def aborted(self) -> int:
        """How many requests vLLM aborted because their client went away (it logs them with --enable-log-requests)."""
        return self.log().count("Aborted request(s)")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def complete(self, prompt: list[int], max_tokens: int, *, timeout: float = 120, **extra: Any) -> dict[str, Any]:
        body = {
            "model": str(self.model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "ignore_eos": True,
            **extra,
        }
        response = httpx.post(self.url + "/v1/completions", json=body, timeout=timeout)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def chat(self, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
        body = {"model": str(self.model), "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
        response = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def chat_stream(self, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> str:
        """The content of a streamed chat completion, joined from its SSE chunks."""
        body = {
            "model": str(self.model),
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            **extra,
        }
        parts: list[str] = []
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:])["choices"]:
                        parts.append(choice["delta"].get("content") or "")
        return "".join(parts)

    def metric(self, name: str, having: str = "") -> float:
        """The sum of a metric over its label sets whose labels contain `having`, from the API server's /metrics."""
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and having in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_metric(self, name: str, expected: Callable[[float], bool], having: str = "") -> float:
        """The metric once `expected` holds (vLLM forwards connector stats with each engine step's output)."""
        deadline = time.monotonic() + 30
        while not expected(value := self.metric(name, having)):
            assert time.monotonic() < deadline, f"{self.name}: {name}{{{having}}} stayed at {value}"
            time.sleep(0.5)
        return value

    def wait_leases_gone(self) -> None:
        """Until this prefill holds no KV lease (earlier ones, another module's on a shared pair too, acked or
        expired). It steps the engine while it waits: the lease gauge travels with each engine step's stats, so an
        idle engine's stays at its last value."""
        deadline = time.monotonic() + LEASE_SECONDS + 30
        while (held := self.metric("pdserve_kv_lease_bytes")) != 0:
            assert time.monotonic() < deadline, f"{self.name}: KV leases of {held} bytes never ended"
            self.complete([5, 6, 7], 1)
            time.sleep(1)


@dataclass
class Pair:
    prefill: VLLMServer
    decode: VLLMServer
    kv_port: int
    key: SecretKey

    def prefill_params(self, prompt: list[int]) -> dict[str, Any]:
        """Prefill as vLLM's proxy does it: max_tokens 1 and do_remote_decode; returns its kv_transfer_params."""
        answer = self.prefill.complete(prompt, 1, kv_transfer_params=DO_REMOTE_DECODE)
        params = answer.get("kv_transfer_params")
        assert isinstance(params, dict), answer
        return params

    def resign(self, params: dict[str, Any], **changes: Any) -> dict[str, Any]:
        """Params as a prefill holding the key would have issued them with `changes` (a test stands in for one):
        signed with the params key derived from the KV channel key, as the connector signs them."""
        issued = {name: value for name, value in params.items() if name not in VLLM_ADDED_FIELDS}
        return signed_params.sign(signed_params.derive_params_key(self.key.material), {**issued, **changes})


def start_pair(
    model_dir: Path,
    kv_key_file: Path,
    kv_key: SecretKey,
    tmp_path_factory: pytest.TempPathFactory,
    policy: str,
    *,
    prefill_extra: dict[str, Any] | None = None,
    decode_extra: dict[str, Any] | None = None,
    max_model_len: int = 2048,
    batched_tokens: int = 256,
    sites: tuple[Site, Site] = (LOOPBACK, LOOPBACK),
) -> Iterator[Pair]:
    """A prefill on core 0 and a decode (with kv_load_failure_policy `policy`) on core 1, stopped at the end;
    `sites` places them (by default both on this namespace's loopback)."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    kv_port = free_port()
    common = {
        "kv_key_file": str(kv_key_file),
        "advertise_host": sites[0].kv_host,
        "kv_lease_seconds": LEASE_SECONDS,
        "kv_connect_timeout_seconds": 3,
        "kv_read_timeout_seconds": 5,
        "run_dir": str(logs / "run"),
        "release_version": RELEASE,
    }
    # Prefill computes at most `batched_tokens` tokens a step, so long prompts take several steps (chunked prefill).
    prefill_config = {**common, "kv_port": kv_port, **(prefill_extra or {})}
    prefill = VLLMServer(
        "prefill",
        model_dir,
        "kv_producer",
        0,
        prefill_config,
        logs / "prefill.log",
        args=("--max-num-batched-tokens", str(batched_tokens)),
        max_model_len=max_model_len,
        site=sites[0],
    )
    decode_config = {**common, **(decode_extra or {})}
    decode = VLLMServer(
        "decode",
        model_dir,
        "kv_consumer",
        1,
        decode_config,
        logs / "decode.log",
        policy=policy,
        max_model_len=max_model_len,
        site=sites[1],
    )
    yield from run_pair(prefill, decode, kv_port, kv_key)


def run_pair(prefill: VLLMServer, decode: VLLMServer, kv_port: int, kv_key: SecretKey) -> Iterator[Pair]:
    """Start both (at once), yield the pair once both are ready, stop both."""
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        yield Pair(prefill, decode, kv_port, kv_key)
    finally:
        prefill.stop()
        decode.stop()


class _ThreadedServer:
    """An asyncio TCP server on loopback in a daemon thread; counts the connections it accepts."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(asyncio.start_server(self._accept, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self.serve(reader, writer)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class SilentServer(_ThreadedServer):
    """Accepts KV connections and reads what comes, but never answers (a prefill host that hangs)."""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            pass
        writer.close()


class FlippingProxy(_ThreadedServer):
    """A TCP relay to a KV server that flips one byte of what the server sends, `flip_at` bytes into each
    connection's reply stream (when the reply is that long); it counts the connections it accepts."""

    def __init__(self, target_port: int, flip_at: int) -> None:
        super().__init__()
        self.target_port, self.flip_at, self.flipped = target_port, flip_at, 0

    async def serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(
            self._pipe(client_reader, server_writer, flip=False),
            self._pipe(server_reader, client_writer, flip=True),
            return_exceptions=True,
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, flip: bool) -> None:
        seen = 0
        try:
            while data := await reader.read(65536):
                if flip and seen <= self.flip_at < seen + len(data):
                    changed = bytearray(data)
                    changed[self.flip_at - seen] ^= 0x01
                    data = bytes(changed)
                    self.flipped += 1
                seen += len(data)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


class WanSites:
    """Two network namespaces joined by pdstack's emulated WAN link, each also joined to the test's namespace by
    a veth pair with no shaping (the way in for HTTP, as a gateway beside each datacenter would have): KV between
    the two crosses the link, nothing else does. A context manager; needs root, /dev/net/tun and iproute2.

    `sites` places a prefill in the first namespace and a decode in the second; `link_bytes()` reads the
    counters of the link's TUN devices."""

    def __init__(self, spec: LinkShape, tag: str = "", link_cpus: set[int] | None = None) -> None:
        """`link_cpus`: where the link's forwarder runs (a benchmark keeps it off the prefill's core)."""
        self.tag = tag or str(os.getpid() % 100000)
        self.link_cpus = link_cpus
        self.namespaces = (f"pdw-{self.tag}-p", f"pdw-{self.tag}-d")
        self.wan = default_endpoints(*self.namespaces)
        third = 10 + os.getpid() % 240
        self.veth = tuple(IPv4Interface(f"10.234.{third}.{4 * side + 2}/30") for side in (0, 1))
        self.sites = tuple(
            Site(ns, str(veth.ip), str(wan.address.ip))
            for ns, veth, wan in zip(self.namespaces, self.veth, self.wan, strict=True)
        )
        self.link = LinkProcess(*self.wan, spec)

    def __enter__(self) -> Self:
        try:
            for side, namespace in enumerate(self.namespaces):
                create_namespace(namespace)
                self._join_host(side, namespace)
            self.link.start()
            if self.link_cpus:
                os.sched_setaffinity(self.link.pid, self.link_cpus)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.link.stop()
        for namespace in self.namespaces:
            delete_namespace(namespace)  # takes its end of the veth pair, and with it the host's end

    def _join_host(self, side: int, namespace: str) -> None:
        host_end, ns_end = f"pdw{self.tag}{side}h", f"pdw{self.tag}{side}n"
        host_address = IPv4Interface(f"{self.veth[side].ip - 1}/30")
        run_ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        run_ip("link", "set", ns_end, "netns", namespace)
        run_ip("addr", "add", str(host_address), "dev", host_end)
        run_ip("link", "set", host_end, "up")
        run_ip("-n", namespace, "addr", "add", str(self.veth[side]), "dev", ns_end)
        run_ip("-n", namespace, "link", "set", ns_end, "up")

    def link_bytes(self) -> dict[str, int]:
        """Bytes the link carried so far: prefill to decode, and decode to prefill (the TUN devices' counters)."""
        sent = {
            ns: _device_counters(ns, endpoint.device)["tx_bytes"]
            for ns, endpoint in zip(self.namespaces, self.wan, strict=True)
        }
        return {"prefill_to_decode": sent[self.namespaces[0]], "decode_to_prefill": sent[self.namespaces[1]]}


def _device_counters(namespace: str, device: str) -> dict[str, int]:
    listing = subprocess.run(
        ["ip", "-n", namespace, "-s", "-j", "link", "show", device], capture_output=True, text=True, check=True
    ).stdout
    stats = json.loads(listing)[0]["stats64"]
    return {"tx_bytes": int(stats["tx"]["bytes"]), "rx_bytes": int(stats["rx"]["bytes"])}


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def token_ids(answer: dict[str, object]) -> list[int]:
    choices = answer["choices"]
    assert isinstance(choices, list)
    ids = choices[0]["token_ids"]
    assert isinstance(ids, list) and len(ids) == MAX_TOKENS, answer
    return ids


def loaded(pair: Pair, remote_request_id: str) -> bool:
    return f"({remote_request_id})" in pair.decode.log() and "pdstack connector: loaded" in pair.decode.log()


def failure_line(pair: Pair, answer: dict[str, object]) -> str:
    """The decode log's line on the refused or failed load of the request that gave `answer` (vLLM's request id
    inside the engine is the response id plus a suffix)."""
    marker = f"for request {answer['id']}-"
    lines = [line for line in pair.decode.log().splitlines() if marker in line and "pdstack connector" in line]
    assert lines, f"no log line for {answer['id']}:\n" + pair.decode.log_tail()
    assert "left to kv_load_failure_policy" in lines[-1], lines
    return lines[-1]
