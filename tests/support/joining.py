"""A scheduler process with join on (POST /v1/join, pdserve.scheduler.join), STS being a moto server, and a node's
instance-role credentials from moto: what tests/pdserve/scheduler/test_join.py and the node's bootstrap tests
(tests/pdstack/node) join against.

moto serves sts:AssumeRole and sts:GetCallerIdentity; an instance's role credentials are moto's AssumeRole of a pool's
node role with the instance id as the session name, as EC2 names an instance role's session.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.credentials import Credentials

from pdstack.contract.components import TLS_CA_FILE, TLS_CERT_FILE, TLS_KEY_FILE
from tests.support.motoserver import ACCOUNT
from tests.support.services import Service, identity_key_file, write_secret
from tests.support.tlsfiles import write_tls_dir

# what a node role trusts: EC2 (moto's AssumeRole checks nothing of it)
EC2_TRUST = {"Statement": [{"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "*"}]}


def role_arn(name: str) -> str:
    return f"arn:aws:iam::{ACCOUNT}:role/{name}"


def ensure_role(iam: Any, name: str) -> str:
    """The role `name` in moto (made once: a session's moto server is shared); its ARN."""
    with suppress(iam.exceptions.EntityAlreadyExistsException):
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(EC2_TRUST))
    return role_arn(name)


def assume(sts: Any, role: str, session: str) -> Credentials:
    """The credentials of role `role` (a name) in session `session`: an instance's, with its id as the session."""
    found = sts.assume_role(RoleArn=role_arn(role), RoleSessionName=session)["Credentials"]
    return Credentials(found["AccessKeyId"], found["SecretAccessKey"], found["SessionToken"])


@dataclass
class MutualTlsService(Service):
    """A service on https that requires a client certificate (serving.mutual_tls): its pair and CA are the files of
    `tls_dir`, which its callers present too (a pool's certificate is from the same CA)."""

    tls_dir: Path = Path()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def context(self) -> ssl.SSLContext:
        """A caller's: the CA, and the pair to present."""
        context = ssl.create_default_context(cafile=str(self.tls_dir / TLS_CA_FILE))
        context.load_cert_chain(self.tls_dir / TLS_CERT_FILE, self.tls_dir / TLS_KEY_FILE)
        return context

    def wait(self, ready_path: str = "/health/live", timeout: float = 60.0) -> MutualTlsService:
        self.wait_http(self.url + ready_path, what=self.module, timeout=timeout, interval=0.05, verify=self.context())
        return self


@contextmanager
def join_scheduler(
    moto: str, tmp: Path, node_roles: Mapping[str, str], audience: str, *, mutual_tls: bool = False
) -> Iterator[Service]:
    """A scheduler process (in `tmp`: its identity key, identity_key_file(tmp)) admitting joins of `node_roles`
    (role ARN -> component) for `audience`, replaying them to moto as STS; with `mutual_tls`, on https requiring a
    client certificate from its CA, as the local environment runs it (a MutualTlsService)."""
    admin = tmp / "admin.token"
    write_secret(admin)
    env = {
        "PDSERVE_JOIN_NODE_ROLES": ",".join(f"{arn}={component}" for arn, component in node_roles.items()),
        "PDSERVE_JOIN_AUDIENCE": audience,
        "PDSERVE_JOIN_STS_URL": moto.rstrip("/") + "/",
    }
    args = ["--state-file", str(tmp / "state.json"), "--admin-token-file", str(admin)]
    args += ["--identity-key-file", str(identity_key_file(tmp)), "--heartbeat-interval", "10"]
    log = tmp / "scheduler.log"
    scheduler: Service
    if mutual_tls:
        tls = write_tls_dir(tmp / "tls", ["localhost", "127.0.0.1"])
        env |= {
            "PDSERVE_TLS_CERT": str(tls / TLS_CERT_FILE),
            "PDSERVE_TLS_KEY": str(tls / TLS_KEY_FILE),
            "PDSERVE_TLS_CA": str(tls / TLS_CA_FILE),
            "PDSERVE_TLS_CLIENT_AUTH": "required",
        }
        scheduler = MutualTlsService("pdserve.scheduler", args, log, env=env, tls_dir=tls).start()
    else:
        scheduler = Service("pdserve.scheduler", args, log, env=env).start()
    try:
        yield scheduler
    finally:
        scheduler.stop()
