"""The environment's secrets: generated (pulumi-random), stored in Secrets Manager under the environment's KMS
key, and handed on only as secret Outputs, so no value is ever printed or stored in plain text in the state."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_random as random

from infra.encryption import ManagedKey, ManagedKeyArgs
from infra.protection import stateful
from pdstack.contract.components import secret_name
from pdstack.model import Secret

SECRET_LENGTH = 48
DAY_S = 86400


def rotation_period(rotation_days: int, now_s: float | None = None) -> int:
    """Index of the rotation period we are in: it changes every `rotation_days`, and with it the generated value,
    so the first `pulumi up` after the period ends rotates the secret (the nightly preview shows it pending)."""
    return int((time.time() if now_s is None else now_s) // (rotation_days * DAY_S))


def _as_secret(value: pulumi.Output[str]) -> pulumi.Output[str]:
    return value.apply(pulumi.Output.secret)


def derive_token(key: str, principal: str) -> str:
    """The scheduler's bearer token of `principal` under its identity key (hardening contract §1; the same formula
    as pdserve.scheduler.identity and roles/serving_node/filter_plugins)."""
    mac = hmac.new(key.encode(), b"pdstack-scheduler-principal\0" + principal.encode(), hashlib.sha256).hexdigest()
    return f"pds1.{principal}.{mac}"


@dataclass(frozen=True)
class EnvironmentSecretsArgs:
    env: str
    specs: Sequence[Secret]
    account_id: pulumi.Input[str]
    tags: Mapping[str, str]
    recovery_window_days: int = 30


class EnvironmentSecrets(pulumi.ComponentResource):
    key: ManagedKey
    arns: dict[str, pulumi.Output[str]]
    values: dict[str, pulumi.Output[str]]  # every one a secret Output

    def __init__(self, name: str, args: EnvironmentSecretsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("pdstack:secrets:EnvironmentSecrets", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        self.key = ManagedKey(
            f"{name}-key",
            ManagedKeyArgs(
                description=f"pdstack {args.env}: secrets and Kubernetes secret envelopes",
                alias=f"pdstack-{args.env}-secrets",
                account_id=args.account_id,
                tags=args.tags,
                allow_autoscaling=False,
            ),
            opts=child,
        )
        self.arns, self.values = {}, {}
        for spec in args.specs:
            generated = random.RandomPassword(
                f"{name}-{spec.name}",
                length=SECRET_LENGTH,
                special=False,
                keepers={"rotation_period": str(rotation_period(spec.rotation_days))},
                opts=child,
            )
            value = _as_secret(generated.result)
            stored = aws.secretsmanager.Secret(
                f"{name}-{spec.name}",
                name=secret_name(args.env, spec.name),
                description=f"pdstack {args.env} {spec.name}; rotated every {spec.rotation_days} days by pulumi up",
                kms_key_id=self.key.key.arn,
                recovery_window_in_days=args.recovery_window_days,
                tags={**args.tags, "pdstack:rotation-days": str(spec.rotation_days)},
                opts=stateful(child, retain=True),
            )
            aws.secretsmanager.SecretVersion(
                f"{name}-{spec.name}",
                secret_id=stored.id,
                secret_string=value,
                opts=pulumi.ResourceOptions(parent=stored),
            )
            self.arns[spec.name] = stored.arn
            self.values[spec.name] = value
        self.register_outputs({"arns": self.arns, "values": pulumi.Output.secret(self.values)})

    def principal_token(self, principal: str) -> pulumi.Output[str]:
        """A principal's scheduler token derived from the identity key, as a secret Output (never stored apart)."""
        return _as_secret(self.values["scheduler-identity-key"].apply(lambda key: derive_token(key, principal)))
