"""The release report (tasks/reporting/): every section from a release's own files, the failing check first, the
answers that changed most each way, plots drawn from the numbers given (change one, the plot changes), a page that
fetches nothing, and a report for a release that ended before its gate."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tasks.reporting.evidence import StageRecord, gather, release_folder
from tasks.reporting.page import SECTIONS, render

SERVICE, RUN = "svc", "run123"


def check(name: str, value: float, threshold: float, passed: bool, comparison: str = "<=") -> dict:
    return {
        "name": name,
        "value": value,
        "threshold": threshold,
        "comparison": comparison,
        "passed": passed,
        "interval": [value - 0.1, value + 0.1],
        "samples": 30,
        "inconclusive": False,
    }


def example(word: str, answer: str, champion: str, expected: str) -> dict:
    def scores(text: str) -> dict:
        return {"exact_match": float(text == expected)}

    return {
        "prompt": [{"role": "user", "content": f"opposite of {word}"}],
        "expected": expected,
        "offline": answer,
        "served": answer,
        "served_tokens": 2,
        "scores": {"offline": scores(answer), "served": scores(answer)},
        "champion_served": champion,
        "champion_scores": scores(champion),
    }


def genai_perf_export(folder: Path, latencies_ms: list[float]) -> None:
    """genai-perf's per-request export: send time and response times in ns."""
    folder.mkdir(parents=True)
    requests = [
        {"timestamp": 1_000_000_000, "response_timestamps": [1_000_000_000 + 1_000_000, 1_000_000_000 + int(ms * 1e6)]}
        for ms in latencies_ms
    ]
    (folder / "profile_export.json").write_text(json.dumps({"experiments": [{"requests": requests}]}))


def release(home: Path, candidate_ms: float = 40.0, weights: tuple[int, ...] = (10, 50, 100)) -> None:
    """A rejected-at-the-ramp release's files: gate report, served answers, two roles' benchmark exports, canary."""
    folder = release_folder(home, RUN)
    folder.mkdir(parents=True)
    gate = {
        "model": SERVICE,
        "candidate_version": "2",
        "champion_version": "1",
        "passed": False,
        "decision": "reject",
        "metric": "exact_match",
        "served_artifact": "aa" * 32,
        "measured_artifact": "aa" * 32,
        "checks": [
            check("error rate", 0.0, 0.01, True),
            check("task metric drop vs champion (exact_match, served)", 0.5, 0.02, False),
        ],
    }
    (folder / "gate_report.json").write_text(json.dumps(gate))
    answers = [
        example("hot", "cold", "cold", "cold"),
        example("big", "large", "small", "small"),  # worse than the champion
        example("up", "down", "sideways", "down"),  # better
    ]
    (folder / "served_answers.json").write_text(json.dumps(answers))
    bench = home / "work" / "benchmark" / RUN
    genai_perf_export(bench / f"{SERVICE}-v2-c2" / "run", [candidate_ms, candidate_ms * 2, candidate_ms * 3])
    genai_perf_export(bench / f"{SERVICE}-v1-c2" / "run", [30.0, 31.0, 35.0])
    steps = [
        {"weight": w, "at": 100.0 + 5 * i, "requests": 20, "failures": 0, "candidate_requests": w / 5,
         "candidate_failures": 0, "candidate_mean_latency_ms": 40.0, "client_p99_ms": 60.0, "breach": None}
        for i, w in enumerate(weights)
    ]  # fmt: skip
    steps[-1]["breach"] = "candidate mean latency 40.0 ms > canary.max_mean_latency_ms 30"
    (folder / "canary.json").write_text(json.dumps(steps))


def section(page: str, key: str) -> str:
    return page.split(f'<section id="{key}">')[1].split("</section>")[0]


