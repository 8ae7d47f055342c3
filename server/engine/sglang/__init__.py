"""The SGLang engine: the server as a token-exact gateway in front of SGLang servers.

Torch-free on purpose: with `server.engine = "sglang"` the HTTP server's process never
imports torch. See `engine.py` for the parts and how they fit.
"""

from liveloop.server.engine.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine"]
