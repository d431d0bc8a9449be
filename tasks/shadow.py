"""shadow: the candidate answers a copy of live traffic before any user sees it (`canary.shadow_s`).

After deploy_canary, with the candidate loaded at 0%, this stage sets the service's shadow copy (the candidate,
`canary.shadow_fraction`) through the control API of `llmops serve`'s gateway, which from its next answered
request on copies that share of them to the candidate, after each answer reached its client: clients only ever get
the champion's answers and never wait for a copy (tasks/runtime/gateway/shadow.py). Each copy leaves a record: the
inputs, both answers, both latencies. After `canary.shadow_s` the copy stops (the same API), and this stage scores
the records: the candidate's answers against the champion's with the profile's metric
(`evaluate.metric`; rouge_l where that is answer_loss, which needs a reference answer's tokens), on greedy
requests only (a sampled answer differs by chance), and its errors and latencies. The records (redacted by the
gateway as it wrote them) are deleted once scored: MLflow gets the aggregates and a sample of `SAMPLE_RECORDS` of
them without their text (request ids, timings, whether the answers agreed): live prompts and answers are kept in
one place only, the capture store, which retention and `llmops data forget` reach (issue 74).

The gateway is the one `llmops serve` publishes for this LLMOPS_HOME (server.json): it has the clients whose traffic
is copied. A release attached to another Triton by URL, or one without `llmops serve`, routes through a temporary
gateway of its own that no client calls, and a shadow window there is refused before training.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.control.contract import records_file
from tasks.deploy_canary import Deployment
from tasks.platform.config import GateSection, Profile
from tasks.platform.errors import BadInput
from tasks.platform.stage_cache import RunContext, logger
from tasks.quality.checks import Check, at_most
from tasks.quality.metrics import answer_metric, metric_score
from tasks.quality.stats import paired_difference, wilson_interval
from tasks.reporting.evidence import SHADOW_SUMMARY, release_folder
from tasks.serving.client import TritonTarget
from tasks.serving.publication import serving_gateway

SETTLE_S = 1.0  # after the copy stopped: the copies in flight end
SAMPLE_RECORDS = 20  # copies MLflow keeps (without their text) for a reviewer; the rest are only counted
DISAGREEING_SHOWN = 5  # of them, where the versions answered differently, in the release report


@dataclass
class ShadowResult:
    requests: int  # copies that finished (answered or failed)
    errors: int
    dropped: int  # not sent: the gateway had too many copies in flight
    metric: str  # what agreement is scored with
    compared: int  # answered copies of greedy requests
    agreement: float | None  # mean score of the candidate's answers against the champion's, over `compared`
    agreement_interval: list[float] | None  # at `bench.confidence`
    primary_seconds: float  # latency of the clients' answers, summed over the answered copies
    shadow_seconds: float  # the candidate's latency, summed likewise
    seconds: float
    min_requests: int  # canary.shadow_min_requests: fewer answered copies, and the checks cannot tell

    @property
    def answered(self) -> int:
        return self.requests - self.errors

    def headline(self) -> str:
        agreement = f"agreement {self.agreement:.2f}" if self.agreement is not None else "nothing compared"
        return f"{self.answered} copies answered, {self.errors} failed, {agreement}"

    @property
    def latency_ratio(self) -> float | None:
        return self.shadow_seconds / self.primary_seconds if self.answered and self.primary_seconds > 0 else None


def read_records(path: Path) -> list[dict]:
    """The gateway's records of one window; a line cut short (the gateway stopped mid-write) is left out."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def score(records: list[dict], profile: Profile, seconds: float) -> ShadowResult:
    """The window's result from its records: counts, latencies, agreement with its interval."""
    copies = [r for r in records if not r.get("dropped")]
    answered = [r for r in copies if r.get("candidate") is not None]
    greedy = [r for r in answered if not r["inputs"].get("temperature")]
    metric = answer_metric(profile.evaluate.metric)
    scores = [metric_score(metric, r["candidate"], r["champion"]) for r in greedy]
    agreement, interval = None, None
    if scores:
        agreement = sum(scores) / len(scores)
        if metric == "exact_match":  # a proportion: Wilson's interval holds near 0 and 1, where a bootstrap collapses
            interval = list(wilson_interval(int(sum(scores)), len(scores), profile.bench.confidence))
        else:
            interval = paired_difference(scores, [0.0] * len(scores), profile.bench.confidence).interval()
    return ShadowResult(
        requests=len(copies),
        errors=len(copies) - len(answered),
        dropped=len(records) - len(copies),
        metric=metric,
        compared=len(scores),
        agreement=agreement,
        agreement_interval=interval,
        primary_seconds=sum(r["champion_s"] for r in answered),
        shadow_seconds=sum(r["candidate_s"] for r in answered),
        seconds=seconds,
        min_requests=profile.canary.shadow_min_requests,
    )


