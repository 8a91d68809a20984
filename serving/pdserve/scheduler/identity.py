"""Per-principal scheduler tokens, derived from one identity key (hardening contract §1).

    token = derive_token(key, "instance:decode-0123")   # "pds1.instance:decode-0123.<hex mac>"
    principal_of(key, token)                           # "instance:decode-0123", or None

Each node holds only its own token, so one node cannot register, heartbeat or drain as another; the scheduler
holds the key and recomputes the MAC instead of keeping a token list.
"""

from __future__ import annotations

import hashlib
import hmac
import re

PREFIX = "pds1."
GATEWAY = "gateway"
INSTANCE_PREFIX = "instance:"
_DOMAIN = b"pdstack-scheduler-principal\0"
_PRINCIPAL = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_MAC = re.compile(r"[0-9a-f]{64}")


def instance_principal(instance_id: str) -> str:
    return f"{INSTANCE_PREFIX}{instance_id}"


def valid_principal(principal: str) -> bool:
    """A name a token may be derived for: the gateway, or one instance. Anything else (`admin` above all) is
    reserved, so that no derived token can stand for the admin token or a principal nobody was meant to hold."""
    if _PRINCIPAL.fullmatch(principal) is None:
        return False
    return principal == GATEWAY or (principal.startswith(INSTANCE_PREFIX) and len(principal) > len(INSTANCE_PREFIX))


def derive_token(key: str, principal: str) -> str:
    """The bearer token of `principal`; ValueError when the key is empty or the principal malformed."""
    if not key:
        raise ValueError("identity key is empty")
    if not valid_principal(principal):
        raise ValueError(
            f"principal {principal!r}: must be {GATEWAY!r} or {INSTANCE_PREFIX}<id>, "
            "1..128 characters of [A-Za-z0-9._:-]"
        )
    return PREFIX + principal + "." + _mac(key, principal)


def principal_of(key: str, token: str) -> str | None:
    """The principal `token` was derived for under `key`; None when it is malformed or its MAC is wrong."""
    if not key or not token.startswith(PREFIX):
        return None
    principal, dot, mac = token[len(PREFIX) :].rpartition(".")
    if not dot or not valid_principal(principal) or _MAC.fullmatch(mac) is None:
        return None
    if not hmac.compare_digest(mac, _mac(key, principal)):
        return None
    return principal


def _mac(key: str, principal: str) -> str:
    return hmac.new(key.encode(), _DOMAIN + principal.encode(), hashlib.sha256).hexdigest()
