"""A node joining by itself: its instance role proves who it is, and the scheduler answers its own principal's token.

The mechanism is Vault's AWS IAM auth method. The node signs (SigV4, with its instance role's credentials) an
sts:GetCallerIdentity request for the scheduler's STS endpoint, with the audience header (protocol.AUDIENCE_HEADER)
among the signed headers, and sends the request's parts, never its credentials (protocol.JoinRequest). The scheduler

1. checks, before any connection: the method is POST; the URL is exactly its configured STS endpoint (scheme, host,
   port, path; no query); the body is GetCallerIdentity and nothing else; the headers are an AWS4-HMAC-SHA256
   signature whose SignedHeaders include the audience header, whose value is this scheduler's audience;
2. replays the request to its configured STS endpoint, never to a URL from the request, within join_sts_timeout,
   with no proxy from the environment and no redirect followed; STS checks the signature, the date and the
   credentials (401 when it refuses them);
3. checks the caller STS names, arn:<partition>:sts::<account>:assumed-role/<role>/<session>: the role is one of
   join_node_roles (partition, account and name), and the session name is an EC2 instance id, which it is for an
   instance role's credentials (the node role trusts ec2.amazonaws.com alone, so nobody else picks the session name);
4. answers the token of instance:<component>-<engine id>, where the engine id is the instance id, or the instance id
   and a tag the node chose (`<instance id>-<tag>`, at most protocol.ENGINE_ID_MAX characters): one node can get
   the token of no other instance's id.

Every refusal is 4xx naming the field and is counted by a fixed reason (pdserve_scheduler_joins_total{result}); no
label ever carries what a caller sent.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

import httpx

from .identity import derive_token, instance_principal
from .protocol import AUDIENCE_HEADER, STS_ACTION_BODY, JoinAnswer, JoinRequest
from .settings import SchedulerSettings

# Every result the join counter may carry: "ok" and the fixed refusal reasons.
RESULTS = (
    "ok",
    "busy",
    "body",
    "method",
    "url",
    "action",
    "headers",
    "audience",
    "engine_id",
    "sts_refused",
    "sts_unavailable",
    "identity",
    "role",
    "session",
)
STS_ANSWER_MAX_BYTES = 65_536
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{0,4096}")
_SIGNED_HEADERS = re.compile(r"(?:^|[ ,])SignedHeaders=([a-z0-9;._-]+)")
_ASSUMED_ROLE = re.compile(r"arn:(aws[a-z-]*):sts::(\d{12}):assumed-role/([\w+=,.@-]{1,64})/([\w+=,.@-]{2,64})")
_INSTANCE_ID = re.compile(r"i-(?:[0-9a-f]{8}|[0-9a-f]{17})")
# STS's XML answer, read with two expressions rather than an XML parser: only the caller's ARN or the error's code
# are wanted, and neither holds a character XML would escape (a mismatch is refused).
_STS_ARN = re.compile(rb"<GetCallerIdentityResult>.*?<Arn>([^<]{1,2048})</Arn>", re.DOTALL)
_STS_CODE = re.compile(rb"<Error>.*?<Code>([A-Za-z0-9.]{1,64})</Code>", re.DOTALL)
# Set by the HTTP client from the URL and body the scheduler sends: a caller's own values are never forwarded.
_NOT_FORWARDED = frozenset({"host", "content-length"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class JoinRefused(Exception):
    """A join refused: the HTTP status, the field named, the fixed reason it is counted by."""

    def __init__(self, status: int, reason: str, field: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.field = status, reason, field


@dataclass(frozen=True)
class Caller:
    """Who STS says signed the request."""

    partition: str
    account: str
    role: str
    session: str


def _endpoint(url: str) -> tuple[str, str, int, str] | None:
    """(scheme, host, port, path) of an http(s) URL with no user, query or fragment; None otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname or parts.username is not None:
        return None
    if parts.query or parts.fragment or "?" in url or "#" in url:
        return None
    return scheme, parts.hostname.lower(), port or _DEFAULT_PORTS[scheme], parts.path or "/"