def test_every_section_is_drawn_from_the_releases_own_files(tmp_path):
    release(tmp_path)
    stages = [StageRecord("merge", "file:///store/merged", "bb" * 32, False, {"max_abs_logit_diff": 0.001})]
    page = render(gather(tmp_path, RUN, SERVICE, "rolled back", "", stages))
    assert [key for key, _, _ in SECTIONS] == re.findall(r'<section id="([a-z]+)">', page)
    # the breach is why; the failing check comes first
    assert "canary breach: candidate mean latency 40.0 ms" in section(page, "decision")
    rows = section(page, "checks").split("<tr>")[2:]
    assert "task metric drop vs champion" in rows[0] and "FAIL" in rows[0] and "pass" in rows[1]
    # the answers that moved, with the reference, each way
    answers = section(page, "answers")
    worse, better = answers.split("Better than the champion")
    assert "opposite of big" in worse and "large" in worse and "opposite of up" in better
    assert "opposite of hot" not in answers  # unchanged
    assert section(page, "latency").count("<svg") == 2 and section(page, "canary").count("<svg") == 1
    assert "max_abs_logit_diff" in section(page, "stages") and "bb" * 32 in section(page, "lineage")
    assert "No shadow window" in section(page, "shadow")


def test_a_plot_changes_with_its_numbers_and_only_then(tmp_path):
    def page(home: Path, **changes) -> str:
        release(home, **changes)
        return render(gather(home, RUN, SERVICE, "promoted", ""))

    base = page(tmp_path / "a")
    assert base == page(tmp_path / "b")  # the same numbers, the same page
    slower = page(tmp_path / "c", candidate_ms=90.0)
    assert section(slower, "latency") != section(base, "latency") and section(slower, "canary") == section(
        base, "canary"
    )
    ramp = page(tmp_path / "d", weights=(5, 50, 100))
    assert section(ramp, "canary") != section(base, "canary") and section(ramp, "latency") == section(base, "latency")


def test_the_page_fetches_nothing_and_runs_no_script(tmp_path):
    release(tmp_path)
    page = render(gather(tmp_path, RUN, SERVICE, "promoted", ""))
    assert "<script" not in page and "<link" not in page and "@import" not in page
    # the only URLs are the SVG namespaces' (names, never fetched)
    assert set(re.findall(r"https?://[^\"' )<]+", page)) <= {
        "http://www.w3.org/2000/svg",
        "http://www.w3.org/1999/xlink",
    }


def test_a_release_that_failed_before_its_gate_gets_a_report_saying_so(tmp_path):
    page = render(gather(tmp_path, RUN, SERVICE, "failed", "TransientError: MLflow did not answer"))
    assert "FAILED" in section(page, "decision") and "MLflow did not answer" in section(page, "decision")
    assert "ended before its gate" in section(page, "checks")
    assert "No canary ramp" in section(page, "canary") and "No stage ran" in section(page, "stages")


def evaluation_record(home: Path) -> None:
    """evaluate's record as the stage copies it to the release's folder: both models, every metric, three samples."""
    samples = [
        {"prompt": [{"role": "user", "content": f"opposite of {w}"}], "expected": e, "base": b, "candidate": c,
         "scores": {"base": {"exact_match": float(b == e)}, "candidate": {"exact_match": float(c == e)}}}
        for w, e, b, c in (("hot", "cold", "warm", "cold"), ("big", "small", "small", "tiny"), ("up", "down", "x", "x"))
    ]  # fmt: skip
    metrics = {f"{role}_{name}": value for role, value in (("base", 0.333), ("candidate", 0.667))
               for name in ("exact_match", "rouge_l")}  # fmt: skip
    record = {
        "metric": "exact_match",
        "judged": "metric exact_match (closed references: 100% of 3 at most 3 words), answers of up to 8 tokens",
        "higher_is_better": True,
        "metrics": {**metrics, "samples": 3},
        "improvement": {"value": 0.333, "interval": [-0.333, 1.0], "confidence": 0.9},
        "permutation": {"base": 0.1, "candidate": 0.2, "beyond": 0.233, "interval": [-0.2, 0.6]},
        "thresholds": {"min_improvement": 0.0, "min_relative_improvement": 0.05, "confidence": 0.9},
        "samples": samples,
    }
    folder = release_folder(home, RUN)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evaluation.json").write_text(json.dumps(record))


