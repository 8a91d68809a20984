"""A scheduler process with join on (POST /v1/join, pdserve.scheduler.join), STS being a moto server, and a node's
instance-role credentials from moto: what tests/pdserve/scheduler/test_join.py and the node's bootstrap tests
(tests/pdstack/node) join against.

moto serves sts:AssumeRole and sts:GetCallerIdentity; an instance's role credentials are moto's AssumeRole of a pool's
node role with the instance id as the session name, as EC2 names an instance role's session.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from botocore.credentials import Credentials

from tests.support.motoserver import ACCOUNT
from tests.support.services import Service, identity_key_file, write_secret

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


@contextmanager
def join_scheduler(moto: str, tmp: Path, node_roles: Mapping[str, str], audience: str) -> Iterator[Service]:
    """A scheduler process (in `tmp`: its identity key, identity_key_file(tmp)) admitting joins of `node_roles`
    (role ARN -> component) for `audience`, replaying them to moto as STS."""
    admin = tmp / "admin.token"
    write_secret(admin)
    env = {
        "PDSERVE_JOIN_NODE_ROLES": ",".join(f"{arn}={component}" for arn, component in node_roles.items()),
        "PDSERVE_JOIN_AUDIENCE": audience,
        "PDSERVE_JOIN_STS_URL": moto.rstrip("/") + "/",
    }
    args = ["--state-file", str(tmp / "state.json"), "--admin-token-file", str(admin)]
    args += ["--identity-key-file", str(identity_key_file(tmp)), "--heartbeat-interval", "10"]
    scheduler = Service("pdserve.scheduler", args, tmp / "scheduler.log", env=env).start()
    try:
        yield scheduler
    finally:
        scheduler.stop()
