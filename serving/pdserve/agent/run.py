"""The agent's life: wait for vLLM and its connector, register, heartbeat vLLM's load, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time

from pdserve.common import tls
from pdserve.scheduler.client import drain, read_token, run_heartbeats
from pdserve.scheduler.protocol import InstanceInfo, InstanceLoad

from .engine import Engine, EngineError
from .instance import ConnectorInstance, InstanceFileError, find
from .settings import AgentSettings

log = logging.getLogger("pdserve.agent")
# ENGINE_OPTIONAL_PARAMS that vLLM's /v1/completions and /v1/chat/completions both honour and that only shape
# sampling, so a P/D split serves them as a colocated vLLM would (tools and response_format need server flags and
# a structured-output backend this agent cannot see).
VLLM_SUPPORTED_PARAMS = ["logit_bias", "repetition_penalty", "presence_penalty", "frequency_penalty"]


class Agent:
    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.instance_id = settings.registered_id()
        self.token = read_token(settings.scheduler_token_file, "scheduler_token_file")
        engine_token = None
        if settings.engine_token_file is not None:
            engine_token = read_token(settings.engine_token_file, "engine_token_file")
        self.tls = tls.client_context(settings)  # vLLM's API server and the scheduler, when https
        self.engine = Engine(settings.engine_url, engine_token, settings.engine_timeout_seconds, self.tls)
        self.connector: ConnectorInstance | None = None
        self.replaced = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop` is set: register once vLLM and its connector are up, then heartbeat; then drain. A
        connector instance replaced under the agent (vLLM restarted) is registered afresh."""
        try:
            while not stop.is_set():
                info = await self._wait_for_engine(stop)
                if info is None:
                    return
                await self._serve_registration(info, stop)
        finally:
            await self.engine.aclose()

    async def _serve_registration(self, info: InstanceInfo, stop: asyncio.Event) -> None:
        self.replaced.clear()
        beats = asyncio.create_task(
            run_heartbeats(
                self.settings.scheduler_url,
                info,
                self.load,
                token=self.token,
                interval=self.settings.heartbeat_seconds,
                verify=self.tls,
            )
        )
        waits = [asyncio.create_task(stop.wait()), asyncio.create_task(self.replaced.wait())]
        await asyncio.wait({beats, *waits}, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if beats.done():  # run_heartbeats only ends by raising
            beats.result()
        if stop.is_set():
            await self.drain_engine()
        else:
            log.info(
                "the connector's instance changed (vLLM restarted?): registering again",
                extra={"fields": {"instance_id": self.instance_id}},
            )
        beats.cancel()  # cancelling deregisters the instance
        await asyncio.gather(beats, return_exceptions=True)
        log.info("deregistered", extra={"fields": {"instance_id": self.instance_id}})

    async def _wait_for_engine(self, stop: asyncio.Event) -> InstanceInfo | None:
        """The registration, once the connector's instance file and vLLM's model list can be read."""
        last_problem = ""
        while not stop.is_set():
            try:
                return await self.instance_info()
            except (InstanceFileError, EngineError) as exc:
                if str(exc) != last_problem:
                    log.info("waiting for vLLM and its connector", extra={"fields": {"cause": str(exc)}})
                    last_problem = str(exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.heartbeat_seconds)
        return None

    async def instance_info(self) -> InstanceInfo:
        s = self.settings
        connector = find(s.connector_run_dir, s.role)
        model = await self.engine.model()
        self.connector = connector
        log.info(
            "connector instance found",
            extra={
                "fields": {
                    "file": str(connector.path),
                    "fingerprint": connector.fingerprint,
                    "kv_streaming": connector.kv_streaming,
                }
            },
        )
        return InstanceInfo(
            instance_id=self.instance_id,
            role=s.role,
            version=s.version,
            kv_fingerprint=connector.fingerprint,
            url=s.advertise_url,
            model=model.name,
            kv_host=connector.kv_host if s.role == "prefill" else None,
            kv_port=connector.kv_port if s.role == "prefill" else None,
            supported_params=VLLM_SUPPORTED_PARAMS,
            max_model_len=model.max_model_len,
            kv_streaming=connector.kv_streaming,
        )

    async def load(self) -> InstanceLoad:
        """What each heartbeat reports; ready only while /health is 200 and no other connector instance replaced
        the registered one (a new one, after a vLLM restart, makes the agent register again). The instance file
        must exist to register; its later removal alone says nothing about vLLM (/health does)."""
        current = self._current_connector()
        replaced = current is not None and current != self.connector
        if replaced:
            self.replaced.set()
        ready = await self.engine.healthy() and not replaced
        try:
            engine = await self.engine.load()
        except EngineError as exc:
            log.warning("vLLM metrics unreadable; reporting not ready", extra={"fields": {"cause": str(exc)}})
            return InstanceLoad(ready=False, max_concurrency=self.settings.max_num_seqs)
        capacity = 0
        block_bytes = self.connector.block_bytes() if self.connector is not None else None
        if block_bytes is not None and engine.num_blocks is not None:
            capacity = block_bytes * engine.num_blocks
        return InstanceLoad(
            ready=ready,
            active_requests=engine.running,
            queue_depth=engine.waiting,
            max_concurrency=self.settings.max_num_seqs,
            kv_capacity_bytes=capacity,
            kv_used_bytes=round(engine.kv_usage * capacity),
        )

    def _current_connector(self) -> ConnectorInstance | None:
        try:
            return find(self.settings.connector_run_dir, self.settings.role)
        except InstanceFileError:
            return None

    async def drain_engine(self) -> None:
        """Stop new traffic, give the gateways time to see it, then wait (bounded) for vLLM's requests to end."""
        s = self.settings
        acknowledged = await drain(s.scheduler_url, self.instance_id, self.token, self.tls)
        log.info("draining", extra={"fields": {"instance_id": self.instance_id, "acknowledged": acknowledged}})
        await asyncio.sleep(s.drain_grace_seconds)
        deadline = time.monotonic() + s.drain_timeout_seconds
        while True:
            remaining = await self._in_flight()
            if remaining == 0:
                log.info("drained: vLLM has no running or waiting request")
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "drain timed out with requests in flight",
                    extra={"fields": {"in_flight": remaining, "timeout": s.drain_timeout_seconds}},
                )
                return
            await asyncio.sleep(0.2)

    async def _in_flight(self) -> int | None:
        """vLLM's running plus waiting requests; None when its metrics cannot be read (it may be stopping)."""
        try:
            load = await self.engine.load()
        except EngineError:
            return None if await self.engine.healthy() else 0
        return load.running + load.waiting


async def serve(settings: AgentSettings) -> None:
    """Run the agent until SIGTERM or SIGINT, then drain and deregister."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    agent = Agent(settings)
    async with tls.reloading(settings.tls_reload_seconds):  # a rotated client certificate, without a restart
        await agent.run(stop)
