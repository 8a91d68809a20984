"""Canary analysis: judge a canary against its baseline from Prometheus, and check golden outputs."""
