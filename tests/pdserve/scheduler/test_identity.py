"""The principal tokens of contract §1: format, round trip, and refusal of anything not derived from the key."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from pdserve.scheduler.identity import derive_token, principal_of

KEY = "k" * 32


def test_token_format_matches_the_contract() -> None:
    mac = hmac.new(KEY.encode(), b"pdstack-scheduler-principal\0instance:decode-a", hashlib.sha256).hexdigest()
    assert derive_token(KEY, "instance:decode-a") == f"pds1.instance:decode-a.{mac}"


@pytest.mark.parametrize(
    "principal", ["gateway", "instance:prefill-0123456789abcdef01234567", "instance:a", "instance:" + "x" * 119]
)
def test_round_trip(principal: str) -> None:
    assert principal_of(KEY, derive_token(KEY, principal)) == principal


@pytest.mark.parametrize(
    "token",
    [
        "",
        "gateway",
        "pds1.",
        "pds1.gateway",
        "pds1.gateway.",
        "pds1..abc",
        "pds1.gateway." + "0" * 64,
        "pds2.gateway." + "0" * 64,
        derive_token(KEY, "gateway").upper(),
        derive_token(KEY, "gateway") + "0",
        derive_token("another key", "gateway"),
        derive_token(KEY, "gateway").replace("gateway", "gatewaz"),
    ],
)
def test_refuses_tokens_not_derived_from_the_key(token: str) -> None:
    assert principal_of(KEY, token) is None


@pytest.mark.parametrize(
    "principal", ["", "instance:" + "x" * 120, "instance:has space", "instance:slash/no", "instance:ünicode"]
)
def test_refuses_malformed_principals(principal: str) -> None:
    with pytest.raises(ValueError):
        derive_token(KEY, principal)


def test_empty_key_derives_nothing() -> None:
    with pytest.raises(ValueError):
        derive_token("", "gateway")
    assert principal_of("", "pds1.gateway." + "0" * 64) is None


@pytest.mark.parametrize("principal", ["admin", "Admin", "gateway2", "instance:", "root", "scheduler", "a"])
def test_reserved_and_unknown_principals_are_never_derived(principal: str) -> None:
    """Finding 4: only the gateway and instance:<id> are derived principals; a token minted with the right MAC for
    any other name (admin above all) is no principal's."""
    with pytest.raises(ValueError):
        derive_token(KEY, principal)
    mac = hmac.new(KEY.encode(), b"pdstack-scheduler-principal\0" + principal.encode(), hashlib.sha256).hexdigest()
    assert principal_of(KEY, f"pds1.{principal}.{mac}") is None
