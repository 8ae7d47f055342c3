"""The tenants demo's runs, kept and compared: one result file per run, and their spread.

One `liveloop demo --tenants 3` run is one draw of a noisy measure: a window of 64 judged
turns moves by about 0.1 from sampling alone, so whether tenant scope beat shared scope by
the target's margin is a question about many runs, not one. Two commands:

- `wrap DEMO_DIR`: the run's `report.json` with where it came from (date, commit, machine,
  the demo's command, wall minutes, a note), as a file for `bench/results/`;
- `summary [FILES]`: per run and over all of them, each conflicting tenant's gain difference
  (tenant scope minus shared scope), how many runs had both tenants ahead by the margin and
  how many met the target (ahead, with every quality check kept and isolation passed),
  and per conflicting tenant and scope how each reaction's share of the users' replies moved
  from the first window to the last (`reaction_shifts`): which complaints each scope cured,
  those every tenant's users make (an answer off the topic) or those of one tenant only (a
  reply too long, an opening without the topic). Prints JSON. `--min-tenant-turns N` keeps
  the runs whose tenant scope judged N turns or more: the demo paces its users by the
  trainer, so a slow machine makes fewer turns and fewer versions, and the runs are read
  by pace as well as all together.

    python -m bench.tenant_demos wrap run/.liveloop/demo --command "liveloop demo --tenants 3" \
        --note "..." --out bench/results/demo-DATE-tenants-....json
    python -m bench.tenant_demos summary --match brief20
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from bench.learning_summary import provenance, spread

RESULTS = Path(__file__).resolve().parent / "results"
PATTERN = "demo-*-tenants-*.json"
CONFLICTING = ("brief", "explained")


def wrap(
    demo_dir: Path, command: str, note: str, wall_minutes: float | None, commit: str | None = None
) -> dict[str, Any]:
    """A demo run's report with its provenance, in the layout of `bench/results/` (the
    commit it ran on: `commit`, or this checkout's)."""
    report = json.loads((demo_dir / "report.json").read_text())
    made = provenance()
    return {
        **made,
        "commit": commit or made["commit"],
        "command": command,
        "note": note,
        "wall_minutes": wall_minutes,
        "report": report,
    }


def _seed(command: str) -> int | None:
    found = re.search(r"LIVELOOP_DEMO__SEED=(\d+)", command)
    return int(found.group(1)) if found else None


