"""What a release report (tasks/reporting/) costs to write: seconds and size, for cpu-tiny's exam and for the whole
Chinese finance set, against the gate's JSON report beside it (what a person was given before).

Each release's files are made as its stages write them, from the shipped records: the gate's report and checks, the
served answers of both versions for every example (the candidate's answer its reference for two in three, another
record's otherwise; the champion's the other way round; exact match and ROUGE-L computed), genai-perf's per-request
exports of both versions over the profile's rounds and requests, and a five-step canary. Then the page is gathered and
rendered as write_report does (MLflow and Prefect left out: their cost is a file upload and an artifact), --repeat
times; the median is printed.

    .venv/bin/python benchmarks/report_cost.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.platform.config import load_profile  # noqa: E402
from tasks.reporting.evidence import release_folder  # noqa: E402

SERVICE, RUN = "svc", "run"
SETS = {"cpu-tiny exam": ("cpu-tiny", "eval"), "finance_qa_zh, all records": ("cpu-tiny-qa-zh", "all")}


def conversations(profile_name: str, which: str) -> list[list[dict[str, str]]]:
    from tasks.data.records import read_data

    data = read_data(load_profile(profile_name).data)
    return list(data.eval) if which == "eval" else [*data.train, *data.eval]


def served_answers(records: list[list[dict[str, str]]]) -> list[dict]:
    from tasks.quality.metrics import exact_match, rouge

    def scores(answer: str, reference: str) -> dict[str, float]:
        return {"exact_match": exact_match(answer, reference), "rouge_l": rouge(answer, reference)["rouge_l"]}

    references = [c[-1]["content"] for c in records]
    rows = []
    for i, conversation in enumerate(records):
        reference, other = references[i], references[(i + 1) % len(references)]
        candidate, champion = (reference, other) if i % 3 else (other, reference)
        rows.append(
            {
                "prompt": conversation[:-1],
                "expected": reference,
                "offline": candidate,
                "served": candidate,
                "served_tokens": len(candidate),
                "scores": {"offline": scores(candidate, reference), "served": scores(candidate, reference)},
                "champion_served": champion,
                "champion_scores": scores(champion, reference),
            }
        )
    return rows


def release(home: Path, records: list[list[dict[str, str]]], requests: int, rounds: int) -> Path:
    folder = release_folder(home, RUN)
    folder.mkdir(parents=True)
    check = {"value": 0.1, "threshold": 0.02, "comparison": "<=", "interval": [0.05, 0.15], "samples": len(records)}
    gate = {
        "model": SERVICE,
        "candidate_version": "2",
        "champion_version": "1",
        "passed": False,
        "decision": "reject",
        "metric": "rouge_l",
        "served_artifact": "aa" * 32,
        "measured_artifact": "aa" * 32,
        "checks": [{"name": f"check {i}", "passed": i != 0, "inconclusive": False, **check} for i in range(14)],
    }
    (folder / "gate_report.json").write_text(json.dumps(gate, indent=2))
    (folder / "served_answers.json").write_text(json.dumps(served_answers(records), ensure_ascii=False))
    rng = random.Random(0)
    for version in ("1", "2"):
        for round_ in range(rounds):
            sent = [
                {"timestamp": 10**9, "response_timestamps": [10**9 + int(rng.uniform(5, 40) * 1e6), 10**9 + int(rng.uniform(50, 400) * 1e6)]}
                for _ in range(requests)
            ]  # fmt: skip
            export = home / "work" / "benchmark" / RUN / f"{SERVICE}-v{version}-c4-r{round_}" / "run"
            export.mkdir(parents=True)
            (export / "profile_export.json").write_text(json.dumps({"experiments": [{"requests": sent}]}))
    steps = [
        {"weight": w, "at": 100.0 + 30 * i, "requests": 200, "failures": 0, "candidate_requests": 2 * w,
         "candidate_failures": 0, "candidate_mean_latency_ms": 40.0, "client_p99_ms": 80.0, "breach": None}
        for i, w in enumerate((5, 10, 25, 50, 100))
    ]  # fmt: skip
    (folder / "canary.json").write_text(json.dumps(steps))
    return folder


def measure(records: list[list[dict[str, str]]], requests: int, rounds: int, repeat: int) -> dict[str, float]:
    from tasks.reporting.evidence import gather
    from tasks.reporting.page import render

    with tempfile.TemporaryDirectory(prefix="report-cost-") as scratch:
        home = Path(scratch)
        folder = release(home, records, requests, rounds)
        seconds = []
        for _ in range(repeat):
            started = time.perf_counter()
            page = render(gather(home, RUN, SERVICE, "rejected", ""))
            (folder / "release_report.html").write_text(page, encoding="utf-8")
            seconds.append(time.perf_counter() - started)
        return {
            "examples": len(records),
            "seconds": statistics.median(seconds),
            "report_kib": (folder / "release_report.html").stat().st_size / 1024,
            "gate_json_kib": (folder / "gate_report.json").stat().st_size / 1024,
            "served_answers_kib": (folder / "served_answers.json").stat().st_size / 1024,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="renderings per set; the median is printed")
    args = parser.parse_args(argv)
    bench = load_profile("cpu-tiny").bench
    requests, rounds = bench.request_count, bench.rounds
    print(f"report-cost: {requests} requests a version and round, {rounds} rounds; median of {args.repeat}")
    print(f"{'set':<28} {'examples':>8} {'report s':>9} {'report KiB':>11} {'gate JSON KiB':>14} {'answers KiB':>12}")
    for name, (profile_name, which) in SETS.items():
        found = measure(conversations(profile_name, which), requests, rounds, args.repeat)
        print(
            f"{name:<28} {found['examples']:>8} {found['seconds']:>9.3f} {found['report_kib']:>11.1f} "
            f"{found['gate_json_kib']:>14.1f} {found['served_answers_kib']:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
