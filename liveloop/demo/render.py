"""Writing the demo report out: the PNG plot and the Markdown page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXAMPLES = 6


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def plot(
    scores: list[float],
    times: list[float],
    summary: dict[str, Any],
    path: Path,
    curves: dict[str, list[float]] | None = None,
) -> None:
    """Reward, words and topic rate per version, and reward over time, as a PNG.

    With several objectives (`curves`: judged scores per objective) a third panel shows
    each one's moving reward over judged turns.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    several = curves is not None and len(curves) > 1
    fig, axes = plt.subplots(1, 3 if several else 2, figsize=(18 if several else 12, 4.5))
    rows = summary["per_version"]
    versions = [int(v) for v in rows]
    ax = axes[0]
    ax.plot(versions, [rows[str(v)]["mean_reward"] for v in versions], "o-", label="reward")
    topic = [rows[str(v)]["topic_rate"] for v in versions]
    ax.plot(versions, [t if t is not None else float("nan") for t in topic], "^:",
            color="tab:green", label="topic rate")  # fmt: skip
    ax.set_xlabel("policy version")
    ax.set_ylabel("reward / topic rate")
    ax.set_ylim(-1.05, 1.05)
    ax.legend(loc="lower left")
    ax2 = ax.twinx()
    words = [rows[str(v)]["mean_words"] for v in versions]
    ax2.plot(versions, [w if w is not None else float("nan") for w in words], "s--",
             color="tab:orange")  # fmt: skip
    ax2.set_ylabel("reply words", color="tab:orange")
    ax.set_title("per policy version")
    k = max(1, summary["window_turns"] // 2)
    t0 = times[0] if times else 0.0
    rolling = [_mean(scores[max(0, i - k + 1) : i + 1]) or 0.0 for i in range(len(scores))]
    axes[1].plot([(t - t0) / 60 for t in times], rolling, label=f"reward, moving mean of {k}")
    axes[1].set_xlabel("minutes")
    axes[1].set_ylim(-1.05, 1.05)
    axes[1].set_title("over time")
    axes[1].legend(loc="lower right")
    if several and curves is not None:
        _plot_objectives(axes[2], curves, summary)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_objectives(ax: Any, curves: dict[str, list[float]], summary: dict[str, Any]) -> None:
    """Moving reward over judged turns, one line per objective."""
    from liveloop.demo.curves import moving_mean

    k = max(1, summary["window_turns"] // 2)
    for name, scores in curves.items():
        ax.plot(range(1, len(scores) + 1), moving_mean(scores, k), label=name)
    if summary.get("threshold") is not None:
        ax.axhline(summary["threshold"], color="grey", linestyle=":", label="threshold")
    ax.set_xlabel("judged turns")
    ax.set_ylim(-1.05, 1.05)
    ax.set_title(f"reward by objective, moving mean of {k}")
    ax.legend(loc="lower right")


def _fmt(x: float | None, pct: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.0f}%" if pct else f"{x:+.3f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _mark(ok: bool | None) -> str:
    return {True: "kept", False: "NOT kept", None: "not measured"}[ok]


def plus_minus(se: float | None) -> str:
    """' ± 0.15': one standard error of a gain, from the spread of the two windows' scores."""
    return "" if se is None else f" ± {se:.2f}"


def _headline(summary: dict[str, Any]) -> list[str]:
    h = summary.get("headline") or {}
    topic, nll = h.get("topic_rate") or {}, h.get("ref_nll") or {}
    non_answers = h.get("non_answer_share") or {}
    checks = h.get("quality_kept") or {}
    gain = f"{_fmt(h.get('reward_gain'))}**{plus_minus(h.get('reward_gain_se'))}"
    return [
        f"**Judged reward gain {gain} (first "
        f"{summary['window_turns']} turns {_fmt(summary['reward_first_window'])}, last "
        f"{_fmt(summary['reward_last_window'])}), with reply quality "
        f"{'kept' if all(v is not False for v in checks.values()) else 'NOT kept'}:",
        "",
        f"- held-out replies mentioning the question's topic: version 0 "
        f"{_fmt(topic.get('version 0'), True)}, final {_fmt(topic.get('final'), True)} "
        f"({_mark(checks.get('topic_rate'))})",
        f"- reference NLL per token of probe replies: version 0 {_num(nll.get('version 0'))}, "
        f"version {h.get('final_probed_version', '-')} {_num(nll.get('final'))}, ratio "
        f"{_num(h.get('ref_nll_ratio'))} ({_mark(checks.get('ref_nll'))})",
        f"- final held-out replies dominated by symbols: "
        f"{_fmt(h.get('symbol_share_final'), True)} ({_mark(checks.get('symbols'))})",
        f"- held-out replies that are no answer (nonsense or word salad, repeats, symbols): "
        f"version 0 {_fmt(non_answers.get('version 0'), True)}, final "
        f"{_fmt(non_answers.get('final'), True)} ({_mark(checks.get('non_answers'))})",
        *_sense_line(h, checks),
        *_tool_line(h),
    ]


def _tool_line(h: dict[str, Any]) -> list[str]:
    """The held-out weather questions' first replies that called the tool, when asked."""
    rates = h.get("tool_call_rate") or {}
    if not rates.get("version 0") and not rates.get("final"):
        return []

    def one(probe: dict[str, Any] | None) -> str:
        if not probe:
            return "-"
        return f"{probe['called']}/{probe['questions']} ({_fmt(probe['rate'], True)})"

    return [
        f"- held-out weather questions whose first reply called the weather tool: version 0 "
        f"{one(rates.get('version 0'))}, final {one(rates.get('final'))}"
    ]


def _sense_line(h: dict[str, Any], checks: dict[str, Any]) -> list[str]:
    """The sense judge's reading of the held-out replies, when it ran."""
    if "sense" not in checks:
        return []
    sense = h.get("sense_rate") or {}
    return [
        f"- held-out replies the sense judge read as sensible answers: version 0 "
        f"{_fmt(sense.get('version 0'), True)}, final {_fmt(sense.get('final'), True)} "
        f"({_mark(checks.get('sense'))})"
    ]


def _per_version(summary: dict[str, Any]) -> list[str]:
    platform = summary.get("platform") or {}
    lines = [
        "| version | status | judged | reward | topic | symbols | non-answers | words "
        "| ref NLL | KL ref | distinct-2 | unscored | probe reward | probe ref NLL "
        "| probe sense |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    versions = sorted({int(v) for v in summary["per_version"]} | {int(v) for v in platform})
    for v in versions:
        row = summary["per_version"].get(str(v)) or {}
        stored = platform.get(str(v)) or {}
        served, probe = stored.get("served") or {}, stored.get("probe") or {}
        lines.append(
            f"| {v} | {stored.get('status') or '-'} "
            f"| {row.get('turns', 0)} | {_fmt(row.get('mean_reward'))} "
            f"| {_fmt(row.get('topic_rate'), True)} | {_fmt(row.get('symbol_share'), True)} "
            f"| {_fmt(row.get('non_answer_share'), True)} | {_num(row.get('mean_words'), 1)} "
            f"| {_num(served.get('ref_nll'))} | {_num(served.get('kl_ref'), 3)} "
            f"| {_num(served.get('distinct_2'))} | {_fmt(served.get('unscored_share'), True)} "
            f"| {_fmt(probe.get('reward'))} | {_num(probe.get('ref_nll'))} "
            f"| {_fmt(probe.get('sense_rate'), True)} |"
        )
    return lines


def _examples(evals: dict[str, Any]) -> list[str]:
    base = (evals.get("version 0") or {}).get("replies") or []
    final_name = next((n for n in evals if "final" in n), None)
    final = (evals.get(final_name) or {}).get("replies") or [] if final_name else []
    pairs = [(a, b) for a, b in zip(base, final, strict=False) if a["question"] == b["question"]]
    if not pairs:
        return []

    def cell(text: str) -> str:
        return (text or "(empty)").replace("|", "\\|").replace("\n", " ")[:200]

    lines = ["", f"## The same held-out questions: version 0 and {final_name}", ""]
    lines += ["| question | version 0 | final |", "|---|---|---|"]
    for a, b in pairs[:EXAMPLES]:
        lines.append(f"| {cell(a['question'])} | {cell(a['reply'])} | {cell(b['reply'])} |")
    return lines


def _judged_on(summary: dict[str, Any]) -> str:
    """What the judged turns were judged on, in brackets (empty when nothing was judged)."""
    counts = summary.get("judged_on") or {}
    names = {"next_turn": "the user's next message", "feedback": "their feedback",
             "timeout": "no reply at all"}  # fmt: skip
    parts = [f"{n} on {names.get(k, k)}" for k, n in sorted(counts.items(), reverse=True) if n]
    return f" ({', '.join(parts)})" if parts else ""


def _pacing(summary: dict[str, Any]) -> str:
    """How the users were paced, as a sentence (empty when they were not)."""
    pace = summary.get("turns_per_update")
    if not pace:
        return ""
    return f" Users were paced at {pace} judged turns per version (they wait for the trainer)."


def render_markdown(summary: dict[str, Any]) -> str:
    """A human-readable report."""
    rejected = summary.get("rejected_versions") or []
    rolled_back = summary.get("rolled_back_versions") or []
    lines = [
        "# LiveLoop demo report",
        "",
        f"Model: `{summary.get('model', '?')}`; {summary.get('minutes', '?')} minutes; "
        f"{summary['judged_turns']} judged turns{_judged_on(summary)}; "
        f"{summary['policy_versions']} policy versions served; {len(rejected)} refused by the "
        f"promotion gate; {len(rolled_back)} rolled back by the served-quality watch."
        f"{_pacing(summary)}",
        "",
        *_headline(summary),
        "",
        "![reward](reward.png)",
        "",
        "## Per version",
        "",
        "Reward, topic rate, symbol-dominated and non-answer shares and words: judged served "
        "turns. Reference NLL per token, KL to the reference, distinct-2 and unscored share: "
        "the platform's own per-version measures. Probe columns: the promotion gate's "
        "held-out probes.",
        "",
        *_per_version(summary),
    ]
    evals = summary.get("eval") or {}
    if evals:
        lines += ["", "## Held-out users (not recorded)", "",
                  "| version | turns | mean reward | topic rate | symbols | words |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for name, row in evals.items():
            lines.append(
                f"| {name} | {row['turns']} | {_fmt(row['mean_reward'])} "
                f"| {_fmt(row.get('topic_rate'), True)} | {_fmt(row.get('symbol_share'), True)} "
                f"| {_num(row.get('mean_words'), 1)} |"
            )
        lines += _examples(evals)
    lines += _reactions(summary) + _objectives(summary) + _hints(summary)
    platform = summary.get("platform") or {}
    if rejected:
        lines += ["", "## Versions the promotion gate refused", ""]
        lines += [f"- v{v}: {(platform.get(str(v)) or {}).get('reason')}" for v in rejected]
    if rolled_back:
        lines += ["", "## Versions the served-quality watch rolled back", ""]
        lines += [f"- v{v}: {(platform.get(str(v)) or {}).get('reason')}" for v in rolled_back]
    return "\n".join(lines) + "\n"


def _cell(text: str | None) -> str:
    return (text or "(empty)").replace("|", "\\|").replace("\n", " ")[:200]


def _objectives(summary: dict[str, Any]) -> list[str]:
    """The objectives side by side, when several were run."""
    runs = summary.get("objectives") or {}
    if len(runs) < 2:
        return []
    lines = ["", "## Objectives compared (same users, one run each)", "",
             "| objective | judged | first window | last window | turns to "
             f"{_fmt(summary.get('threshold'))} | hint share | held-out reward (final) |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, row in runs.items():
        lines.append(
            f"| {name} | {row.get('judged_turns')} | {_fmt(row.get('reward_first_window'))} "
            f"| {_fmt(row.get('reward_last_window'))} | {row.get('turns_to_threshold') or '-'} "
            f"| {_fmt(row.get('hint_share'), True)} | {_fmt(row.get('held_out_reward'))} |"
        )
    return lines


def _hints(summary: dict[str, Any]) -> list[str]:
    """Hint share, what distillation cost and did, and a few hints with replies."""
    training = summary.get("training") or {}
    lines = ["", "## Directive hints", "",
             f"{_fmt(summary.get('hint_share'), True)} of judged turns carried a directive "
             f"hint (objective: {summary.get('objective', '?')})."]  # fmt: skip
    if training.get("updates_with_opd"):
        lines.append(
            f"{training['updates_with_opd']} of {training['updates']} updates distilled from a "
            f"teacher: teacher time {_num(training.get('opd_seconds'))} s per update (of "
            f"{_num(training.get('seconds'))} s), mean absolute log-prob gap between student and teacher on the "
            f"taught tokens {_num(training.get('opd_gap_before'), 3)} before an update, "
            f"{_num(training.get('opd_gap_after'), 3)} after it."
        )
    if training.get("opd_skipped"):
        skipped = ", ".join(f"{k} {v:.0f}" for k, v in training["opd_skipped"].items())
        lines.append(f"Hinted turns trained without a teacher signal: {skipped}.")
    examples = summary.get("hint_examples") or []
    if examples:
        lines += ["", "| hint | question | reply before | reply of the final version |",
                  "|---|---|---|---|"]  # fmt: skip
        for e in examples:
            lines.append(
                f"| {_cell(e['hint'])} | {_cell(e['question'])} "
                f"| v{e['version_before']}: {_cell(e['before'])} "
                f"| v{e['version_after']}: {_cell(e['after'])} |"
            )
    return lines


REACTIONS = {  # a user's reason (`Reaction.reason`) as the report names it, in table order
    "pleased": "pleased", "nearly": "a little too long (lukewarm)", "too_long": "too long",
    "opening": "wanted the topic named first", "one_sentence": "wanted one sentence",
    "no_tool": "wanted the weather tool used", "wrong_weather": "contradicted the tool's result",
    "no_temperature": "left out the temperature",
    "written_call": "wrote a call as text after the result",
    "off_topic": "off topic", "thin": "said nothing about the topic", "nonsense": "nonsense",
    "foreign": "another script",
    "symbols": "symbols", "markup": "markup", "repetitive": "repeated itself",
}  # fmt: skip


def _reactions(summary: dict[str, Any]) -> list[str]:
    """What the users said in their first and last answers, and whether the tool was used."""
    said = summary.get("reactions") or {}
    if not said.get("first"):
        return []
    n = said["window"]
    lines = ["", "## What the users said", "",
             "Each answer's reason as its user saw it: the first thing wrong they found, or "
             "pleased.", "", f"| reaction | first {n} answers | last {n} answers |",
             "|---|---|---|"]  # fmt: skip
    reasons = [r for r in REACTIONS if r in said["first"] or r in said["last"]]
    reasons += sorted((set(said["first"]) | set(said["last"])) - set(reasons))
    for reason in reasons:
        first, last = said["first"].get(reason, 0.0), said["last"].get(reason, 0.0)
        name = REACTIONS.get(reason, reason)
        lines.append(f"| {name} | {_fmt(first, True)} | {_fmt(last, True)} |")
    if said.get("weather_questions"):  # every answered weather question had a first reply
        lines += ["", f"Weather questions: {said['weather_questions']}, of which "
                  f"{said['questions_called']} got a call to the weather tool as "
                  f"their first reply; {said['weather_answers']} answered, "
                  f"{said['answers_after_tool']} of the answers after a call."]  # fmt: skip
    return lines + _tool_use(said.get("tool_use") or {})


def _tool_use(by_version: dict[str, dict[str, Any]]) -> list[str]:
    """Per version: weather questions, how often the tool was called, the result used."""
    if not by_version:
        return []
    lines = ["", "| version | weather questions | first reply a tool call | replies after a "
             "result | of those, a call again (or written as text) | answers | answered after "
             "a call | answer used the result |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for version, row in by_version.items():
        lines.append(
            f"| v{version} | {row['questions']} | {_fmt(row['tool_call_rate'], True)} | "
            f"{row['after_result']} | {_fmt(row['recall_rate'], True)} | "
            f"{row['answers']} | {_fmt(row['answered_after_call_rate'], True)} | "
            f"{_fmt(row['used_result_rate'], True)} |"
        )
    return lines