def run_row(name: str, result: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: per conflicting tenant the gains in both scopes and their
    difference, and the run's verdict on the target."""
    report = result.get("report", result)
    headline = report["headline"]
    conflicting = [row for row in report["matrix"] if row["style"] in CONFLICTING]
    tenants: dict[str, Any] = {}
    for row in conflicting:
        tenants[row["style"]] = {
            "tenant_gain": row["tenant"]["gain"],
            "shared_gain": row["shared"]["gain"],
            "gain_difference": row["gain_difference"],
            "gain_difference_se": row.get("gain_difference_se"),
            "held_out_gain_difference": row.get("held_out_gain_difference"),
        }
    differences = [t["gain_difference"] for t in tenants.values()]
    return {
        "file": name,
        "commit": result.get("commit"),
        "seed": _seed(result.get("command", "")),
        "minutes": report.get("minutes"),
        "judged_turns": {
            scope: figures.get("judged_turns")
            for scope, figures in report.get("scopes", {}).items()
        },
        "tenants": tenants,
        # Both conflicting tenants ahead by the margin, whatever the checks say.
        "ahead": bool(differences)
        and all(d is not None and d > headline["margin"] for d in differences),
        # Per scope: every quality check of the conflicting tenants kept in that scope.
        "quality_kept_by_scope": {
            scope: all(all(row[scope]["quality_kept"].values()) for row in conflicting)
            for scope in ("tenant", "shared")
        },
        "quality_kept": headline.get("quality_kept"),
        "isolation_passed": headline.get("isolation_passed"),
        "met": bool(headline.get("tenant_scope_beats_shared")),
    }


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per run (by file name) and over the runs: the gain differences' spread, the runs with
    both conflicting tenants ahead by more than the margin, and those that met the target
    (ahead, every quality check kept in both scopes, isolation passed)."""
    compared = {name: r for name, r in results.items() if _both_scopes(r)}
    ordered = sorted(compared.items())
    rows = [run_row(name, result) for name, result in ordered]
    over: dict[str, Any] = {}
    for style in CONFLICTING:
        figures = [r["tenants"].get(style) or {} for r in rows]
        over[style] = {
            key: spread([f.get(key) for f in figures])
            for key in ("gain_difference", "tenant_gain", "shared_gain", "held_out_gain_difference")
        }
        over[style]["reaction_shifts"] = {
            scope: reaction_shifts([result for _, result in ordered], style, scope)
            for scope in ("tenant", "shared")
        }
    return {
        "runs": rows,
        "over_runs": over,
        "met": sum(r["met"] for r in rows),
        "ahead": sum(r["ahead"] for r in rows),
        "of": len(rows),
        "quality_kept": sum(bool(r["quality_kept"]) for r in rows),
        "isolation_passed": sum(bool(r["isolation_passed"]) for r in rows),
        # Runs of one scope alone (`demo.scopes`), kept as experiments: nothing to compare.
        "one_scope_runs": sorted(set(results) - set(compared)),
    }


def reaction_shifts(results: list[dict[str, Any]], style: str, scope: str) -> dict[str, Any]:
    """Per reaction (pleased, too long, off topic, ...), the spread over runs of the change
    in its share of the `style` tenant's users' reactions from the first window to the last
    in `scope`; a reaction missing from a window had a share of 0 there. Runs whose report has
    no reactions for that cell are left out."""
    shifts: list[dict[str, float]] = []
    for result in results:
        matrix = result.get("report", result)["matrix"]
        row = next((r for r in matrix if r["style"] == style), None)
        reactions = row[scope].get("reactions") if row else None
        if reactions:
            first, last = reactions["first"], reactions["last"]
            shifts.append({k: last.get(k, 0.0) - first.get(k, 0.0) for k in {*first, *last}})
    kinds = sorted({kind for shift in shifts for kind in shift})
    return {kind: spread([shift.get(kind, 0.0) for shift in shifts]) for kind in kinds}


def _both_scopes(result: dict[str, Any]) -> bool:
    """True when every row of the run's matrix has a tenant-scope and a shared-scope cell."""
    rows = result.get("report", result)["matrix"]
    return all("tenant" in row and "shared" in row for row in rows)


def _tenant_turns(result: dict[str, Any]) -> int:
    """The turns judged in the run's tenant scope (0 for a run without one)."""
    scope = result.get("report", result).get("scopes", {}).get("tenant") or {}
    return int(scope.get("judged_turns") or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The tenants demo's runs, kept and compared.")
    commands = parser.add_subparsers(dest="what", required=True)
    w = commands.add_parser("wrap", help="a run's report.json with its provenance")
    w.add_argument("demo_dir", type=Path, help="the run's .liveloop/demo folder")
    w.add_argument("--command", required=True, help="the demo's command line, as run")
    w.add_argument("--note", default="", help="what this run tried")
    w.add_argument("--wall-minutes", type=float, default=None)
    w.add_argument("--commit", default=None, help="the commit it ran on (default: HEAD)")
    w.add_argument("--out", type=Path, default=None, help="write here (default: stdout)")
    s = commands.add_parser("summary", help="the gain differences over kept runs")
    s.add_argument("files", nargs="*", type=Path, help=f"default: results/{PATTERN}")
    s.add_argument("--match", default="", help="only files whose name contains this")
    s.add_argument("--minutes", type=float, default=20.0, help="only runs of these minutes")
    s.add_argument(
        "--min-tenant-turns",
        type=int,
        default=0,
        help="only runs whose tenant scope judged this many turns or more",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.what == "wrap":
        text = json.dumps(
            wrap(args.demo_dir, args.command, args.note, args.wall_minutes, args.commit), indent=1
        )
        if args.out is None:
            print(text)
        else:
            args.out.write_text(text + "\n")
        return 0
    paths = [p for p in args.files or RESULTS.glob(PATTERN) if args.match in p.name]
    results = {p.name: json.loads(p.read_text()) for p in paths}
    chosen = {
        name: result
        for name, result in results.items()
        if result.get("report", result).get("minutes") == args.minutes
        and _tenant_turns(result) >= args.min_tenant_turns
    }
    print(json.dumps(summary(chosen), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
