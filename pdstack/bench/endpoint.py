"""Where the load goes: an OpenAI-compatible base URL, the API flavour, the model and the credentials."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

APIS = ("chat", "completions")


class EndpointError(ValueError):
    """The endpoint settings are wrong, or the endpoint did not answer as an OpenAI-compatible server."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server: `base_url` ends in /v1."""

    base_url: str
    api: str
    model: str
    api_key: str | None = None

    @property
    def request_path(self) -> str:
        return "/chat/completions" if self.api == "chat" else "/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __repr__(self) -> str:  # never show the key
        return f"Endpoint(base_url={self.base_url!r}, api={self.api!r}, model={self.model!r})"


def normalise_base_url(url: str) -> str:
    """`http://host:port`, `.../v1` or `.../v1/` all become `http://host:port/v1`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise EndpointError(f"url: expected http(s)://host:port[/v1], got {url!r}")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1"):
        path = f"{path}/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def read_api_key(path: Path | None, option: str = "api-key-file") -> str | None:
    """The key (or token: `option` names the flag) from the first non-empty line of the file; the key itself never
    appears in messages."""
    if path is None:
        return None
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError as exc:
        raise EndpointError(f"{option}: cannot read {path}: {exc.strerror}") from exc
    if not lines:
        raise EndpointError(f"{option}: {path} is empty")
    return lines[0]


def fetch_models(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> dict[str, Any]:
    """The endpoint's answer to GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/models", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise EndpointError(f"url: cannot reach {base_url}/models: {type(exc).__name__}: {exc}") from exc
    if response.status_code in (401, 403):
        raise EndpointError(f"api-key-file: {base_url}/models refused the credentials (HTTP {response.status_code})")
    if response.status_code != 200:
        raise EndpointError(f"url: {base_url}/models answered HTTP {response.status_code}")
    try:
        answer = response.json()
    except ValueError as exc:
        raise EndpointError(f"url: {base_url}/models did not answer JSON") from exc
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        raise EndpointError(f"url: {base_url}/models answer has no `data` list")
    return answer


def pick_model(models: dict[str, Any], wanted: str | None) -> str:
    """The wanted model if the endpoint serves it, else the endpoint's first model."""
    ids = [str(m["id"]) for m in models["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if wanted is not None:
        if ids and wanted not in ids:
            raise EndpointError(f"model: {wanted!r} is not served here; the endpoint serves {', '.join(ids)}")
        return wanted
    if not ids:
        raise EndpointError("model: the endpoint lists no models; name one with --model")
    return str(ids[0])