def refuse_shadow_without_gateway(profile: Profile, target: TritonTarget | None, home: Path) -> None:
    """A shadow window needs the gateway of `llmops serve` for this LLMOPS_HOME: a release attached to a Triton by
    URL, or one that starts its own, has none to copy its traffic."""
    if profile.canary.shadow_s <= 0:
        return
    if target is not None:
        raise BadInput(
            f"canary.shadow_s: the copies are made by `llmops serve`'s gateway, which a release attached to "
            f"{target.url} does not have; set canary.shadow_s=0"
        )
    if serving_gateway(home) is None:
        raise BadInput(
            f"canary.shadow_s: the copies are made by `llmops serve`'s gateway, and none runs for LLMOPS_HOME {home}; "
            "start `llmops serve` first, or set canary.shadow_s=0"
        )


def shadow(ctx: RunContext, deployment: Deployment) -> ShadowResult | None:
    """Copy live requests to the candidate for canary.shadow_s; None without a shadow window or a champion."""
    cfg = ctx.profile.canary
    if cfg.shadow_s <= 0 or deployment.champion is None or deployment.unchanged:
        return None
    refuse_shadow_without_gateway(ctx.profile, None, ctx.home)  # `llmops serve` may have stopped since the start
    champion, candidate = deployment.champion.name, deployment.candidate.name
    records = records_file(ctx.home / "shadow", candidate)
    records.unlink(missing_ok=True)  # an earlier attempt's window
    started = time.monotonic()
    deployment.route({champion: 100.0}, shadow=cfg.shadow_fraction, hold_s=cfg.shadow_s + 60)
    try:
        logger().info(f"shadow: {cfg.shadow_fraction:.0%} of the gateway's answered requests also go to {candidate}")
        time.sleep(cfg.shadow_s)
    finally:
        deployment.route({champion: 100.0})
    time.sleep(SETTLE_S)
    copies = read_records(records)
    result = score(copies, ctx.profile, time.monotonic() - started)
    ctx.tracker.log_json(
        "shadow_sample.json", {"records": [textless(c) for c in copies[:SAMPLE_RECORDS]], "of": len(copies)}
    )
    keep_summary(ctx, result, copies)
    records.unlink(missing_ok=True)  # live prompts and answers: kept no longer than scoring needs them
    numbers = {k: v for k, v in asdict(result).items() if isinstance(v, (int, float)) and k != "min_requests"}
    ctx.tracker.log_metrics(
        "shadow", numbers | ({"latency_ratio": result.latency_ratio} if result.latency_ratio else {})
    )
    agreement = "n/a" if result.agreement is None else f"{result.metric} {result.agreement:.3f} over {result.compared}"
    logger().info(
        f"shadow: {result.requests} copies in {result.seconds:.1f}s, {result.errors} failed, {result.dropped} "
        f"dropped; the candidate against the champion's answers: {agreement}"
    )
    return result


def textless(copy: dict) -> dict:
    """A copy's record as it may be kept past the window: which request it was, how each version did, no live text
    (the prompt and both answers stay in the capture store alone, where `llmops data forget` reaches them)."""
    answered = copy.get("candidate") is not None
    return {
        "request_id": copy.get("request_id"),
        "agreed": answered and copy["candidate"] == copy.get("champion"),
        "champion_chars": len(copy.get("champion") or ""),
        "candidate_chars": len(copy.get("candidate") or ""),
        "error": copy.get("error"),
        "champion_s": copy.get("champion_s"),
        "candidate_s": copy.get("candidate_s"),
    }


def keep_summary(ctx: RunContext, result: ShadowResult, copies: list[dict]) -> None:
    """The window's numbers and a few requests where the versions disagreed (as MLflow's sample, without text),
    beside the gate's report for the release report."""
    disagreeing = [textless(c) for c in copies if c.get("candidate") is not None and c["candidate"] != c["champion"]][
        :DISAGREEING_SHOWN
    ]
    folder = release_folder(ctx.home, ctx.tracker.run_id)
    folder.mkdir(parents=True, exist_ok=True)
    summary = {**asdict(result), "disagreeing": disagreeing}
    (folder / SHADOW_SUMMARY).write_text(json.dumps(summary, indent=1, ensure_ascii=False))


def shadow_checks(cfg: GateSection, result: ShadowResult) -> list[Check]:
    """The gate's checks of a shadow window: errors, agreement with the champion, latency ratio."""
    if result.answered < result.min_requests:
        return [
            Check(
                "shadow: copies answered (too little traffic to judge)",
                result.answered,
                result.min_requests,
                ">=",
                False,
                inconclusive=True,
            )
        ]
    checks = [at_most("shadow: candidate error rate", result.errors / result.requests, cfg.max_error_rate)]
    if cfg.min_shadow_agreement is not None:
        # decided on the interval, as the benchmark's ratios: pass above it, fail below, inconclusive across
        threshold, interval = cfg.min_shadow_agreement, result.agreement_interval
        verdict = "inconclusive"
        if interval is not None:
            verdict = "pass" if interval[0] >= threshold else "fail" if interval[1] < threshold else "inconclusive"
        name = f"shadow: answers vs the champion's ({result.metric})"
        check = Check(name, result.agreement, threshold, ">=", verdict == "pass", interval, result.compared)
        check.inconclusive = verdict == "inconclusive"
        checks.append(check)
    if cfg.max_latency_ratio is not None and result.latency_ratio is not None:
        checks.append(at_most("shadow: mean latency ratio vs champion", result.latency_ratio, cfg.max_latency_ratio))
    return checks
