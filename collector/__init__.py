"""Collecting loop: turns judged turns into staleness-bounded, token-packed training batches."""
