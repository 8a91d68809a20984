"""/etc/pdstack/node.json: what a GPU node knows of itself before it asks anything, written by its user data.

Everything in it follows from the stack files (pdstack/node/userdata.py renders it for one pool of one stack), so the
launch templates of an environment differ only in it, and the local environment's nodes get the same document with
one more value: `aws_endpoint_url`, the local AWS APIs (moto), None in the cloud. It names secrets and parameters,
never holds one. The instance's own identity (its id) comes from cloud-init at boot, not from here: one launch
template serves every instance of a pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdstack.model import Environment
from pdstack.model.base import Name
from pdstack.node.loader import SHA256, SSM_AGENT_VERSION


class SsmAgentPin(BaseModel):
    """The SSM agent a cloud node installs (pdstack/node/loader.py): AWS's .deb of this version, this sha256 or
    nothing (pdstack-infra:ssm_agent_version and ssm_agent_sha256, docs/cloud.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str = Field(pattern=SSM_AGENT_VERSION.pattern, description="e.g. 3.3.1802.0")
    sha256: str = Field(pattern=SHA256.pattern, description="of amazon-ssm-agent.deb (debian_amd64) of that version")


class NodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    environment: Environment
    datacenter: Name
    region: str = Field(description="the datacenter's region: an AWS region, or `local`")
    aws_region: str = Field(description="where the node's own AWS APIs are: its model bucket, its Auto Scaling group")
    control_region: str = Field(description="where the environment's release record, secrets and images are")
    pool: Name
    role: Literal["prefill", "decode"]
    release_parameter: str = Field(pattern=r"^/")
    secrets: dict[str, str] = Field(description="stack secret -> its Secrets Manager name, those the node reads")
    tls_secret: str = Field(description="the Secrets Manager name of the pool's certificate, key and CA")
    model_dir: str = Field(pattern=r"^/", description="where the model's files go on the node's disk")
    aws_endpoint_url: str | None = Field(default=None, description="the local environment's AWS (moto); None: AWS")
    ssm_agent: SsmAgentPin | None = Field(
        default=None, description="the SSM agent a cloud node installs; None locally (no SSM agent to run there)"
    )

    def to_json(self) -> str:
        return self.model_dump_json(indent=2) + "\n"


def load_node_config(path: Path) -> NodeConfig:
    return NodeConfig.model_validate_json(path.read_text(encoding="utf-8"))