def test_a_release_refused_at_evaluate_shows_the_evaluation_and_what_it_made(tmp_path):
    """Issue 72: refused at evaluate, the report has the evaluate table, the interval, the permutation baseline, the
    base model's answers beside the candidate's where they moved, and the stages that ran with their artifacts."""
    evaluation_record(tmp_path)
    stages = [StageRecord("train", "file:///store/adapter", "cc" * 32, False, {"final_loss": 0.2})]
    refusal = "CheckFailed: evaluate: candidate exact_match 0.667 vs base 0.333: the lower bound of its improvement"
    page = render(gather(tmp_path, RUN, SERVICE, "refused", refusal, stages))
    assert "REFUSED" in section(page, "decision") and "the lower bound of its improvement" in section(page, "decision")
    evaluated = section(page, "evaluation")
    assert "Judged on metric exact_match (closed references" in evaluated
    assert "<td>base</td><td>0.333</td>" in evaluated and "<td>candidate</td><td>0.667</td>" in evaluated
    assert "(90% interval -0.333 .. 1.000)" in evaluated and "improvement beyond that baseline +0.233" in evaluated
    worse, better = evaluated.split("Better than the base model")
    assert "opposite of big" in worse and "tiny" in worse and "opposite of hot" in better and "warm" in better
    assert "opposite of up" not in evaluated.split("</ul>")[1]  # unchanged
    assert "final_loss" in section(page, "stages") and "cc" * 32 in section(page, "lineage")


def test_a_first_release_shows_the_base_models_answers_beside_the_candidates(tmp_path):
    release(tmp_path)
    evaluation_record(tmp_path)
    folder = release_folder(tmp_path, RUN)
    gate = json.loads((folder / "gate_report.json").read_text())
    (folder / "gate_report.json").write_text(json.dumps({**gate, "champion_version": None}))
    answers = json.loads((folder / "served_answers.json").read_text())
    for answer in answers:
        del answer["champion_served"], answer["champion_scores"]
    (folder / "served_answers.json").write_text(json.dumps(answers))
    answered = section(render(gather(tmp_path, RUN, SERVICE, "promoted", "")), "answers")
    assert "candidate against base model" in answered and "<th>base model</th>" in answered
    assert "<pre>warm</pre>" in answered  # the base's answer to "hot", which the served candidate got right


def test_text_from_the_model_is_shown_as_text(tmp_path):
    release(tmp_path)
    answers = json.loads((release_folder(tmp_path, RUN) / "served_answers.json").read_text())
    answers[1]["served"] = "<img src=x onerror=alert(1)>"
    (release_folder(tmp_path, RUN) / "served_answers.json").write_text(json.dumps(answers))
    page = render(gather(tmp_path, RUN, SERVICE, "rejected", "gate rejected"))
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page


def test_aiperfs_per_record_export_gives_the_same_distributions(tmp_path):
    """AIPerf's profile_export.jsonl (one record per request, each metric with its unit); a failed request's record
    has no latency and is left out."""
    from tasks.reporting.evidence import benchmark_latencies

    run = tmp_path / f"{SERVICE}-v2-c8-r1" / "profile_runs" / "run_0001"
    run.mkdir(parents=True)
    records = [
        {"metrics": {"request_latency": {"value": 120.5, "unit": "ms"}, "time_to_first_token": {"value": 20.0, "unit": "ms"}}},
        {"metrics": {"request_latency": {"value": 0.25, "unit": "s"}, "time_to_first_token": {"value": 30000, "unit": "us"}}},
        {"metrics": {}, "error": {"code": 503}},
    ]  # fmt: skip
    (run / "profile_export.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    found = benchmark_latencies(tmp_path, {"candidate": f"{SERVICE}-v2", "champion": f"{SERVICE}-v1"})
    assert found == {"candidate": {"latency_ms": [120.5, 250.0], "ttft_ms": [20.0, 30.0]}}


def test_the_report_cost_benchmark_prints_both_sets_as_documented():
    """benchmarks/report_cost.py: the page for cpu-tiny's exam and the whole finance set, seconds and size."""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "benchmarks/report_cost.py", "--repeat", "1"], capture_output=True, text=True, cwd=root
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("  ")[0].strip(): line.split() for line in done.stdout.splitlines()[2:]}
    assert int(rows["cpu-tiny exam"][2]) == 39 and int(rows["finance_qa_zh, all records"][3]) == 288
    assert all(float(row[-4]) > 0 and float(row[-3]) > 10 for row in rows.values())  # seconds, report KiB
