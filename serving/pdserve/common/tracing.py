"""OpenTelemetry tracing for every pdserve component, off unless an OTLP/HTTP endpoint is set.

With `otlp_traces_endpoint` set, a component exports its spans over OTLP/HTTP (protobuf) to that URL, puts a
server span around every HTTP request it answers (the ASGI instrumentation, which reads W3C `traceparent`) and
instruments every httpx client, so `traceparent` goes out on every call it makes: gateway -> scheduler, prefill and
decode; servers and agent -> scheduler. A trace starts only where a component answers a request (a server span
without a sampled parent, kept at `trace_sample_ratio`); background calls (routing polls, heartbeats) carry an
unsampled `traceparent` and export nothing. Spans hold no prompt text unless `trace_prompts` says so.

The SDK, the exporter and the instrumentations are imported only when tracing is on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from pydantic import BaseModel, Field

log = logging.getLogger(__name__)
UNTRACED_PATHS = "/health,/metrics"  # probes and scrapes: no spans (a comma-separated list of regexes)
_state: dict[str, Any] = {"provider": None}


class TracingSettings(BaseModel):
    """The tracing fields every component's settings carry (PDSERVE_OTLP_TRACES_ENDPOINT, ...)."""

    otlp_traces_endpoint: str | None = Field(
        None,
        pattern=r"^https?://[^/\s?#@]+(/[^\s?#]*)?$",
        description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; unset, nothing is traced",
    )
    trace_sample_ratio: float = Field(1.0, gt=0, le=1, description="share of requests whose trace is kept")
    trace_prompts: bool = Field(False, description="put prompt text in the gateway's request span (debugging only)")


def tracer() -> trace.Tracer:
    return trace.get_tracer("pdserve")


def tracing_on() -> bool:
    return _state["provider"] is not None


def configure_tracing(component: str, settings: TracingSettings, attributes: dict[str, str] | None = None) -> bool:
    """Install the process's tracer provider and instrument httpx; False (and nothing done) without an endpoint."""
    if settings.otlp_traces_endpoint is None:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
        from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware  # noqa: F401, PLC0415
        from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor  # noqa: PLC0415
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit(
            f"pdserve {component}: otlp_traces_endpoint is set but this environment lacks {exc.name} "
            "(serving/pyproject.toml pins the OpenTelemetry packages tracing needs)"
        ) from None

    resource = Resource.create(
        {"service.name": f"pdserve-{component}", "pdserve.component": component, **(attributes or {})}
    )
    provider = TracerProvider(resource=resource, sampler=_sampler(settings.trace_sample_ratio))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_traces_endpoint)))
    trace.set_tracer_provider(provider)
    _state["provider"] = provider
    HTTPXClientInstrumentor().instrument(tracer_provider=provider)
    log.info(
        "tracing on",
        extra={
            "otlp_traces_endpoint": settings.otlp_traces_endpoint,
            "trace_sample_ratio": settings.trace_sample_ratio,
        },
    )
    return True


def instrument_app(app: Any, excluded: Sequence[str] = ()) -> Any:
    """`app` inside a server span per request (outermost, so every log line of the request has its ids);
    unchanged with tracing off."""
    if not tracing_on():
        return app
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware  # noqa: PLC0415

    # No span per ASGI send/receive: a streamed completion would get one per token.
    return OpenTelemetryMiddleware(
        app,
        excluded_urls=",".join([UNTRACED_PATHS, *excluded]),
        exclude_spans=["receive", "send"],
        tracer_provider=_state["provider"],
    )


def shutdown_tracing() -> None:
    """Export what is buffered (on exit; the SDK also does it at interpreter exit)."""
    provider = _state["provider"]
    if provider is not None:
        provider.shutdown()


def _sampler(ratio: float) -> Any:
    from opentelemetry.sdk.trace.sampling import (  # noqa: PLC0415
        Decision,
        ParentBased,
        Sampler,
        SamplingResult,
        TraceIdRatioBased,
    )

    by_ratio = TraceIdRatioBased(ratio)

    class RequestRoots(Sampler):
        """Roots only at a request a component answers: a client call with no request behind it is not kept."""

        def should_sample(  # noqa: PLR0917  (the SDK calls it positionally)
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if kind is not trace.SpanKind.SERVER:
                return SamplingResult(Decision.DROP)
            return by_ratio.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return f"RequestRoots({ratio})"

    return ParentBased(root=RequestRoots())
