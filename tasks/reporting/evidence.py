"""What a release left that a person reads: gathered from the files its stages wrote under LLMOPS_HOME/work (the gate's
report and served answers, the benchmark's per-request exports, the canary's steps, the shadow window's sample), not
from the stages' objects, so a report can be written for any release, a failed one included, from what it got to."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GATE_REPORT, SERVED_ANSWERS = "gate_report.json", "served_answers.json"
EVALUATION = "evaluation.json"  # the evaluate stage's record, copied here by it (tasks/evaluate.py, keep_for_report)
CANARY_STEPS, SHADOW_SUMMARY = "canary.json", "shadow.json"
REPORT_FILE = "release_report.html"
EXAMPLES_EACH_WAY = 5  # examples shown per direction of change


def release_folder(home: Path, run_id: str) -> Path:
    """Where the gate's report, the served answers and the release report of MLflow run `run_id` are written."""
    return home / "work" / "gate" / run_id


@dataclass
class StageRecord:
    stage: str
    uri: str
    sha256: str
    cached: bool
    metrics: dict[str, Any]


@dataclass
class Evidence:
    service: str
    run_id: str
    outcome: str  # promoted, rolled back, rejected, failed, not deployed, ...
    reason: str  # why, in one line: the rejection's or the failure's; "" when promoted
    gate: dict[str, Any] | None = None
    answers: list[dict[str, Any]] = field(default_factory=list)
    latencies: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # role -> latency_ms/ttft_ms
    canary: list[dict[str, Any]] = field(default_factory=list)
    shadow: dict[str, Any] | None = None
    stages: list[StageRecord] = field(default_factory=list)
    evaluation: dict[str, Any] | None = None  # base against candidate offline, every sample (evaluation.json)

    @property
    def metric(self) -> str:
        return str((self.gate or {}).get("metric") or (self.evaluation or {}).get("metric") or "")

    def base_answers(self) -> dict[str, dict[str, Any]]:
        """The base model's answer and scores to each eval prompt (evaluate's record), by prompt."""
        samples = (self.evaluation or {}).get("samples", [])
        return {prompt_key(s["prompt"]): {"answer": s["base"], "scores": s["scores"]["base"]} for s in samples}

    def evaluate_changes(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """evaluate's samples whose score moved most from the base to the candidate, worse first and better first,
        each with its `change` (candidate minus base on the deciding metric; for answer_loss lower is better)."""
        metric, moved = self.metric, []
        for sample in (self.evaluation or {}).get("samples", []):
            candidate, base = sample["scores"]["candidate"].get(metric), sample["scores"]["base"].get(metric)
            if candidate is not None and base is not None and candidate != base:
                moved.append(
                    {**sample, "change": candidate - base, "gain": better_by(self.evaluation, candidate - base)}
                )
        moved.sort(key=lambda e: e["gain"])
        worse = [e for e in moved if e["gain"] < 0][:EXAMPLES_EACH_WAY]
        better = [e for e in reversed(moved) if e["gain"] > 0][:EXAMPLES_EACH_WAY]
        return worse, better

    def changed_examples(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The examples whose score moved most against the champion (without one: served against offline), worst
        first and best first; each with its `change` (candidate minus the other)."""
        metric, moved, base = self.metric, [], self.base_answers()
        for example in self.answers:
            served = example["scores"]["served"].get(metric)
            other = (example.get("champion_scores") or against_base(example, base)["scores"]).get(metric)
            if served is not None and other is not None and served != other:
                moved.append({**example, "change": served - other})
        moved.sort(key=lambda e: e["change"])
        worse = [e for e in moved if e["change"] < 0][:EXAMPLES_EACH_WAY]
        better = [e for e in reversed(moved) if e["change"] > 0][:EXAMPLES_EACH_WAY]
        return worse, better

    def scores(self) -> dict[str, list[float]]:
        """The per-example task metric of each version as served, and the candidate offline."""
        metric = self.metric
        found: dict[str, list[float | None]] = {"candidate": [], "champion": [], "offline": []}
        for example in self.answers:
            found["candidate"].append(example["scores"]["served"].get(metric))
            found["offline"].append(example["scores"]["offline"].get(metric))
            if "champion_scores" in example:
                found["champion"].append(example["champion_scores"].get(metric))
        return {role: [v for v in values if v is not None] for role, values in found.items()}


def prompt_key(prompt: list[dict[str, str]]) -> str:
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def against_base(example: dict[str, Any], base: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What a served answer is compared with where there is no champion: the base model's answer to the prompt (a
    first release shows what it learned), else the candidate offline."""
    found = base.get(prompt_key(example["prompt"]))
    return found if found is not None else {"answer": example["offline"], "scores": example["scores"]["offline"]}


def better_by(evaluation: dict[str, Any] | None, change: float) -> float:
    """A change in the deciding metric, positive where the candidate is better (answer_loss: lower is)."""
    return change if (evaluation or {}).get("higher_is_better", True) else -change


def read_json(path: Path) -> Any:
    """A file's JSON; None where it is missing or unreadable (a release that stopped before writing it)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def request_latencies(export: Path) -> tuple[list[float], list[float]]:
    """genai-perf's per-request export (profile_export.json: each request's send time and its responses' times, in
    ns): each request's latency and time to its first response, in ms."""
    data = read_json(export) or {}
    latency, ttft = [], []
    for experiment in data.get("experiments", []):
        for request in experiment.get("requests", []):
            answered = request.get("response_timestamps") or []
            if answered:
                latency.append((answered[-1] - request["timestamp"]) / 1e6)
                ttft.append((answered[0] - request["timestamp"]) / 1e6)
    return latency, ttft


TO_MS = {"ms": 1.0, "us": 1e-3, "ns": 1e-6, "s": 1000.0}


def record_latencies(export: Path) -> tuple[list[float], list[float]]:
    """AIPerf's per-record export (profile_export.jsonl, its CLI's default export level `records`: one line per
    request, {"metrics": {"request_latency": {"value", "unit"}, "time_to_first_token": {...}}}; aiperf
    orchestrator/search_planner/_pooled_percentile.py reads it so): each request's latency and TTFT, in ms."""
    latency, ttft = [], []
    for line in export.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            metrics = json.loads(line).get("metrics", {})
            total, first = metrics["request_latency"], metrics["time_to_first_token"]
            latency.append(float(total["value"]) * TO_MS[total.get("unit", "ms")])
            ttft.append(float(first["value"]) * TO_MS[first.get("unit", "ms")])
        except (ValueError, KeyError, TypeError, AttributeError):  # a failed request's record, a cut line
            continue
    return latency, ttft


def benchmark_latencies(folder: Path, versions: dict[str, str]) -> dict[str, dict[str, list[float]]]:
    """Every measured request of each role over the benchmark's levels and rounds (both roles had the same load);
    `versions`: role -> its model's name, which names its runs' folders (`<name>-c<concurrency>[...]`)."""
    found: dict[str, dict[str, list[float]]] = {}
    for role, name in versions.items():
        latency, ttft = [], []
        runs = folder.glob(f"{name}-c*/**/profile_export.json*")  # genai-perf's .json, AIPerf's .jsonl
        for export in sorted(runs):
            measured = record_latencies(export) if export.suffix == ".jsonl" else request_latencies(export)
            latency += measured[0]
            ttft += measured[1]
        if latency:
            found[role] = {"latency_ms": latency, "ttft_ms": ttft}
    return found


def gather(
    home: Path, run_id: str, service: str, outcome: str, reason: str, stages: list[StageRecord] | None = None
) -> Evidence:
    """What release `run_id` of `service` left under `home`."""
    folder = release_folder(home, run_id)
    gate = read_json(folder / GATE_REPORT)
    versions = {}
    if gate:
        versions["candidate"] = f"{service}-v{gate['candidate_version']}"
        if gate.get("champion_version"):
            versions["champion"] = f"{service}-v{gate['champion_version']}"
    canary = read_json(folder / CANARY_STEPS) or []
    if not reason and canary and canary[-1].get("breach"):
        reason = f"canary breach: {canary[-1]['breach']}"
    return Evidence(
        service,
        run_id,
        outcome,
        reason,
        gate,
        read_json(folder / SERVED_ANSWERS) or [],
        benchmark_latencies(home / "work" / "benchmark" / run_id, versions),
        canary,
        read_json(folder / SHADOW_SUMMARY),
        stages or [],
        read_json(folder / EVALUATION),
    )
