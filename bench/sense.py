"""A judge model's reading of finished demos' held-out replies: how many are sensible.

Reads demo reports (report.json), serves the judge model (`--judge`, default the 1.5B
instruct alias) in a process of its own, asks it about every held-out reply of every
evaluated version, and prints one JSON object: per report and version, the sense rate, how many replies
got a verdict, the seconds it took, and each reply with its verdict. The demo does the same
at its end when `demo.sense_model` is set; this reads runs made without it, or with another
judge.

    python bench/sense.py run-a/demo/report.json run-b/demo/report.json --judge qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(ROOT)

from liveloop.config import load_settings  # noqa: E402
from liveloop.demo.sense_judge import rate_held_out, sense_judge_server  # noqa: E402
from liveloop.prm.sense import sense_check_factory  # noqa: E402


def rated(report_path: Path, url: str, settings: Any) -> dict[str, Any]:
    """One report's held-out replies, rated by the judge at `url`."""
    report = json.loads(report_path.read_text())
    evals: dict[str, Any] = report.get("eval") or {}
    rate_held_out(evals, url, None, sense_check_factory(settings.trainer.gate.sense))
    return {
        "report": str(report_path),
        "demo_model": report.get("model"),
        "objective": report.get("objective"),
        "versions": {
            label: {
                "sense_rate": row.get("sense_rate"),
                "sense_judged": row.get("sense_judged"),
                "sense_seconds": row.get("sense_seconds"),
                "replies": [
                    {"question": r["question"], "reply": r["reply"], "sensible": r["sensible"]}
                    for r in row.get("replies") or []
                ],
            }
            for label, row in evals.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("reports", type=Path, nargs="+", help="demo report.json files")
    parser.add_argument("--judge", default="qwen2.5-coder-1.5b", help="judge model (alias/path)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the judge")
    args = parser.parse_args()
    for path in args.reports:
        if not json.loads(path.read_text()).get("eval"):
            sys.exit(f"{path} has no held-out evaluation")
    with tempfile.TemporaryDirectory(prefix="liveloop-sense-") as scratch:
        settings = load_settings(
            model=args.judge, data_dir=scratch, threads=args.threads,
            demo={"sense_model": args.judge},
        )  # fmt: skip
        with sense_judge_server(settings, Path(scratch)) as url:
            assert url is not None
            out = {
                "judge": args.judge,
                "runs": [rated(path, url, settings) for path in args.reports],
            }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
