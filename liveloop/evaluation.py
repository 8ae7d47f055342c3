"""`liveloop eval`: each policy version's quality as the platform measured it.

Prints, per version: whether it was served or refused by the promotion gate, and its
quality on the traffic it served (mean judged reward, share the judges could not score,
reply words, distinct-2, reference NLL per token, KL to the reference) and on the gate's
probes (reward, reference NLL, topic rate). `--tenant KEY_ID` keeps one tenant's adapter
versions (tenant scope), beside version 0, the base it is compared with, measured on that
tenant's served traffic alone. `--version V` (or `--held-out`) then also
replays held-out simulated users against one version (`liveloop.demo.heldout.run_eval`).
"""

from __future__ import annotations

import json
from typing import Any

from liveloop.registry import Registry

COLUMNS = (
    ("version", "version", ""),
    ("status", "status", ""),
    ("judged", "served.judged", "d"),
    ("reward", "served.mean_reward", "+.3f"),
    ("unscored", "served.unscored_share", ".0%"),
    ("words", "served.mean_reply_words", ".1f"),
    ("distinct-2", "served.distinct_2", ".2f"),
    ("ref-NLL", "served.ref_nll", ".2f"),
    ("KL-ref", "served.kl_ref", ".3f"),
    ("probe-reward", "probe.reward", "+.3f"),
    ("probe-NLL", "probe.ref_nll", ".2f"),
    ("probe-topic", "probe.topic_rate", ".0%"),
)


def quality_rows(db_url: str, tenant: str | None = None) -> list[dict[str, Any]]:
    """One row per version known to the registry: status, served and probe measures
    (with `tenant`, that tenant's versions only, and version 0 on its traffic)."""
    with Registry.open(db_url) as registry:
        stored = {q.version: q for q in registry.version_quality(tenant)}
        infos = {v.version: v for v in registry.list_model_versions(limit=100_000, tenant=tenant)}
    versions = set(stored) | set(infos)
    if tenant is not None:
        if not versions - {0}:
            return []
        versions.add(0)
    rows = []
    for version in sorted(versions):
        info, quality = infos.get(version), stored.get(version)
        probe = (quality.probe if quality else None) or {}
        status = info.status if info else probe.get("status")
        rows.append(
            {
                "version": version,
                "status": status or ("base" if version == 0 else "-"),
                "reason": info.reason if info else probe.get("reason"),
                "served": quality.served if quality else None,
                "probe": quality.probe if quality else None,
            }
        )
    return rows


def _cell(row: dict[str, Any], path: str, spec: str) -> str:
    value: Any = row
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows as an aligned text table (reasons for refusals and rollbacks under it)."""
    if not rows:
        return "no policy versions recorded yet"
    cells = [[name for name, _p, _s in COLUMNS]]
    cells += [[_cell(row, path, spec) for _n, path, spec in COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    said = {"rejected": "refused", "rolled_back": "rolled back"}
    lines += [
        f"v{r['version']} {said[r['status']]}: {r['reason']}" for r in rows if r["status"] in said
    ]
    return "\n".join(lines)


def print_quality(db_url: str, *, as_json: bool = False, tenant: str | None = None) -> None:
    """Print every version's quality, or one tenant's (a table, or JSON)."""
    rows = quality_rows(db_url, tenant)
    if as_json:
        print(json.dumps({"tenant": tenant, "versions": rows} if tenant else {"versions": rows},
                         indent=2))  # fmt: skip
    elif tenant is not None and not rows:
        print(f"no policy versions recorded for tenant {tenant}")
    else:
        print(format_table(rows))
