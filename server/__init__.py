"""OpenAI-compatible HTTP API (Starlette) over the orchestrator scheduler."""
