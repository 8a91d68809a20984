"""What every pdserve component shares: one log schema (logs) and OpenTelemetry tracing (tracing)."""
