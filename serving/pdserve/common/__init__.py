"""What every pdserve component shares: one settings loader (settings), one log schema (logs), OpenTelemetry tracing
(tracing), the HTTP listeners' and clients' TLS (tls), the KV channel's TLS contexts (kv_tls) and the probe routes
(routes)."""
