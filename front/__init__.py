"""OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""
