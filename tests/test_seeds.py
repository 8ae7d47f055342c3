"""Derived sampling seeds: the same parts give the same seed in any process (the gate's
probes and the demo's held-out users compare versions on it), other parts another seed,
and every seed fits the chat API's range."""

from __future__ import annotations

import subprocess
import sys

from liveloop.demo.tool_probe import probe_sampling_seed
from liveloop.seeds import SEED_BITS, derived_seed
from liveloop.trainer.safeguards.probing import probe_seeds


def test_a_seed_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = "from liveloop.seeds import derived_seed; print(derived_seed(7, 'user', [1, 2, 3]))"
    for hash_seed in ("1", "2"):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": hash_seed},
        )
        assert int(done.stdout) == derived_seed(7, "user", [1, 2, 3])


def test_neighbouring_parts_give_unrelated_seeds_within_range() -> None:
    seeds = {derived_seed(run, user, request) for run in range(3) for user in range(3)
             for request in range(20)}  # fmt: skip
    assert len(seeds) == 3 * 3 * 20
    assert all(0 <= s < 2**SEED_BITS for s in seeds)
    assert max(seeds) > 2**32  # the whole range, not a 32-bit corner of it
    assert derived_seed(1, 23) != derived_seed(12, 3)  # parts are kept apart, not joined


def test_the_gate_and_the_weather_probe_draw_apart_for_the_same_run_seed() -> None:
    gate = set(probe_seeds(5, [[1], [2], [3]]))
    weather = {probe_sampling_seed(5, i) for i in range(3)}
    assert len(gate | weather) == 6
    assert probe_seeds(5, [[1], [2]]) == [derived_seed(5, 0, [1]), derived_seed(5, 0, [2])]
