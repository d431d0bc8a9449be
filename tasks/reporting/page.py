"""The release report as one self-contained HTML page: no script, no stylesheet or font fetched, plots inline SVG.
Each section has an id (decision, evaluation, checks, answers, scores, latency, canary, shadow, stages, lineage) and
says so where the release never got that far."""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

from tasks.reporting import plots
from tasks.reporting.evidence import Evidence, against_base

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.15em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .5em 0; } td, th { border: 1px solid #ddd; padding: .25em .5em;
vertical-align: top; text-align: left; } th { background: #f4f4f4; }
.pass { color: #1a7f37; } .FAIL, .failed, .refused, .rejected, .rolled { color: #b42318; font-weight: 600; }
.INCONCLUSIVE { color: #9a6700; font-weight: 600; } .promoted { color: #1a7f37; font-weight: 600; }
.none { color: #777; font-style: italic; } pre { white-space: pre-wrap; margin: 0; font: inherit; }
svg { max-width: 100%; height: auto; }
"""


def number(value: Any, digits: str = ".4g") -> str:
    return "n/a" if value is None else format(value, digits) if isinstance(value, (int, float)) else escape(str(value))


def table(header: list[str], rows: list[list[str]]) -> str:
    """Cells are HTML already (escaped by the caller)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def none(text: str) -> str:
    return f'<p class="none">{escape(text)}</p>'


def decision(evidence: Evidence) -> str:
    gate = evidence.gate or {}
    against = f"v{gate['champion_version']}" if gate.get("champion_version") else "no champion (first release)"
    candidate = f"v{gate['candidate_version']}" if gate else "no candidate registered"
    outcome = evidence.outcome
    why = f"<p><strong>Why:</strong> {escape(evidence.reason)}</p>" if evidence.reason else ""
    gate_line = f"gate: {escape(gate.get('decision', 'not reached'))}" if gate else "gate: not reached"
    return (
        f'<p class="{escape(outcome.split()[0])}">{escape(outcome.upper())}</p>'
        f"<p>{escape(evidence.service)} {candidate} against {against}; {gate_line}; MLflow run "
        f"<code>{escape(evidence.run_id)}</code></p>{why}"
    )


EVALUATE_COLUMNS = ("exact_match", "rouge_1", "rouge_2", "rouge_l", "bleu_4", "answer_loss", "perplexity")


def evaluation(evidence: Evidence) -> str:
    """The evaluate stage: how the split was judged, every metric for the base and the candidate, the improvement
    with its interval, the permutation baseline, the thresholds, and the samples that moved most each way."""
    record = evidence.evaluation
    if not record:
        return none("No evaluation: the release ended before evaluate scored the eval split.")
    found, metric = record["metrics"], record["metric"]
    rows = [
        [escape(role), *(number(found.get(f"{role}_{name}"), ".3f") for name in EVALUATE_COLUMNS)]
        for role in ("base", "candidate")
    ]
    parts = [f"<p>Judged on {escape(record.get('judged') or metric)}.</p>", table(["", *EVALUATE_COLUMNS], rows)]
    improvement, interval = record["improvement"], record["improvement"].get("interval")
    bounds = f" ({improvement['confidence']:.0%} interval {interval[0]:.3f} .. {interval[1]:.3f})" if interval else ""
    facts = [f"improvement on {metric}: {improvement['value']:+.3f}{bounds} over {found.get('samples')} samples"]
    permutation = record.get("permutation")
    if permutation:
        beyond = permutation.get("interval")
        facts.append(
            f"against other questions' references: base {permutation['base']:.3f}, candidate "
            f"{permutation['candidate']:.3f}; improvement beyond that baseline {permutation['beyond']:+.3f}"
            + (f" (interval {beyond[0]:.3f} .. {beyond[1]:.3f})" if beyond else "")
        )
    thresholds = record.get("thresholds") or {}
    if thresholds:
        facts.append(
            "needed: improvement above 0 and at least evaluate.min_improvement "
            f"{thresholds['min_improvement']:g}"
            + (" on its interval's lower bound" if thresholds.get("confidence") else "")
            + f", {thresholds['min_relative_improvement']:.0%} of the base's headroom"
            + (", and above 0 beyond the permutation baseline" if permutation else "")
        )
    parts.append("<ul>" + "".join(f"<li>{escape(f)}</li>" for f in facts) + "</ul>")
    worse, better = evidence.evaluate_changes()
    directions = (("Worse than the base model", worse), ("Better than the base model", better))
    parts += side_by_side(directions, ["base model", "candidate"], lambda e: [e["base"], e["candidate"]])
    return "".join(parts)


def side_by_side(
    directions: tuple[tuple[str, list[dict[str, Any]]], ...],
    answerers: list[str],
    answers: Callable[[dict[str, Any]], list[str]],
) -> list[str]:
    """For each direction of change, its title and its examples: the prompt, the reference, each answer (`answers`
    of an example, under `answerers`' names) and the change."""
    parts = []
    for title, examples in directions:
        parts.append(f"<h3>{escape(title)}</h3>")
        rows = [
            [
                conversation(e["prompt"]),
                f"<pre>{escape(e['expected'])}</pre>",
                *(f"<pre>{escape(answer)}</pre>" for answer in answers(e)),
                f"{e['change']:+.3f}",
            ]
            for e in examples
        ]
        parts.append(table(["prompt", "reference", *answerers, "change"], rows) if rows else none("none"))
    return parts


def checks(evidence: Evidence) -> str:
    """Every check, the failing ones first, each with its value, interval, samples and threshold."""
    if not evidence.gate:
        return none("The release ended before its gate.")
    ordered = sorted(evidence.gate["checks"], key=lambda c: c["passed"])
    rows = []
    for check in ordered:
        verdict = "pass" if check["passed"] else "INCONCLUSIVE" if check.get("inconclusive") else "FAIL"
        interval = check.get("interval")
        rows.append(
            [
                escape(check["name"]),
                number(check["value"]),
                f"{interval[0]:.4g} .. {interval[1]:.4g}" if interval else "",
                number(check.get("samples"), "d") if check.get("samples") is not None else "",
                f"{escape(check['comparison'])} {check['threshold']:g}",
                f'<span class="{verdict}">{verdict}</span>',
            ]
        )
    return table(["check", "value", "interval", "samples", "threshold", "verdict"], rows)


def conversation(prompt: list[dict[str, str]]) -> str:
    return "<br>".join(f"<b>{escape(m['role'])}</b>: <pre>{escape(m['content'])}</pre>" for m in prompt)


def answers(evidence: Evidence) -> str:
    """Both versions' answers side by side, with the reference, where the candidate's score moved most each way."""
    if not evidence.answers:
        return none("No served answers: the release ended before the gate scored the eval split.")
    worse, better = evidence.changed_examples()
    base = evidence.base_answers()
    champion = any("champion_served" in e for e in evidence.answers)
    against = "champion" if champion else "base model" if base else "offline"
    parts = [
        f"<p>{len(evidence.answers)} examples scored ({escape(evidence.metric)}), candidate against {against}.</p>"
    ]
    directions = ((f"Worse than the {against}", worse), (f"Better than the {against}", better))

    def answered(e: dict[str, Any]) -> list[str]:
        return [e["served"], e["champion_served"] if champion else against_base(e, base)["answer"]]

    parts += side_by_side(directions, ["candidate (served)", against], answered)
    return "".join(parts)


def scores(evidence: Evidence) -> str:
    found = evidence.scores()
    if not any(found.values()):
        return none("No scores: the release ended before the gate scored the eval split.")
    return plots.score_histogram(found, evidence.metric)


def latency(evidence: Evidence) -> str:
    if not evidence.latencies:
        return none("No per-request latencies: the benchmark did not run, or its tool wrote no per-request export.")
    series = {role: measured["latency_ms"] for role, measured in evidence.latencies.items()}
    first = {role: measured["ttft_ms"] for role, measured in evidence.latencies.items()}
    return (
        "<h3>Request latency</h3>"
        + plots.cdf(series, "request latency (ms)")
        + "<h3>Time to first token</h3>"
        + plots.cdf(first, "time to first token (ms)")
    )


def canary(evidence: Evidence) -> str:
    if not evidence.canary:
        return none("No canary ramp: the candidate was never given traffic.")
    rows = [
        [
            number(s["weight"], "g") + "%",
            number(s["requests"], "d"),
            number(s["failures"], "d"),
            number(s.get("candidate_requests"), ".0f"),
            number(s.get("candidate_mean_latency_ms"), ".1f"),
            number(s.get("client_p99_ms"), ".1f"),
            escape(s.get("breach") or ""),
        ]
        for s in evidence.canary
    ]
    header = ["share", "requests", "failed", "candidate's", "candidate mean ms", "clients' p99 ms", "breach"]
    return plots.canary_timeline(evidence.canary) + table(header, rows)


def shadow(evidence: Evidence) -> str:
    found = evidence.shadow
    if not found:
        return none("No shadow window (canary.shadow_s is 0, or no champion).")
    numbers = escape(
        f"{found['requests']} copies, {found['errors']} failed, agreement ({found['metric']}) "
        f"{number(found.get('agreement'), '.3f')} over {found['compared']}"
    )
    rows = [
        [escape(str(d.get("request_id"))), escape(str(d.get("champion_chars"))), escape(str(d.get("candidate_chars")))]
        for d in found.get("disagreeing", [])
    ]
    examples = (
        table(
            ["request id (its exchange in the capture store)", "champion's answer, chars", "candidate's, chars"], rows
        )
        if rows
        else none("No disagreement.")
    )
    return f"<p>{numbers}</p>{examples}"


def stages(evidence: Evidence) -> str:
    """The merge, quantization and engine checks with every other stage's numbers."""
    if not evidence.stages:
        return none("No stage ran.")
    rows = [
        [
            escape(s.stage),
            "cached" if s.cached else "ran",
            "<br>".join(f"{escape(k)}: {number(v)}" for k, v in sorted(s.metrics.items())),
        ]
        for s in evidence.stages
    ]
    return table(["stage", "", "metrics"], rows)


def lineage(evidence: Evidence) -> str:
    if not evidence.stages:
        return none("No artifact was made.")
    rows = [
        [escape(s.stage), f"<code>{escape(s.uri)}</code>", f"<code>{escape(s.sha256)}</code>"] for s in evidence.stages
    ]
    gate = evidence.gate or {}
    served = f"<p>served artifact <code>{escape(gate.get('served_artifact') or 'n/a')}</code>, measured "
    served += f"<code>{escape(gate.get('measured_artifact') or 'n/a')}</code></p>"
    return served + table(["stage", "artifact", "sha256"], rows)


SECTIONS: list[tuple[str, str, Callable[[Evidence], str]]] = [
    ("decision", "Decision", decision),
    ("evaluation", "Evaluation: base model against candidate", evaluation),
    ("checks", "Checks", checks),
    ("answers", "Answers that changed", answers),
    ("scores", "Score distributions", scores),
    ("latency", "Latency distributions (benchmark)", latency),
    ("canary", "Canary timeline", canary),
    ("shadow", "Shadow traffic", shadow),
    ("stages", "Merge, quantization and stage checks", stages),
    ("lineage", "Lineage", lineage),
]


def render(evidence: Evidence) -> str:
    body = "".join(
        f'<section id="{key}"><h2>{escape(title)}</h2>{write(evidence)}</section>' for key, title, write in SECTIONS
    )
    title = f"Release {evidence.service}: {evidence.outcome}"
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head>"
        f"<body><h1>{escape(title)}</h1>{body}</body></html>\n"
    )
