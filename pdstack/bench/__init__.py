"""`pdstack bench`: an open-loop load generator for OpenAI-compatible endpoints."""
