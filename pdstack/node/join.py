"""A node's own scheduler token, bought with its instance role (the scheduler's side: pdserve.scheduler.join).

    request = signed_join_request(credentials, region="us-west-2", audience="pdstack-prod-scheduler")
    answer = join(scheduler_url, request)        # JoinAnswer: instance_id decode-i-0123..., principal, token

The node signs an sts:GetCallerIdentity request for STS's regional endpoint (or the local environment's AWS) with
SigV4 (botocore's SigV4Auth on the instance role's credentials), the audience header among the signed headers, and
sends the signed request's method, URL, headers and body, never the credentials; the scheduler replays it to its own
STS endpoint and answers the token of instance:<component>-<engine id>, the engine id being this instance's id (or
`<instance id>-<tag>`). A signature is good for about 15 minutes (STS's window for X-Amz-Date): sign just before
joining.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdserve.scheduler.protocol import (
    AUDIENCE_HEADER,
    JOIN_PATH,
    STS_ACTION_BODY,
    JoinAnswer,
    JoinRequest,
    sts_regional_url,
)
from pdstack.node.files import write_atomic

TIMEOUT = httpx.Timeout(30.0, connect=5.0)  # the scheduler waits for STS (join_sts_timeout) before it answers
# A node may boot before its control plane answers (each stack comes up by itself; a group launches at once): it waits
# this long for the scheduler URL and a scheduler that listens, then fails (and its group replaces it)
JOIN_WAIT_S = 900.0
NOT_YET_STATUS = {502, 503, 504}  # a load balancer or proxy in front of a scheduler that is not there yet


class JoinError(RuntimeError):
    """The scheduler refused the join, or could not be reached: the status and the field it named."""

    def __init__(
        self, message: str, status: int | None = None, field: str | None = None, *, not_yet: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.field = status, field
        self.not_yet = not_yet  # no control plane yet (no URL, nothing listening): worth waiting for, not a refusal


@dataclass(frozen=True)
class JoinWait:
    """How long a join waits for a control plane that is not there yet, and how it sleeps between attempts (each
    reads the URL again and signs anew); a refusal, or a TLS handshake the scheduler rejects, fails at once."""

    seconds: float = JOIN_WAIT_S
    sleep: Callable[[float], None] = time.sleep
    first_delay: float = 1.0
    max_delay: float = 15.0


WAIT_FOR_CONTROL_PLANE = JoinWait()


def signed_join_request(
    credentials: Any, region: str, audience: str, *, sts_url: str | None = None, engine_id: str | None = None
) -> JoinRequest:
    """A GetCallerIdentity request signed with `credentials` (botocore's, e.g. `Session().get_credentials()`) for
    STS in `region` (at `sts_url` when given: the local environment's AWS), carrying `audience` signed."""
    from botocore.auth import SigV4Auth  # type: ignore[import-untyped]  # noqa: PLC0415 (the node's boto3)
    from botocore.awsrequest import AWSRequest  # type: ignore[import-untyped]  # noqa: PLC0415

    url = sts_url or sts_regional_url(region)
    frozen = credentials.get_frozen_credentials() if hasattr(credentials, "get_frozen_credentials") else credentials
    request = AWSRequest(
        method="POST",
        url=url,
        data=STS_ACTION_BODY,
        headers={"Content-Type": "application/x-www-form-urlencoded; charset=utf-8", AUDIENCE_HEADER: audience},
    )
    SigV4Auth(frozen, "sts", region).add_auth(request)
    headers = {str(name): str(value) for name, value in request.headers.items()}
    return JoinRequest(method="POST", url=url, headers=headers, body=STS_ACTION_BODY, engine_id=engine_id)


def join(
    scheduler_url: str,
    request: JoinRequest,
    *,
    verify: ssl.SSLContext | bool = True,
    timeout: httpx.Timeout = TIMEOUT,
) -> JoinAnswer:
    """The scheduler's answer to `request`: this instance's id and token; JoinError naming the refusal."""
    try:
        answer = httpx.post(
            scheduler_url.rstrip("/") + JOIN_PATH,
            json=request.model_dump(exclude_none=True),
            verify=verify,
            timeout=timeout,
        )
    except httpx.HTTPError as exc:
        message = f"join: the scheduler at {scheduler_url} did not answer: {exc}"
        raise JoinError(message, not_yet=_nothing_listening(exc)) from None
    if answer.status_code != 200:
        try:
            found = answer.json().get("error")
        except (ValueError, AttributeError):
            found = None
        refusal: dict[str, Any] = found if isinstance(found, dict) else {}
        message = str(refusal.get("message") or answer.text[:200])
        field = refusal.get("field")
        raise JoinError(
            f"join: the scheduler refused ({answer.status_code}): {message}",
            answer.status_code,
            field if isinstance(field, str) else None,
            not_yet=answer.status_code in NOT_YET_STATUS,
        )
    return JoinAnswer.model_validate(answer.json())


def _nothing_listening(exc: BaseException) -> bool:
    """Whether the connection failed for want of a listener (refused, a name not resolving yet, a connect timeout),
    not in the TLS handshake or after it."""
    if isinstance(exc, httpx.ConnectTimeout):
        return True
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError | socket.gaierror):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


@dataclass(frozen=True)
class Joined:
    """What the bootstrap's join phase leaves: the token's file and the engine id the node joined as."""

    token_file: Path
    engine_id: str
    instance_id: str  # at the scheduler: <component>-<engine id>


def scheduler_url(ssm: Any, parameter: str) -> str:
    """The scheduler's URL the control plane wrote to SSM (pdstack.contract.components.scheduler_url_parameter)."""
    try:
        value = str(ssm.get_parameter(Name=parameter)["Parameter"]["Value"]).strip()
    except ssm.exceptions.ParameterNotFound:
        raise JoinError(f"join: no scheduler URL at {parameter} (the control plane writes it)", not_yet=True) from None
    if not value.startswith(("https://", "http://")):
        raise JoinError(f"join: {parameter} holds {value[:80]!r}, not a URL")
    return value


def join_scheduler(
    ssm: Any,
    parameter: str,
    credentials: Any,
    *,
    region: str,
    audience: str,
    component: str,
    token_file: Path,
    sts_url: str | None = None,
    ca_file: Path | None = None,
    client_pair: tuple[Path, Path] | None = None,
    wait: JoinWait = WAIT_FOR_CONTROL_PLANE,
) -> Joined:
    """Join the scheduler named by `parameter` with the instance role's `credentials` and write the token (0600,
    atomically) to `token_file`. Joining again is harmless: the scheduler answers the same token. Over https the
    scheduler is verified against `ca_file`, and the pool's certificate and key (`client_pair`) are presented: a
    scheduler with mutual TLS (serving.mutual_tls) closes the connection on a caller without one. Until the control
    plane is there (its URL written, its scheduler listening) it waits, as `wait` says."""
    if credentials is None:
        raise JoinError("join: no AWS credentials (the instance role's) to sign with")
    deadline = time.monotonic() + wait.seconds
    delay = wait.first_delay
    while True:
        try:
            url = scheduler_url(ssm, parameter)
            request = signed_join_request(credentials, region, audience, sts_url=sts_url)
            answer = join(url, request, verify=_verify(url, ca_file, client_pair))
            break
        except JoinError as error:
            if not error.not_yet:
                raise
            if time.monotonic() + delay > deadline:
                raise JoinError(f"{error} (waited {wait.seconds:.0f} s for the control plane)") from None
        wait.sleep(delay)
        delay = min(2 * delay, wait.max_delay)
    prefix = f"{component}-"
    if not answer.instance_id.startswith(prefix) or answer.principal != f"instance:{answer.instance_id}":
        raise JoinError(f"join: the scheduler named this node {answer.principal}, not a {component} instance")
    write_atomic(token_file, answer.token.encode(), 0o600)
    return Joined(token_file, answer.instance_id.removeprefix(prefix), answer.instance_id)


def _verify(url: str, ca_file: Path | None, client_pair: tuple[Path, Path] | None) -> ssl.SSLContext | bool:
    if not url.startswith("https://") or (ca_file is None and client_pair is None):
        return True
    verify = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    if client_pair is not None:
        verify.load_cert_chain(str(client_pair[0]), str(client_pair[1]))
    return verify
