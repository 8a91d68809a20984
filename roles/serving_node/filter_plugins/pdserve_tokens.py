"""`pdserve_principal_token(key, principal)`: a principal's scheduler token, derived on the controller.

The scheduler holds one identity key and recomputes a token's MAC instead of keeping a token list; each node is
handed only the token of its own principal (`instance:<instance_id>` for a model server, `gateway` for a gateway),
so one node cannot register, heartbeat or drain as another. The formula is the hardening contract's §1, the same as
`pdserve.scheduler.identity.derive_token` (tests/roles/test_pdserve_tokens.py checks they agree); it is repeated here
because the controller's Ansible need not have the runtime installed.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from ansible.errors import AnsibleFilterError

_DOMAIN = b"pdstack-scheduler-principal\0"
_PRINCIPAL = re.compile(r"[A-Za-z0-9._:-]{1,128}")
_INSTANCE = "instance:"


def pdserve_principal_token(key: str, principal: str) -> str:
    # The key arrives from a file lookup: trailing whitespace is not part of it (the scheduler strips it too).
    key = str(key).strip()
    principal = str(principal)
    if not key:
        raise AnsibleFilterError("pdserve_principal_token: the identity key is empty")
    # Only the gateway and instances are derived principals: `admin` and any other name are reserved.
    derivable = principal == "gateway" or (principal.startswith(_INSTANCE) and len(principal) > len(_INSTANCE))
    if _PRINCIPAL.fullmatch(principal) is None or not derivable:
        raise AnsibleFilterError(
            f"pdserve_principal_token: principal {principal!r}: must be 'gateway' or {_INSTANCE}<id>, "
            "1..128 characters of [A-Za-z0-9._:-]"
        )
    mac = hmac.new(key.encode(), _DOMAIN + principal.encode(), hashlib.sha256).hexdigest()
    return f"pds1.{principal}.{mac}"


class FilterModule:
    def filters(self) -> dict[str, object]:
        return {"pdserve_principal_token": pdserve_principal_token}
