"""Test support that is not part of the product (CPU stand-ins, SGLang launch helpers)."""
