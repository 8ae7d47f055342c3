"""OpenAI-compatible chat completions: protocol models, serving class, SSE streaming."""