class Joiner:
    """Checks join requests and replays them to the one configured STS endpoint."""

    def __init__(self, settings: SchedulerSettings, identity_key: str) -> None:
        self.settings = settings
        self.identity_key = identity_key
        self.sts_url = settings.sts_url()
        endpoint = _endpoint(self.sts_url)
        if endpoint is None:
            raise ValueError(f"join_sts_url: {self.sts_url!r} is not an http(s) endpoint")
        self.endpoint = endpoint
        self.node_roles = settings.node_roles()
        self.in_flight = 0
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.settings.join_sts_timeout),
                follow_redirects=False,
                trust_env=False,  # no proxy nor CA from the environment: STS is the configured endpoint, directly
                limits=httpx.Limits(max_connections=self.settings.join_max_concurrent),
            )
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def check(self, request: JoinRequest) -> dict[str, str]:
        """The headers to replay (the signed ones and Authorization); JoinRefused for anything else."""
        if request.method != "POST":
            raise JoinRefused(400, "method", "method", "method: must be POST (sts:GetCallerIdentity, signed)")
        if _endpoint(request.url) != self.endpoint:
            raise JoinRefused(
                400, "url", "url", f"url: must be this scheduler's STS endpoint {self.sts_url}, with no query"
            )
        try:
            action = parse_qsl(request.body, keep_blank_values=True, strict_parsing=True)
        except ValueError:
            action = []
        if sorted(action) != sorted(parse_qsl(STS_ACTION_BODY)):
            raise JoinRefused(400, "action", "body", f"body: must be {STS_ACTION_BODY} and nothing else")
        headers: dict[str, str] = {}
        for name, value in request.headers.items():
            lower = name.lower()
            if _HEADER_NAME.fullmatch(name) is None or _HEADER_VALUE.fullmatch(value) is None or lower in headers:
                raise JoinRefused(400, "headers", "headers", "headers: a malformed or repeated header")
            headers[lower] = value
        authorization = headers.get("authorization", "")
        signed = _SIGNED_HEADERS.search(authorization)
        if not authorization.startswith("AWS4-HMAC-SHA256 ") or signed is None:
            raise JoinRefused(
                400, "headers", "headers.authorization", "headers.authorization: must be an AWS4-HMAC-SHA256 signature"
            )
        signed_names = signed.group(1).split(";")
        audience = AUDIENCE_HEADER.lower()
        if audience not in signed_names:
            raise JoinRefused(
                403, "audience", f"headers.{audience}", f"headers.{audience}: must be among the signed headers"
            )
        if headers.get(audience) != self.settings.join_audience:
            raise JoinRefused(
                403,
                "audience",
                f"headers.{audience}",
                f"headers.{audience}: the request was signed for another audience",
            )
        missing = [name for name in signed_names if name not in headers and name not in _NOT_FORWARDED]
        if missing:
            raise JoinRefused(400, "headers", "headers", f"headers: signed but absent: {', '.join(missing[:4])}")
        host = headers.get("host")
        if host is not None and _endpoint(f"{self.endpoint[0]}://{host}/") != (*self.endpoint[:3], "/"):
            raise JoinRefused(400, "url", "headers.host", f"headers.host: must be the host of {self.sts_url}")
        forwarded = {name: headers[name] for name in signed_names if name in headers and name not in _NOT_FORWARDED}
        forwarded["authorization"] = authorization
        return forwarded

    async def caller(self, request: JoinRequest, headers: dict[str, str]) -> Caller:
        """Who STS says signed the request: the replay, to the configured endpoint only."""
        try:
            async with asyncio.timeout(self.settings.join_sts_timeout):
                status, answer = await self._replay(request.body.encode(), headers)
        except (httpx.HTTPError, TimeoutError):
            raise JoinRefused(504, "sts_unavailable", "url", "url: STS did not answer in time") from None
        if status in (400, 401, 403):
            code = _STS_CODE.search(answer)
            raise JoinRefused(
                401,
                "sts_refused",
                "headers.authorization",
                f"headers.authorization: STS refused the signed request ({code.group(1).decode() if code else status})",
            )
        arn = _STS_ARN.search(answer) if status == 200 else None
        if arn is None:
            raise JoinRefused(502, "sts_unavailable", "url", f"url: STS answered {status} without a caller")
        found = _ASSUMED_ROLE.fullmatch(arn.group(1).decode().strip())
        if found is None:
            raise JoinRefused(
                403, "identity", "headers.authorization", "headers.authorization: not signed by an assumed role"
            )
        return Caller(*found.groups())

    async def _replay(self, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        async with self.client().stream("POST", self.sts_url, content=body, headers=headers) as answer:
            chunks: list[bytes] = []
            size = 0
            async for chunk in answer.aiter_bytes():
                size += len(chunk)
                if size > STS_ANSWER_MAX_BYTES:
                    break
                chunks.append(chunk)
            return answer.status_code, b"".join(chunks)

    def answer(self, caller: Caller, engine_id: str | None) -> JoinAnswer:
        component = self.node_roles.get((caller.partition, caller.account, caller.role))
        if component is None:
            raise JoinRefused(
                403, "role", "headers.authorization", f"headers.authorization: role {caller.role} is not a node role"
            )
        if _INSTANCE_ID.fullmatch(caller.session) is None:
            raise JoinRefused(
                403,
                "session",
                "headers.authorization",
                "headers.authorization: the session name is not an EC2 instance id (instance role credentials only)",
            )
        engine = engine_id or caller.session
        if engine != caller.session and not engine.startswith(caller.session + "-"):
            raise JoinRefused(
                403, "engine_id", "engine_id", f"engine_id: must be {caller.session} or {caller.session}-<tag>"
            )
        instance_id = f"{component}-{engine}"
        principal = instance_principal(instance_id)
        return JoinAnswer(
            instance_id=instance_id, principal=principal, token=derive_token(self.identity_key, principal)
        )
