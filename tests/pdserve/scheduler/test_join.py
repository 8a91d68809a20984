"""A node joining by itself (POST /v1/join, pdserve.scheduler.join; the node's side pdstack.node.join) against a
real scheduler process and a real moto server as STS.

moto serves sts:AssumeRole and sts:GetCallerIdentity; a node's instance-role credentials are moto's AssumeRole of a
role named like a pool's node role, with the instance id as the session name, as EC2 names an instance role's
session. moto checks no signature by default: the module turns its request authentication on
(`/moto-api/reset-auth`, moto.settings.INITIAL_NO_AUTH_ACTION_COUNT) once the roles are assumed, so that STS's
refusal of a tampered signature is moto's own SigV4 check, and turns it off again after.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from prometheus_client.parser import text_string_to_metric_families

from pdserve.scheduler.app import create_app
from pdserve.scheduler.client import bearer
from pdserve.scheduler.protocol import AUDIENCE_HEADER, JoinRequest
from pdserve.scheduler.settings import SchedulerSettings
from pdstack.node.join import JoinError, join, signed_join_request
from tests.support.joining import assume, ensure_role, join_scheduler, role_arn
from tests.support.motoserver import ACCOUNT, client, moto_server
from tests.support.services import Service, write_secret

pytestmark = pytest.mark.slow  # a scheduler process and a moto server

REGION = "us-east-1"
AUDIENCE = "pdstack-local-scheduler"
NODE_ROLE = "pdstack-local-dc2-decode-node"
OTHER_ROLE = "pdstack-local-builder"  # a role of the same account that is no pool's node role
INSTANCE = "i-0123456789abcdef0"
AUDIENCE_FIELD = f"headers.{AUDIENCE_HEADER.lower()}"
FORM = "application/x-www-form-urlencoded; charset=utf-8"


@dataclass
class World:
    moto: str
    scheduler: Service
    node: Credentials  # the node role, session INSTANCE: an instance's role credentials
    other_role: Credentials
    not_an_instance: Credentials  # the node role, a session name no instance has


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("join")
    with moto_server() as moto:
        iam, sts = client(moto, "iam", REGION), client(moto, "sts", REGION)
        for name in (NODE_ROLE, OTHER_ROLE):
            ensure_role(iam, name)
        node = assume(sts, NODE_ROLE, INSTANCE)
        other = assume(sts, OTHER_ROLE, INSTANCE)
        stranger = assume(sts, NODE_ROLE, "ci-runner")
        # From here every request to moto must carry a valid signature of known credentials
        httpx.post(f"{moto}/moto-api/reset-auth", content=b"0").raise_for_status()
        try:
            with join_scheduler(moto, tmp, {role_arn(NODE_ROLE): "decode"}, AUDIENCE) as scheduler:
                yield World(moto, scheduler, node, other, stranger)
        finally:  # moto's authentication is process-wide: off again for every other moto server of the session
            httpx.post(f"{moto}/moto-api/reset-auth", content=b"inf").raise_for_status()


def signed(credentials: Credentials, audience: str = AUDIENCE, *, sts_url: str, **kwargs: Any) -> JoinRequest:
    """A node's request, signed for STS at `sts_url` (the world's moto, or elsewhere)."""
    return signed_join_request(credentials, REGION, audience, sts_url=sts_url, **kwargs)


def sign(world: World, credentials: Credentials, audience: str = AUDIENCE, **kwargs: Any) -> JoinRequest:
    return signed(credentials, audience, sts_url=world.moto + "/", **kwargs)


def post(world: World, request: JoinRequest | dict[str, Any]) -> httpx.Response:
    body = request.model_dump(exclude_none=True) if isinstance(request, JoinRequest) else request
    return httpx.post(world.scheduler.url + "/v1/join", json=body, timeout=10)


def refused(answer: httpx.Response, status: int, field: str) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["field"] == field, error
    return str(error["message"])


def joins(world: World) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(world.scheduler.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == "pdserve_scheduler_joins_total":
                assert set(sample.labels) == {"result"}
                found[sample.labels["result"]] = sample.value
    return found


def test_moto_names_the_instance_role_and_checks_signatures(world: World) -> None:
    node = world.node
    sts = boto3.client(
        "sts",
        region_name=REGION,
        endpoint_url=world.moto,
        aws_access_key_id=node.access_key,
        aws_secret_access_key=node.secret_key,
        aws_session_token=node.token,
    )
    arn = sts.get_caller_identity()["Arn"]
    assert arn == f"arn:aws:sts::{ACCOUNT}:assumed-role/{NODE_ROLE}/{INSTANCE}"
    request = sign(world, node)
    headers = dict(request.headers)
    headers["Authorization"] = headers["Authorization"][:-8] + "00000000"
    answer = httpx.post(world.moto + "/", content=request.body, headers=headers)
    assert answer.status_code == 403
    assert b"SignatureDoesNotMatch" in answer.content


def test_a_node_joins_and_its_token_is_its_own(world: World) -> None:
    before = joins(world).get("ok", 0)
    answer = join(world.scheduler.url, sign(world, world.node, engine_id=f"{INSTANCE}-ab12"))
    instance_id = f"decode-{INSTANCE}-ab12"
    assert (answer.instance_id, answer.principal) == (instance_id, f"instance:{instance_id}")
    base, headers = world.scheduler.url, bearer(answer.token)
    info = {"instance_id": instance_id, "role": "decode", "version": "v1", "kv_fingerprint": "fp"}
    registered = httpx.post(base + "/v1/instances", json={**info, "url": "http://127.0.0.1:9"}, headers=headers)
    assert registered.status_code == 201, registered.text
    beat = httpx.post(f"{base}/v1/instances/{instance_id}/heartbeat", json={"load": {}}, headers=headers)
    assert beat.status_code == 200, beat.text
    other = {**info, "instance_id": "decode-i-0fedcba9876543210", "url": "http://127.0.0.1:9"}
    assert httpx.post(base + "/v1/instances", json=other, headers=headers).status_code == 403
    # without an engine id, the engine id is the instance id
    assert join(base, sign(world, world.node)).instance_id == f"decode-{INSTANCE}"
    assert joins(world)["ok"] == before + 2


def test_a_request_for_another_audience_or_engine_is_refused(world: World) -> None:
    refused(post(world, sign(world, world.node, audience="pdstack-prod-scheduler")), 403, AUDIENCE_FIELD)
    # the audience's value changed after signing: the signature covers it, STS refuses
    request = sign(world, world.node, audience="pdstack-prod-scheduler")
    swapped = request.model_copy(update={"headers": {**request.headers, AUDIENCE_HEADER: AUDIENCE}})
    assert "SignatureDoesNotMatch" in refused(post(world, swapped), 401, "headers.authorization")
    # the right audience, added to a request signed without it: not among the signed headers
    bare = AWSRequest("POST", world.moto + "/", data=request.body, headers={"Content-Type": FORM})
    SigV4Auth(world.node, "sts", REGION).add_auth(bare)
    unsigned = {**dict(bare.headers.items()), AUDIENCE_HEADER: AUDIENCE}
    added = request.model_copy(update={"headers": unsigned})
    assert "signed" in refused(post(world, added), 403, AUDIENCE_FIELD)
    with pytest.raises(JoinError) as caught:
        join(world.scheduler.url, sign(world, world.node, engine_id="i-0fedcba9876543210"))
    assert (caught.value.status, caught.value.field) == (403, "engine_id")


def test_a_url_elsewhere_is_refused_without_a_connection(world: World) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        elsewhere = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        refused(post(world, signed(world.node, sts_url=elsewhere)), 400, "url")
        same_host = signed(world.node, sts_url=world.moto + "/other")
        refused(post(world, same_host), 400, "url")
        query = signed(world.node, sts_url=world.moto + "/?Action=AssumeRole")
        refused(post(world, query), 400, "url")
        right_url = sign(world, world.node)
        host_elsewhere = {**right_url.headers, "Host": f"127.0.0.1:{listener.getsockname()[1]}"}
        refused(post(world, right_url.model_copy(update={"headers": host_elsewhere})), 400, "headers.host")
        time.sleep(0.2)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_roles_sessions_and_signatures_sts_or_the_map_refuse(world: World) -> None:
    assert "not a node role" in refused(post(world, sign(world, world.other_role)), 403, "headers.authorization")
    assert "instance id" in refused(post(world, sign(world, world.not_an_instance)), 403, "headers.authorization")
    request = sign(world, world.node)
    tampered = {**request.headers, "Authorization": request.headers["Authorization"][:-8] + "00000000"}
    message = refused(post(world, request.model_copy(update={"headers": tampered})), 401, "headers.authorization")
    assert "SignatureDoesNotMatch" in message
    # the same action, its parameters reordered: the scheduler's check passes it, the signature covers the body
    reordered = request.model_copy(update={"body": "Version=2011-06-15&Action=GetCallerIdentity"})
    assert "SignatureDoesNotMatch" in refused(post(world, reordered), 401, "headers.authorization")
    another_action = request.model_copy(update={"body": "Action=GetSessionToken&Version=2011-06-15"})
    refused(post(world, another_action), 400, "body")
    refused(post(world, request.model_copy(update={"method": "GET"})), 400, "method")
    refused(post(world, {**request.model_dump(), "credentials": "x"}), 400, "credentials")
    big = httpx.post(world.scheduler.url + "/v1/join", content=b"{" + b" " * 20_000 + b"}", timeout=10)
    refused(big, 413, "body")
    counted = joins(world)
    assert {"role", "session", "sts_refused", "action", "method", "body"} <= set(counted)
    assert set(counted) <= {
        "ok", "busy", "body", "method", "url", "action", "headers", "audience", "engine_id", "sts_refused",
        "sts_unavailable", "identity", "role", "session",
    }  # fmt: skip


# -- in-process: join off unless configured; settings; a silent STS and the bound on joins at once --------------


def settings(tmp_path: Path, **join: Any) -> SchedulerSettings:
    admin, key = tmp_path / "admin.token", tmp_path / "identity.key"
    write_secret(admin)
    write_secret(key)
    return SchedulerSettings(state_file=tmp_path / "state.json", admin_token_file=admin, identity_key_file=key, **join)


def test_join_is_off_unless_configured_and_its_settings_are_checked(tmp_path: Path) -> None:
    app = create_app(settings(tmp_path))
    assert app.state.scheduler.joiner is None
    assert all(getattr(route, "path", "") != "/v1/join" for route in app.routes)
    roles = f"{role_arn(NODE_ROLE)}=decode, {role_arn('pdstack-local-dc1-prefill-node')}=prefill"
    on = settings(tmp_path, join_node_roles=roles, join_audience=AUDIENCE, join_region="us-west-2")
    assert on.sts_url() == "https://sts.us-west-2.amazonaws.com/"
    assert on.node_roles()[("aws", ACCOUNT, "pdstack-local-dc1-prefill-node")] == "prefill"
    for wrong in (
        {"join_node_roles": roles, "join_region": "us-west-2"},  # no audience
        {"join_node_roles": roles, "join_audience": AUDIENCE},  # no STS
        {"join_node_roles": f"{role_arn(NODE_ROLE)}=gateway", "join_audience": AUDIENCE, "join_region": "us-west-2"},
        {"join_node_roles": "pdstack-node=decode", "join_audience": AUDIENCE, "join_region": "us-west-2"},
    ):
        with pytest.raises(ValueError):
            settings(tmp_path, **wrong)


def test_a_silent_sts_times_out_and_joins_at_once_are_bounded(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections (the backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        sts_url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        app = create_app(
            settings(
                tmp_path,
                join_node_roles=f"{role_arn(NODE_ROLE)}=decode",
                join_audience=AUDIENCE,
                join_sts_url=sts_url,
                join_sts_timeout=0.5,
                join_max_concurrent=1,
            )
        )
        node = Credentials("ASIAEXAMPLEEXAMPLE00", "secret", "token")
        body = signed(node, sts_url=sts_url).model_dump(exclude_none=True)

        async def two_at_once() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://scheduler") as scheduler:
                first = asyncio.create_task(scheduler.post("/v1/join", json=body))
                await asyncio.sleep(0.1)
                second = await scheduler.post("/v1/join", json=body)
                answers = [await first, second]
            await app.state.scheduler.joiner.aclose()
            return answers

        started = time.monotonic()
        first, second = asyncio.run(two_at_once())
        assert time.monotonic() - started < 3
        refused(first, 504, "url")
        assert second.status_code == 429 and second.headers["retry-after"] == "1"
