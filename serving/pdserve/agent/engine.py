"""What the agent reads from vLLM's own API server: /health, /v1/models and the Prometheus scrape at /metrics."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"


class EngineError(RuntimeError):
    """vLLM did not answer as expected; the message says which endpoint and how."""


@dataclass(frozen=True)
class EngineLoad:
    running: int
    waiting: int
    kv_usage: float
    """fraction of the KV cache in use, in [0, 1]"""
    num_blocks: int | None
    """KV cache blocks (cache_config_info's num_gpu_blocks); None when not reported"""


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int | None


class Engine:
    """An httpx client for one vLLM API server."""

    def __init__(self, url: str, token: str | None, timeout: float, verify: ssl.SSLContext | bool = True) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout), verify=verify
        )

    async def healthy(self) -> bool:
        """vLLM's /health is 200: its API server is up and its EngineCore answers."""
        try:
            return (await self.client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def model(self) -> ServedModel:
        response = await self._get("/v1/models")
        try:
            first = response.json()["data"][0]
            name = str(first["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineError(f"{self.url}/v1/models: no model in {response.text[:200]!r}") from None
        length = first.get("max_model_len")
        return ServedModel(name, length if isinstance(length, int) and length > 0 else None)

    async def load(self) -> EngineLoad:
        return parse_load((await self._get("/metrics")).text)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self.client.get(path)
        except httpx.HTTPError as exc:
            raise EngineError(f"{self.url}{path}: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise EngineError(f"{self.url}{path}: HTTP {response.status_code}")
        return response


def parse_load(text: str) -> EngineLoad:
    """Running and waiting requests and KV usage, summed (usage averaged) over vLLM's engines."""
    sums: dict[str, float] = {RUNNING: 0.0, WAITING: 0.0}
    usage: list[float] = []
    blocks: int | None = None
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise EngineError(f"/metrics: not a Prometheus text exposition ({exc})") from None
    seen: set[str] = set()
    for family in families:
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
                seen.add(sample.name)
            elif sample.name == KV_USAGE:
                usage.append(sample.value)
            elif sample.name == CACHE_INFO and sample.labels.get("num_gpu_blocks", "").isdigit():
                blocks = (blocks or 0) + int(sample.labels["num_gpu_blocks"])
    missing = [name for name in (RUNNING, WAITING) if name not in seen]
    if missing or not usage:
        raise EngineError(f"/metrics: no {(missing or [KV_USAGE])[0]} (is this vLLM's API server?)")
    kv_usage = min(1.0, max(0.0, sum(usage) / len(usage)))
    return EngineLoad(int(sums[RUNNING]), int(sums[WAITING]), kv_usage, blocks)
