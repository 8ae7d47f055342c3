"""Sampling seeds named by what a draw is for, so that two versions asked the same thing
answer with the same draws.

The promotion gate's probes, the demo's held-out users and its weather probe all compare
one version's replies with another's. Sampled without a seed, part of any difference
between them would be the draws; with a seed derived from what names the request (the
run's seed, which user, which request, the prompt itself), both versions draw alike, and
what differs is the weights. One derivation serves them all: a hash of the parts, so
neighbouring parts give unrelated seeds and no two uses need ranges kept apart by hand.
"""

from __future__ import annotations

import hashlib

SEED_BITS = 56  # within every engine's range (the chat API takes up to 64 bits)


def derived_seed(*parts: object) -> int:
    """A sampling seed of `SEED_BITS` bits from `parts` (ints, strings, lists of token ids:
    anything whose `repr` names it), the same in every process and run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=SEED_BITS // 8).digest()
    return int.from_bytes(digest, "big")
