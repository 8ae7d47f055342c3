"""Faults end to end on real processes: the scenarios of bench/faults.py, run shorter.

Every figure asserted here is counted from the streams, the checkpoints and the registry
(bench/audit.py), against what the simulated clients were actually served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.fault_clients import LIMITS, run_slow_clients
from bench.fault_kills import run_campaign
from bench.fault_outages import run_redis_outage, run_server_crash
from bench.fault_swaps import run_swaps_under_load

pytestmark = pytest.mark.slow


# The campaign's own limits (start-up, at most 300 s of traffic, at most 180 s of drain,
# the stop) stay inside this timeout, so a slow run fails on what it counted, not on time.
@pytest.mark.timeout(720)
def test_loops_killed_20_times_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """Judge, collector and trainer SIGKILLed at least 20 times while agents are served
    (some kills in the middle of a checkpoint write, some of a batch write)."""
    r = run_campaign(tmp_path, seconds=30, min_kills=20, max_seconds=300, drain_timeout_s=180)
    print(r)
    assert r["loops_left_frozen"] == [], r  # every freeze ended in a kill
    assert r["kills"] >= 20, r
    assert r["kills_during_checkpoint_write"] >= 1 and r["kills_during_batch_write"] >= 1, r
    assert r["requests_failed"] == 0, r  # serving never noticed
    turns, judging, batches, trainer = r["turns"], r["judging"], r["batches"], r["trainer"]
    assert turns["lost"] == turns["duplicated"] == turns["sessions_out_of_order"] == 0, turns
    # every trainable served turn judged exactly once and sits in exactly one batch
    assert judging["judged_once"] == judging["trainable"] == turns["served"] > 0, judging
    assert judging["unjudged"] == judging["judged_twice_or_more"] == 0, judging
    assert batches["batched_turns"] == judging["judged_once"], batches
    assert batches["turns_in_two_batches"] == batches["batch_ids_twice"] == 0, batches
    assert batches["batches_unreadable"] == 0, batches
    # no batch trained twice, one version per batch, never backwards, optimizer carried over
    assert trainer["batches_trained_twice"] == 0 and trainer["one_batch_per_version"], trainer
    assert trainer["batches_trained"] == batches["batches"], (trainer, batches)
    assert trainer["versions_backwards"] == 0, trainer
    assert trainer["optimizer_steps_continuous"], trainer
    assert trainer["restarts_resumed_from_checkpoint"] >= 1, trainer
    assert trainer["leftover_partial_checkpoints"] == 0, trainer
    # the reward baselines survived every collector restart: they hold every judged score
    # (a turn whose batch write was cut short is folded in again when it comes back)
    assert r["baseline_scores_folded"] >= judging["judged_once"], r
    assert r["lost"] == r["duplicated"] == 0, r


def test_server_killed_mid_stream_while_redis_is_down(tmp_path: Path) -> None:
    """Replies served while Redis is down sit in the spool; the server is SIGKILLed in the
    middle of a stream and its spool gets a garbled tail; after a restart every completed
    turn is in the stream once, and the bad tail is quarantined and counted."""
    r = run_server_crash(tmp_path, seconds=3.0)
    print(r)
    assert r["completed_while_redis_down"] > 0 and r["chunks_before_kill"] >= 20, r
    assert r["spooled_before_kill"] >= r["completed_while_redis_down"], r
    assert r["replayed"] == r["spooled_before_kill"], r
    assert (r["quarantined"], r["torn_tails"]) == (1, 1), r
    assert r["lost"] == r["duplicated"] == r["sessions_out_of_order"] == 0, r
    assert r["turns_served"] > r["completed_while_redis_down"], r  # turns from before, too


def test_redis_outage_back_from_aof_and_back_empty(tmp_path: Path) -> None:
    """Redis stopped under steady load, once restarted from its AOF and once empty: no
    request fails, every turn reaches the stream in order once, the loops carry on."""
    loops = ("serve", "judge", "collect", "train")
    results = run_redis_outage(tmp_path, outage_s=3.0, modes=("aof", "empty"), loops=loops)
    print(results)
    for r in results:
        assert r["requests_during_outage"] > 0 and r["failed"] == 0, r
        assert r["turns_lost"] == r["duplicated"] == r["sessions_out_of_order"] == 0, r
        assert r["turns_counted"] > 0 and r["unjudged"] == 0, r
        groups = {"turns": ["prm"], "scored": ["collector"], "batches": ["trainer"]}
        assert r["consumer_groups"] == groups, r
        assert r["exit_codes"]["judge"] == r["exit_codes"]["collect"] == 0, r  # never died
        assert r["exit_codes"]["train"] == 0, r
    assert results[1]["scenario"] == "redis_outage_empty"


def test_200_streams_across_10_swaps_and_4_corrupt_checkpoints(tmp_path: Path) -> None:
    r = run_swaps_under_load(tmp_path, streams=200, swaps=10, max_tokens=48)
    print(r)
    assert r["failed"] == 0 and r["records"] == r["requests"] >= 200, r
    assert (r["swaps_ok"], r["refused"], r["refused_in_admin"]) == (10, 4, 4), r
    assert sorted(r["refusals_listed"]) == [
        "model.safetensors",  # the missing file
        "nans.safetensors",
        "shapes.safetensors",
        "truncated.safetensors",
    ]
    assert r["served_version_after"] == 14, r
    assert r["records_versions_backwards"] == 0, r
    assert r["records_spanning_a_swap"] > 0, r
    assert r["streams_open_at_last_swap"] == 200, r  # every swap happened under full load


def test_slow_and_broken_clients_are_bounded(tmp_path: Path) -> None:
    r: dict[str, Any] = run_slow_clients(tmp_path, requests=10, disconnects=10, readers=4)
    print(r)
    bound = LIMITS["request_read_timeout_s"] + 10.0  # the limit, plus a loaded machine's lag
    assert r["idle_closed"] == 50 and r["idle_closed_within_s"] < bound, r
    assert r["slowloris_closed"] == 10 and r["slowloris_closed_within_s"] < bound, r
    assert r["connections_closed_by_limits"]["read_timeout"] >= 60, r
    assert r["aborted_records"] >= r["disconnects"], r  # slow readers may read to the end
    assert r["engine_slots_free_after_s"] is not None, r
    assert r["server_rss_mb"]["after"] - r["server_rss_mb"]["before"] < 200, r
