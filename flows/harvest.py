"""One harvest of a service's captured traffic against a profile's data: what `llmops data harvest` runs and the
flywheel flow's first step (flows/flywheel.py). No Prefect here, so the command starts without importing it."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from tasks.data.exchanges import default_location, open_exchange_log
from tasks.data.harvest import MinRating, dataset_sha256, harvest, save, save_text
from tasks.data.records import read_data, read_source
from tasks.platform.config import Profile
from tasks.platform.errors import BadInput
from tasks.platform.project import llmops_home
from tasks.platform.stores import open_store
from tasks.quality.chat import Conversation, Message

FLYWHEEL_EXPERIMENT = "llm-flywheel"  # the MLflow experiment of the flywheel's runs (flows/flywheel.py)
SINCE = re.compile(r"^(\d+(?:\.\d+)?)([mhd])$")


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """--since: a span back from now (90m, 24h, 7d) or an ISO 8601 time (UTC unless it says otherwise)."""
    now = now or datetime.now(UTC)
    if match := SINCE.match(text.strip()):
        amount, unit = float(match[1]), match[2]
        return now - timedelta(**{{"m": "minutes", "h": "hours", "d": "days"}[unit]: amount})
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise BadInput(f"--since {text}: expected a span (90m, 24h, 7d) or an ISO 8601 time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@dataclass
class Harvested:
    uri: str | None  # the dataset written; None where nothing was kept
    records: int
    report: dict[str, Any]


def capture_location(config: Profile, location: str | None) -> str:
    """Where the service's exchanges are: as given, else serve.capture.location, else capture/ in the store."""
    if location or config.serve.capture.location:
        return str(location or config.serve.capture.location)
    # the store a run uses (tasks/platform/stores.py:default_services): LLMOPS_ARTIFACTS, else the home's
    return default_location(open_store(os.environ.get("LLMOPS_ARTIFACTS") or None, llmops_home()).uri)


def harvest_dataset(
    config: Profile,
    since: datetime,
    out: str,
    min_rating: MinRating = "good",
    location: str | None = None,
    service: str | None = None,
    trusted: frozenset[str] | None = None,
    pairs: bool = False,
) -> Harvested:
    """Harvest `service` (the profile's registry.model_name by default) against the profile's data (the previous
    training set, config.data.source) and held-out set; the dataset goes to `out` as harvest-SERVICE-TIME.jsonl.
    `trusted`: only these clients' corrections (the flywheel's review rules); None: every client's."""
    service = service or config.registry.model_name
    stage = config.train.stage
    if stage != "sft" and not pairs:
        raise BadInput(
            f"profile {config.name}: train.stage {stage} learns from preference data, not from single answers; "
            "harvest pairs (`llmops data harvest --pairs`)"
        )
    if pairs and stage == "kto":
        raise BadInput(
            f"profile {config.name}: train.stage kto learns from rated answers; harvested pairs are DPO's "
            "(train.stage dpo or sft)"
        )
    log = open_exchange_log(capture_location(config, location))
    if pairs:
        samples = config.flywheel.report_samples
        return harvest_pair_dataset(log, service, since, out, held_out_conversations(config), trusted, samples)
    previous = read_data(config.data)
    result = harvest(log, service, since, min_rating, previous, trusted=trusted)
    report = {
        "service": service,
        "since": since.isoformat(),
        "capture": log.uri,
        **result.report(previous, config.flywheel.report_samples),
    }
    if not result.records:
        return Harvested(None, 0, report)
    name = f"harvest-{service}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}"
    uri = save(result, out, name)
    return Harvested(uri, len(result.records), report | {"dataset": uri, "sha256": dataset_sha256(result)})


def held_out_conversations(config: Profile) -> list[Conversation]:
    """What no harvested pair may take a prompt of: an SFT profile's eval split (its curated exam where it names one);
    a DPO profile's held-out pairs, each its prompt and its chosen answer."""
    if config.train.stage == "sft":
        return read_data(config.data).eval
    from tasks.data.preferences import read_preferences

    held_out = read_preferences(read_source(config.data.source), config.data).eval
    return [[*record.prompt, Message(role="assistant", content=record.chosen)] for record in held_out]


def harvest_pair_dataset(
    log, service: str, since: datetime, out: str, held_out: list, trusted: frozenset[str] | None, samples: int = 0
) -> Harvested:
    """`llmops data harvest --pairs`: preference pairs (tasks/data/harvest_pairs.py) as harvest-pairs-SERVICE-TIME.jsonl."""
    import hashlib

    from tasks.data.harvest_pairs import harvest_pairs, pairs_text

    result = harvest_pairs(log, service, since, held_out, trusted)
    report = {
        "service": service,
        "since": since.isoformat(),
        "capture": log.uri,
        "pairs": True,
        **result.report(samples),
    }
    if not result.pairs:
        return Harvested(None, 0, report)
    text = pairs_text(result)
    uri = save_text(text, out, f"harvest-pairs-{service}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}")
    return Harvested(
        uri, len(result.pairs), report | {"dataset": uri, "sha256": hashlib.sha256(text.encode()).hexdigest()}
    )


