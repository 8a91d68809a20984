"""Phase `join` against the folder's moto server and a scheduler process with join on: a node's own scheduler token
written where the serving roles mount it, for the engine id apply passes on; the same token on a second boot; a
refusal, an unknown role, a certificate the scheduler's CA never issued a BootstrapError naming the phase at once, the
node Unhealthy; a control plane not there yet (no URL, nothing listening) waited for, then the same."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import httpx
import pytest

from pdserve.scheduler.client import bearer
from pdstack.contract.components import INSTANCE_TOKEN, TLS_CERT_FILE, TLS_KEY_FILE, scheduler_url_parameter
from pdstack.node.join import JoinWait
from pdstack.node.loader import BootstrapError, Phase
from tests.pdstack.node.conftest import Node, pool_certificate
from tests.support.joining import assume, ensure_role
from tests.support.ports import free_port
from tests.support.services import principal_token
from tests.support.tlsfiles import write_tls_dir

pytestmark = pytest.mark.slow  # a scheduler process and a moto server


def token_of(node: Node) -> str:
    """What the scheduler's identity key makes of this node's principal (the roles would derive it so)."""
    assert node.scheduler is not None
    return principal_token(node.scheduler.log_path.parent, f"instance:{node.config.role}-{node.instance_id}")


def test_a_node_joins_and_its_token_is_the_one_the_roles_mount(node: Node) -> None:
    node.boot()
    token_file = node.paths.secrets_dir / INSTANCE_TOKEN.file
    assert token_file.name == "scheduler.token"
    assert token_file.read_text() == token_of(node)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    variables = json.loads((node.paths.state_dir / "apply-vars.json").read_text())
    assert variables["pdstack_instance_token_file"] == str(token_file)
    assert variables["pdstack_engine_id"] == node.instance_id
    # the token is the instance's own: it heartbeats as decode-<instance id> and no other instance
    assert node.scheduler is not None
    instance = f"decode-{node.instance_id}"
    headers = bearer(token_file.read_text())
    with httpx.Client(base_url=node.scheduler.url, headers=headers, verify=node.scheduler.context(), timeout=10) as api:
        own = api.post(f"/v1/instances/{instance}/heartbeat", json={})
        assert own.status_code != 403, own.text
        other = api.post("/v1/instances/decode-i-0/heartbeat", json={})
    assert other.status_code == 403, other.text


def test_a_second_boot_joins_again_to_the_same_token(node: Node) -> None:
    node.boot()
    token_file = node.paths.secrets_dir / INSTANCE_TOKEN.file
    first = token_file.read_text()
    token_file.unlink()  # the secrets dir is a tmpfs: gone after a reboot
    result = node.boot()
    assert token_file.read_text() == first == token_of(node)
    assert "join" in result.seconds


def refused(node: Node, *words: str, **kwargs: object) -> None:
    with pytest.raises(BootstrapError) as caught:
        node.boot(**kwargs)
    error = caught.value
    assert error.phase is Phase.JOIN, error
    for word in words:
        assert word in str(error), error
    assert node.health() == "Unhealthy"
    assert 'pdstack_node_bootstrap_failed{phase="join"} 1' in node.metrics()
    assert not (node.paths.secrets_dir / INSTANCE_TOKEN.file).exists()
    assert not node.runs  # nothing applied


def test_a_session_that_is_no_instance_id_is_refused(node: Node) -> None:
    role = f"pdstack-local-{node.config.datacenter}-{node.config.pool}-node"
    stranger = assume(node.client("sts", node.config.control_region), role, "ci-runner")
    refused(node, "join: the scheduler refused (403)", credentials=lambda: stranger)


def test_a_role_that_is_no_pools_node_role_is_refused(node: Node) -> None:
    ensure_role(node.client("iam"), "pdstack-local-builder")
    other = assume(node.client("sts", node.config.control_region), "pdstack-local-builder", node.instance_id)
    refused(node, "join: the scheduler refused (403)", credentials=lambda: other)


def test_no_credentials_fail_the_phase(node: Node) -> None:
    refused(node, "no AWS credentials", credentials=lambda: None)


def test_a_certificate_from_another_ca_cannot_join(node: Node, tmp_path: Path) -> None:
    """The scheduler requires a client certificate from its CA (serving.mutual_tls): a node whose pool certificate is
    not from it gets no token, though its instance role is right; the joins above presented their pool's."""
    other = write_tls_dir(tmp_path / "other-ca", ["localhost", "127.0.0.1"])
    forged = {name: (other / name).read_text() for name in (TLS_CERT_FILE, TLS_KEY_FILE)}
    assert node.scheduler is not None
    pool = pool_certificate(node.scheduler)
    secret = json.dumps(pool | forged)  # the right CA to verify the scheduler by, a pair it never issued
    node.client("secretsmanager", node.config.control_region).put_secret_value(
        SecretId=node.config.tls_secret, SecretString=secret
    )
    refused(node, "did not answer")


def write_scheduler_url(node: Node, url: str | None) -> None:
    """The scheduler URL the control plane writes (None: not written yet)."""
    ssm, name = node.client("ssm", node.config.control_region), scheduler_url_parameter(str(node.config.environment))
    if url is None:
        ssm.delete_parameter(Name=name)
    else:
        ssm.put_parameter(Name=name, Value=url, Type="String", Overwrite=True)


def test_a_node_booting_before_its_control_plane_waits_for_it_then_joins(node: Node) -> None:
    """A group launches its nodes whenever its stack comes up, maybe before the control plane: no scheduler URL yet,
    then a URL where nothing listens yet. The node waits (each attempt reads the URL again) and joins once the
    scheduler answers, instead of failing and being replaced."""
    assert node.scheduler is not None
    write_scheduler_url(node, None)
    steps = iter([f"https://127.0.0.1:{free_port()}", node.scheduler.url])
    waited: list[float] = []

    def control_plane_moves_on(seconds: float) -> None:
        waited.append(seconds)
        write_scheduler_url(node, next(steps))

    result = node.boot(join_wait=JoinWait(seconds=60, sleep=control_plane_moves_on))
    assert waited == [1.0, 2.0]  # no URL, then nothing listening, then joined
    assert (node.paths.secrets_dir / INSTANCE_TOKEN.file).read_text() == token_of(node)
    assert "join" in result.seconds


def test_a_control_plane_that_never_comes_fails_the_phase_after_the_wait(node: Node) -> None:
    write_scheduler_url(node, f"https://127.0.0.1:{free_port()}")
    refused(node, "did not answer", "waited 3 s for the control plane", join_wait=JoinWait(seconds=3))
