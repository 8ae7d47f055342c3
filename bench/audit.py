"""Counting what a run lost or did twice, from the streams, the checkpoints and the registry.

Why: after crashes, outages and swaps, "nothing lost, nothing duplicated" must be a count,
not an assumption. Every figure here is read back from what the loops wrote: the turns,
scored, batches and weights streams (XRANGE), the trainer's checkpoints (state and
optimizer step counts) and the registry, and compared with what clients were served.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import redis

from bench.traffic import Served


def entries(client: redis.Redis, stream: str, chunk: int = 2000) -> Iterator[dict[str, Any]]:
    """Every entry's fields of `liveloop:<stream>`, oldest first (read in chunks)."""
    key = stream if stream.startswith("liveloop:") else f"liveloop:{stream}"
    start = "-"
    while True:
        batch: Any = client.xrange(key, min=start, count=chunk)
        for _entry_id, fields in batch:
            yield fields
        if len(batch) < chunk:
            return
        last = batch[-1][0]
        ms, seq = last.split("-")
        start = f"{ms}-{int(seq) + 1}"


def _key(record: dict[str, Any]) -> str:
    return f"{record['session_id']}:{record['turn_index']}:{record.get('sample_index', 0)}"


def audit_turns(client: redis.Redis, served: list[Served]) -> dict[str, Any]:
    """Served turns against `liveloop:turns`: lost, duplicated, out of order per session."""
    return audit_turn_entries(entries(client, "turns"), served)


def audit_turn_entries(recorded: Iterable[dict[str, Any]], served: list[Served]) -> dict[str, Any]:
    """Served turns against the fields of the recorded turn entries, oldest first (the
    stream's, or the retention archive's followed by the stream's)."""
    keys: Counter[str] = Counter()
    order: dict[str, list[int]] = defaultdict(list)
    trainable: list[str] = []
    for fields in recorded:
        record = json.loads(fields["data"])
        key = _key(record)
        keys[key] += 1
        if record.get("sample_index", 0) == 0:
            order[record["session_id"]].append(int(record["turn_index"]))
        if record.get("turn_type", "main") == "main" and record.get("completion_token_ids"):
            trainable.append(key)
    wanted = {s.key for s in served if s.key is not None}
    lost = sorted(wanted - set(keys))
    unordered = [s for s, idx in order.items() if idx != sorted(idx)]
    return {
        "served": len(wanted),
        "recorded": len(keys),
        "lost": len(lost),
        "duplicated": sum(c - 1 for c in keys.values()),
        "sessions_out_of_order": len(unordered),
        "trainable": sorted(set(trainable)),
        "examples_lost": lost[:5],
    }


def audit_judging(client: redis.Redis, trainable: list[str]) -> dict[str, Any]:
    """Each trainable turn in `liveloop:scored` exactly once (dead letters counted apart)."""
    scored: Counter[str] = Counter(_key(json.loads(f["data"])) for f in entries(client, "scored"))
    dead = {
        f.get("turn_key") or _key(json.loads(f["data"]))
        for f in entries(client, "turns:dlq")
        if "data" in f
    }
    unjudged = [k for k in trainable if scored[k] == 0 and k not in dead]
    return {
        "trainable": len(trainable),
        "judged_once": sum(1 for k in trainable if scored[k] == 1),
        "judged_twice_or_more": sum(1 for k in trainable if scored[k] > 1),
        "unjudged": len(unjudged),
        "dead_lettered": len(dead),
        "examples_unjudged": unjudged[:5],
    }


def batch_samples(fields: dict[str, Any], data_dir: Path, archive: Path | None) -> list[str] | None:
    """Turn keys of one batch entry (inline, its file, or the run's copy of it); None if gone."""
    batch = json.loads(fields["data"])
    if batch.get("samples") is not None:
        return [s["key"] for s in batch["samples"]]
    for path in (
        data_dir / str(batch.get("path")),
        (archive or data_dir) / Path(batch["path"]).name,
    ):
        if path.is_file():
            return [s["key"] for s in json.loads(path.read_bytes())["samples"]]
    return None


def audit_batches(client: redis.Redis, data_dir: Path, archive: Path | None) -> dict[str, Any]:
    """Every turn in at most one batch; every batch id published once."""
    ids: Counter[str] = Counter()
    keys: Counter[str] = Counter()
    unreadable = 0
    for fields in entries(client, "batches"):
        ids[fields.get("batch_id", "")] += 1
        samples = batch_samples(fields, data_dir, archive)
        if samples is None:
            unreadable += 1
            continue
        keys.update(samples)
    return {
        "batches": sum(ids.values()),
        "batched_turns": len(keys),
        "turns_in_two_batches": sum(1 for c in keys.values() if c > 1),
        "batch_ids_twice": sum(1 for c in ids.values() if c > 1),
        "batches_unreadable": unreadable,
        "batch_ids": sorted(ids),
    }


def optimizer_steps(checkpoint: Path) -> int | None:
    """The optimizer's step count saved with a checkpoint (None without optimizer state)."""
    import torch

    path = checkpoint / "trainer_state" / "optimizer.pt"
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)["state"]
    steps = {int(float(s["step"])) for s in state.values() if "step" in s}
    return max(steps) if steps else 0


def audit_trainer(
    client: redis.Redis, checkpoints_dir: Path, batch_ids: list[str], minibatches: int = 1
) -> dict[str, Any]:
    """No batch trained twice, versions never backwards, optimizer state carried over."""
    announced = [int(json.loads(f["data"])["version"]) for f in entries(client, "weights")]
    backwards = sum(1 for a, b in itertools.pairwise(announced) if b < a)
    kept = sorted(
        int(p.name[1:])
        for p in checkpoints_dir.glob("v*")
        if p.name[1:].isdigit() and (p / "trainer_state" / "state.json").is_file()
    )
    applied: list[str] = []
    steps_ok = True
    for version in kept:
        state = json.loads((checkpoints_dir / f"v{version}/trainer_state/state.json").read_text())
        applied = state["applied_batches"]
        steps = optimizer_steps(checkpoints_dir / f"v{version}")
        steps_ok &= steps == version * minibatches  # a fresh optimizer would restart at 1
    newest = kept[-1] if kept else 0
    published = set(batch_ids)
    return {
        "versions": newest,
        "announcements": len(announced),
        "versions_backwards": backwards,
        "batches_trained": len(applied),
        "batches_trained_twice": len(applied) - len(set(applied)),
        "trained_but_never_published": len(set(applied) - published),
        "one_batch_per_version": newest == len(applied),
        "optimizer_steps_continuous": steps_ok and bool(kept),
        "leftover_partial_checkpoints": len(list(checkpoints_dir.glob(".v*.tmp-*"))),
    }
