"""An OpenAI-compatible HTTP server (`tokenwise serve`): completions, chat completions, models,
health and Prometheus metrics over one engine thread.

This package's `__init__` imports nothing, so the CLI can register `serve` without loading
FastAPI; import `tokenwise.entrypoints.openai.api_server` for the app.
"""