def describe(harvested: Harvested) -> str:
    if harvested.report.get("pairs"):
        return describe_pairs(harvested)
    counts, report = harvested.report["counts"], harvested.report
    kept = ", ".join(f"{counts.get(tier, 0)} {tier}" for tier in ("corrected", "good", "unrated"))
    dropped = ", ".join(
        f"{value} {name.removesuffix('_dropped').replace('_', ' ')}"
        for name, value in sorted(counts.items())
        if name.endswith("_dropped") and value
    )
    lines = [
        f"harvest of {report['service']} since {report['since']} from {report['capture']}:",
        f"  exchanges read         {counts.get('exchanges', 0)} ({counts.get('feedback', 0)} feedback)",
        f"  records kept           {harvested.records} ({kept})",
        f"  dropped                {dropped or 'none'}",
        f"  clients                {clients_line(report)}",
        f"  languages              {report['languages'] or '-'}",
        f"  lengths                {report['lengths'] or '-'}",
        f"  shift from the data    {report['shift'].get('prompt_length_ks', '-')} (prompt-length KS statistic)",
        f"  dataset                {harvested.uri or 'none written: no records'}",
    ]
    return "\n".join(lines)


def describe_pairs(harvested: Harvested) -> str:
    counts, report = harvested.report["counts"], harvested.report
    kept = ", ".join(f"{counts.get(tier, 0)} {tier}" for tier in ("corrected", "rated"))
    dropped = ", ".join(
        f"{value} {name.removesuffix('_dropped').replace('_', ' ')}"
        for name, value in sorted(counts.items())
        if name.endswith("_dropped") and value
    )
    return "\n".join(
        [
            f"preference pairs of {report['service']} since {report['since']} from {report['capture']}:",
            f"  exchanges read         {counts.get('exchanges', 0)} ({counts.get('feedback', 0)} feedback)",
            f"  pairs kept             {harvested.records} ({kept})",
            f"  dropped                {dropped or 'none'}",
            f"  clients                {clients_line(report)}",
            f"  dataset                {harvested.uri or 'none written: no pairs'}",
        ]
    )


def clients_line(report: dict[str, Any]) -> str:
    shares = report.get("client_shares") or {}
    listed = ", ".join(f"{name} {share:.0%}" for name, share in list(shares.items())[:5])
    more = f", {len(shares) - 5} more" if len(shares) > 5 else ""
    return f"{len(shares)} ({listed}{more})" if shares else "-"


def review_markdown(harvested: Harvested, samples: bool = True) -> str:
    """What a reviewer reads on the flywheel run's Resume form: the summary, every client's share, and (`samples`)
    the corrections beside the answers they replace."""
    report = harvested.report

    def cell(text: str) -> str:
        return " ".join(str(text).split()).replace("|", "\\|")[:200]

    lines = [
        f"# Harvest of {report['service']}: {harvested.records} records to review",
        "",
        f"Dataset `{report.get('dataset', '-')}` (sha256 `{report.get('sha256', '-')}`).",
        "Approve to push it where retraining watches; reject to delete it.",
        "",
        "```",
        describe(harvested),
        "```",
        "",
        "| client | records | share |",
        "|---|---|---|",
        *(
            f"| {cell(name)} | {count} | {report['client_shares'][name]:.1%} |"
            for name, count in report.get("clients", {}).items()
        ),
    ]
    if samples and report.get("corrections"):
        lines += ["", "| client | prompt | served answer | correction |", "|---|---|---|---|"]
        lines += [
            f"| {cell(c['client'])} | {cell(c['prompt'])} | {cell(c['served'])} | {cell(c['correction'])} |"
            for c in report["corrections"]
        ]
    return "\n".join(lines)


def recorded_datasets() -> list[str]:
    """The harvested datasets the lineage records: pushed by the flywheel (its MLflow runs' harvest.dataset tags)
    and waiting for review in this home (their pending records)."""
    from mlflow import MlflowClient

    from tasks.platform.decisions import waiting_records
    from tasks.platform.tracking import default_tracking_uri

    found = [w["dataset"] for w in waiting_records(llmops_home()) if w.get("kind") == "harvest" and w.get("dataset")]
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri and not (llmops_home() / "mlflow.db").is_file():
        return found  # no tracking server and no local runs: the flywheel never ran from this home
    client = MlflowClient(tracking_uri or default_tracking_uri(llmops_home()))
    experiment = client.get_experiment_by_name(FLYWHEEL_EXPERIMENT)
    if experiment is not None:
        runs = client.search_runs([experiment.experiment_id], "tags.`harvest.pushed` = 'true'", max_results=10_000)
        found += [r.data.tags["harvest.dataset"] for r in runs if r.data.tags.get("harvest.dataset")]
    return found
