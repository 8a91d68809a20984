"""Phase `registry`: credentials for every registry the release's images come from, from ECR's token API through
the instance role, written as the containers auth file podman reads (REGISTRY_AUTH_FILE, where roles/container_runtime
points it).

ECR answers GetAuthorizationToken with base64 `AWS:<password>`, valid 12 hours for the registries of the region it
was asked in: one token per region of the images' ECR hosts. A registry that is not ECR's (the local environment's)
is given the token of the control region: the local registry accepts exactly that credential and refuses anonymous
pulls, as ECR does. The file is merged with the entries of other registries already in it and replaced whole (0600).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pdstack.node.files import write_atomic
from pdstack.node.loader import BootstrapError, Phase

ECR_HOST = re.compile(r"^\d{12}\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(\.cn)?$")


def token_region(host: str, control_region: str) -> str:
    match = ECR_HOST.match(host)
    return match["region"] if match else control_region


def _credential(ecr: Any, region: str) -> tuple[str, str]:
    """(user, password) from ECR's token in `region`."""
    try:
        data = ecr.get_authorization_token()["authorizationData"][0]
    except Exception as exc:
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", type(exc).__name__)
        raise BootstrapError(Phase.REGISTRY, f"ECR refused a registry credential in {region}: {code}") from None
    try:
        user, _, password = base64.b64decode(data["authorizationToken"], validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError, KeyError):
        raise BootstrapError(Phase.REGISTRY, f"ECR's token in {region} is not base64 of user:password") from None
    if not user or not password:
        raise BootstrapError(Phase.REGISTRY, f"ECR's token in {region} is not base64 of user:password")
    return user, password


def registry_auths(hosts: Iterable[str], control_region: str, ecr_in: Callable[[str], Any]) -> dict[str, str]:
    """Each registry host's `auth` entry (base64 of user:password), one token request per region."""
    by_region: dict[str, tuple[str, str]] = {}
    auths = {}
    for host in sorted(set(hosts)):
        region = token_region(host, control_region)
        if region not in by_region:
            by_region[region] = _credential(ecr_in(region), region)
        user, password = by_region[region]
        auths[host] = base64.b64encode(f"{user}:{password}".encode()).decode()
    return auths


def write_auth_file(path: Path, auths: dict[str, str]) -> None:
    """podman's auth file ({"auths": {host: {"auth": ...}}}), keeping other registries' entries already in it."""
    try:
        current = json.loads(path.read_text(encoding="utf-8"))
        entries = dict(current.get("auths", {})) if isinstance(current, dict) else {}
    except (OSError, ValueError):
        entries = {}
    entries.update({host: {"auth": auth} for host, auth in auths.items()})
    write_atomic(path, (json.dumps({"auths": entries}, indent=2, sort_keys=True) + "\n").encode(), 0o600)
