"""Serving loop: the OpenAI-compatible HTTP server, its engines, and trace capture."""
