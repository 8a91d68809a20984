"""The environment-wide sections beside serving, set once in the control-plane stack: the canary's steps and
thresholds, the secrets the runtime reads, the capacity the planner sizes for, and where alerts go (with the check
every URL in the model goes through)."""

from __future__ import annotations

import itertools
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from pdstack.model.base import Name, Percent, Seconds, Strict


class CanaryThresholds(Strict):
    success_rate_min_pct: Percent = 99.0
    ttft_p95_max_ratio: float = Field(default=1.2, ge=1.0, description="canary TTFT p95 over baseline's, at most")
    itl_p95_max_ratio: float = Field(default=1.2, ge=1.0, description="canary inter-token p95 over baseline's, at most")
    kv_transfer_failures_max: int = Field(default=0, ge=0)
    confidence: float = Field(default=0.98, gt=0.5, lt=1.0, description="Mann-Whitney test confidence")


class Canary(Strict):
    steps_pct: list[Annotated[int, Field(gt=0, le=100)]] = Field(default_factory=lambda: [5, 25, 50, 100], min_length=1)
    interval_s: Seconds = 60.0
    min_samples: int = Field(default=50, ge=1)
    warmup_s: float = Field(
        default=60.0,
        ge=0,
        le=3600,
        description="unjudged traffic at the first step's weight before the first judged interval (0: none)",
    )
    failure_limit: int = Field(
        default=2, ge=1, description="failed judgements in a row at one step before a rollback (a pass ends the step)"
    )
    thresholds: CanaryThresholds = CanaryThresholds()

    @model_validator(mode="after")
    def _steps_rise_to_full(self) -> Canary:
        steps = self.steps_pct
        if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 100:
            raise ValueError(f"steps_pct must rise strictly and end at 100, got {steps}")
        return self


class Secret(Strict):
    name: Name
    rotation_days: int = Field(default=90, ge=1, le=365)


REQUIRED_SECRETS = (
    "gateway-api-keys",
    "kv-channel-key",
    "scheduler-admin-token",
    "scheduler-identity-key",
    "server-api-token",
    "ratelimit-store-password",
    "metrics-scrape-token",
)
"""What the serving runtime reads: gateway API keys, the KV channel's HMAC key, the scheduler's admin token
(weights), its identity key (each server and the gateway get a token derived from it for their own principal, so
one node cannot act as another), the token prefill and decode require of every caller (the gateway presents it),
the password of the rate-limit store the gateway replicas share, and the token the gateway's /metrics requires
(Prometheus presents it)."""

RETIRED_SECRETS = {
    "scheduler-instance-token": "the scheduler derives each server's own token from scheduler-identity-key; one "
    "token shared by every node let any node act as another",
}
"""Names the runtime no longer reads, and why: a stack still listing one would keep generating and storing it."""


def default_secrets() -> list[Secret]:
    return [Secret(name=name) for name in REQUIRED_SECRETS]


class Capacity(Strict):
    """The workload the environment is sized for; the planner turns it into node counts."""

    requests_per_second: float = Field(gt=0)
    mean_input_tokens: int = Field(gt=0)
    mean_output_tokens: int = Field(gt=0)
    ttft_slo_ms: float = Field(gt=0)
    tpot_slo_ms: float = Field(gt=0)
    headroom_pct: float = Field(ge=20, le=30, description="spare capacity over the target, 20-30 %")


class PulumiSecret(Strict):
    """A value Pulumi encrypted into the stack file (`pulumi config set --secret --path KEY VALUE` writes
    `{secure: <ciphertext>}`). pdstack sees only the ciphertext; `pulumi up` decrypts it into a secret Output."""

    secure: str = Field(min_length=1, description="ciphertext written by pulumi config set --secret")


WEBHOOK_URL_MAX = 2048


def webhook_url_problem(url: str, secret: bool) -> str | None:
    """Why `url` cannot be Alertmanager's webhook, or None. A URL in plain text must carry no credential (no
    user:password@, no query string): one that does belongs in a Pulumi secret, where `secret` is True."""
    if len(url) > WEBHOOK_URL_MAX:
        return f"is {len(url)} characters long, at most {WEBHOOK_URL_MAX}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL: {exc}"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {url if not secret else '(secret)'}"
    if port == 0:
        return "has port 0"
    if not secret and (parts.username is not None or parts.password is not None or parts.query or parts.fragment):
        return (
            "carries a credential (user:password@, a query string or a fragment) in plain text: store it as a "
            "secret, `pulumi config set --secret --path pdstack:alerting.webhook_url URL`"
        )
    return None


class Alerting(Strict):
    """Where Alertmanager delivers the environment's alerts (pdstack/contract/alerting.py). Without a webhook every
    alert still reaches Alertmanager, where it is listed and can be silenced, and is sent nowhere."""

    webhook_url: str | PulumiSecret | None = Field(
        default=None, description="http(s) URL receiving Alertmanager's webhook; a Pulumi secret if it holds a token"
    )

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, url: str | PulumiSecret | None) -> str | PulumiSecret | None:
        problem = webhook_url_problem(url, secret=False) if isinstance(url, str) else None
        if problem is not None:
            raise ValueError(f"the URL {problem}")
        return url
