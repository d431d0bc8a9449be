"""`llmops data push|validate|harvest|forget`: land a dataset where a retrain deployment watches, check one first,
build one from what the service served (serve.capture) and how its clients judged it, or remove a client's data
from all of that."""

from __future__ import annotations

import argparse
import os

from flows.cli.common import prefect_api_env

VALIDATE_DESCRIPTION = (
    "Read, validate, clean and split a dataset the way prepare_data does, without running anything: "
    "records read, duplicates and empty answers dropped, train/eval counts, fingerprint. Preference data "
    "(LlamaFactory's chosen/rejected pairs or KTO's kto_tag) is read as a preference stage would: pairs, prompts and "
    "a split by prompt. Bad data exits 2 with the first error, naming the file, line and field."
)

VALIDATE_EPILOG = (
    "examples:\n  llmops data validate profiles/data/antonyms.jsonl\n"
    "  llmops data validate my_qa.json --format alpaca --eval-data held_out.jsonl\n"
    "  llmops data validate s3://datasets/sft/ --profile cpu-tiny-qa-zh\n"
    "  llmops data validate profiles/data/antonym-pairs.jsonl"
)


def register(commands) -> None:
    data = commands.add_parser(
        "data",
        help="push a dataset to a watched data location (starts a retrain)",
        description="Upload a dataset file or folder to a data location (s3:// prefix or folder) and emit the "
        "`llmops.data.landed` event, which the retrain deployment's trigger reacts to.",
        epilog="example:\n  llmops data push profiles/data/antonyms.jsonl s3://datasets/sft/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = data.add_subparsers(dest="action", required=True, metavar="ACTION")
    push = actions.add_parser(
        "push",
        help="upload a dataset and emit llmops.data.landed",
        description="Upload SOURCE (file or folder) under DESTINATION and emit the event.",
    )
    push.add_argument("source", help="local dataset file or folder")
    push.add_argument("destination", help="s3://bucket/prefix/ or a folder: the location a retrain deployment watches")
    push.set_defaults(handler=push_data)
    register_validate(actions)
    register_harvest(actions)
    register_forget(actions)


def register_forget(actions) -> None:
    forget = actions.add_parser(
        "forget",
        help="remove a client's captured exchanges, feedback and harvested records (a deletion request)",
        description="Remove everything of one client the flywheel keeps: its captured exchanges and feedback of the "
        "service (serve.capture.location), and its records in every harvested dataset the lineage records (the "
        "datasets the flywheel pushed, from its MLflow runs, and those waiting for review in this home).",
        epilog="example:\n  llmops data forget --client team-b --profile cpu-tiny",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    forget.add_argument("--client", required=True, help="the client's name (its API key's name)")
    forget.add_argument("--service", help="the served model's name (default: the profile's registry.model_name)")
    forget.add_argument("--profile", default="cpu-tiny", help="profile of the service: its model name and capture")
    forget.add_argument("--capture", help="capture location (default: serve.capture.location, else the store's)")
    forget.add_argument(
        "--dataset", action="append", default=[], help="a further harvested dataset to clean (file or s3:// URI)"
    )
    forget.set_defaults(handler=forget_client)


def forget_client(args) -> str:
    from flows.harvest import capture_location, recorded_datasets
    from tasks.data.exchanges import open_exchange_log
    from tasks.data.forget import forget_client
    from tasks.platform.config import load_profile
    from tasks.platform.errors import BadInput

    if not args.client.strip():
        raise BadInput("--client: a client's name is needed")
    config = load_profile(args.profile)
    service = args.service or config.registry.model_name
    log = open_exchange_log(capture_location(config, args.capture))
    found = forget_client(log, service, args.client, recorded_datasets() + args.dataset)
    return found.describe(f"client {args.client} of {service}")


def register_validate(actions) -> None:
    validate = actions.add_parser(
        "validate",
        help="check a dataset and print what prepare_data would see",
        description=VALIDATE_DESCRIPTION,
        epilog=VALIDATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument("source", help="dataset file, folder or s3:// URI")
    validate.add_argument(
        "--format",
        choices=["auto", "alpaca", "sharegpt", "openai"],
        help="record format (default: the profile's data.format, usually auto)",
    )
    validate.add_argument(
        "--eval-data",
        "--eval-source",
        dest="eval_data",
        metavar="PATH|s3://|profile",
        help="the held-out set, as `llmops run --eval-data` takes it (default: as `llmops run --data SOURCE` splits)",
    )
    validate.add_argument(
        "--profile",
        default="cpu-tiny",
        help="profile whose data settings (eval_fraction, split_salt) apply (default: cpu-tiny)",
    )
    validate.set_defaults(handler=validate_data)


HARVEST_DESCRIPTION = (
    "Build a training set from the exchanges the service's gateway captured (serve.capture) and the feedback its "
    "clients sent (POST /v1/feedback): corrected answers first, well-rated answers next, answers rated bad out; "
    "near-duplicates, prompts of the held-out eval set and records the data already holds are dropped and counted. "
    "Writes harvest-SERVICE-TIME.jsonl under --out (push it with `llmops data push`) and prints a report: counts, "
    "languages, lengths and the shift from the previous data. With --pairs: preference pairs for train.stage dpo "
    "(harvest-pairs-SERVICE-TIME.jsonl): a client's correction against the answer it was served, and one client's "
    "answers to one prompt rated good and bad."
)
HARVEST_EPILOG = (
    "examples:\n  llmops data harvest --service tiny-qwen2-antonyms --since 24h --out harvested/\n"
    "  llmops data push harvested/ s3://datasets/sft/\n"
    "  llmops data harvest --profile cpu-tiny --data s3://datasets/sft/ --since 2026-11-24T00:00 "
    "--min-rating none --out s3://datasets/harvest/ --report report.json\n"
    "  llmops data harvest --pairs --since 7d --out pairs/"
)


def register_harvest(actions) -> None:
    harvest = actions.add_parser(
        "harvest",
        help="build a training set from captured exchanges and feedback",
        description=HARVEST_DESCRIPTION,
        epilog=HARVEST_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    harvest.add_argument("--out", required=True, help="folder or s3:// prefix the dataset is written to")
    harvest.add_argument("--service", help="the served model's name (default: the profile's registry.model_name)")
    harvest.add_argument("--since", default="24h", help="a span back from now (90m, 24h, 7d) or an ISO time (24h)")
    harvest.add_argument(
        "--min-rating",
        choices=["good", "none"],
        default="good",
        help="good: corrected and well-rated answers only (default); none: unrated answers too",
    )
    harvest.add_argument(
        "--profile", default="cpu-tiny", help="profile of the service: its model name, capture and data settings"
    )
    harvest.add_argument("--data", help="the data the last release trained on (default: the profile's data.source)")
    harvest.add_argument("--capture", help="capture location (default: serve.capture.location, else the store's)")
    harvest.add_argument("--report", help="also write the report as JSON to this file")
    harvest.add_argument(
        "--pairs",
        action="store_true",
        help="preference pairs for train.stage dpo instead: a correction against the served answer, and one "
        "client's answers to one prompt rated good and bad",
    )
    harvest.set_defaults(handler=harvest_data)


def harvest_data(args) -> str:
    import json

    from flows.harvest import describe, harvest_dataset, parse_since
    from tasks.platform.config import PROFILE_EXAM, load_profile

    config = load_profile(args.profile, [], args.data, PROFILE_EXAM)  # the curated exam, as the flywheel's
    service = args.service or config.registry.model_name
    harvested = harvest_dataset(
        config, parse_since(args.since), args.out, args.min_rating, args.capture, service, pairs=args.pairs
    )
    if args.report:
        with open(args.report, "w", encoding="utf-8") as stream:
            json.dump(harvested.report, stream, indent=1, ensure_ascii=False)
    return describe(harvested)


def push_data(args) -> str:
    from flows.deploy import push_data

    os.environ.update(prefect_api_env())
    return push_data(args.source, args.destination)


def validate_data(args) -> str:
    from tasks.data.preferences import is_preference_data
    from tasks.data.records import clean_and_split, read_exams, read_source
    from tasks.platform.config import load_profile

    overrides = [f"data.format={args.format}"] if args.format else []
    profile = load_profile(args.profile, overrides, args.source, args.eval_data)
    cfg = profile.data
    files = read_source(cfg.source)
    if is_preference_data(files):
        return preference_lines(files, profile, args.eval_data)
    data = clean_and_split(files, cfg, *read_exams(cfg))  # the files read once
    stats = data.stats
    lines = [
        f"data {cfg.source}: valid ({cfg.format} format)",
        f"  records read           {stats['records_read']}",
        f"  duplicates dropped     {stats['duplicates_dropped']}",
        f"  empty answers dropped  {stats['empty_answers_dropped']}",
        f"  train / eval           {stats['train_records']} / {stats['eval_records']}  (eval: {data.eval_split}"
        + (
            f", {stats['eval_overlap_dropped']} overlapping records left out of training)"
            if "eval_overlap_dropped" in stats
            else f" at data.eval_fraction {cfg.eval_fraction})"
        ),
        f"  fingerprint            {data.fingerprint}",
        *judging_lines(profile, data),
    ]
    return "\n".join(lines)


def preference_lines(files, profile, eval_data: str | None) -> str:
    """What a preference stage would train on: pairs (or KTO's rated answers) split by prompt."""
    from tasks.data.preferences import describe_kind, read_preferences
    from tasks.platform.errors import BadInput

    if eval_data:
        raise BadInput(
            "--eval-data: preference data splits by prompt at data.eval_fraction; a held-out set is not read"
        )
    cfg = profile.data
    data = read_preferences(files, cfg)
    unit = "pairs" if data.kind == "pairs" else "rated answers"
    rated = ""
    if data.kind == "kto":
        desirable = sum(1 for r in data.train + data.eval if r.desirable)
        rated = f"\n  desirable / not        {desirable} / {len(data.train) + len(data.eval) - desirable}"
    harvested = sum(r.harvested for r in data.train)
    if harvested or data.harvested_held_out:
        rated += (
            f"\n  harvested              {harvested} trained on, {data.harvested_held_out} left out (their prompt "
            "in the eval split); a release on them waits for a person (gate.approval harvested)"
        )
    return (
        f"data {cfg.source}: valid {describe_kind(data.kind)} records ({cfg.format} format)\n"
        f"  records read           {data.read}\n"
        f"  duplicates dropped     {data.duplicates}\n"
        f"  prompts                {data.prompts}{rated}\n"
        f"  train / eval {unit:<9} {len(data.train)} / {len(data.eval)}  (eval: {data.eval_prompts} prompts hashed "
        f"at data.eval_fraction {cfg.eval_fraction}; no prompt in both)\n"
        f"  fingerprint            {data.fingerprint}"
    )


def judging_lines(profile, data) -> list[str]:
    """How evaluate would judge the eval split (tasks/quality/answer_kind.py): the metric from the references, the
    answer length in the base model's tokens where this machine has its tokenizer without a download (cpu-tiny's is
    trained on the training split, as the base_model stage trains it; a local model folder has its own)."""
    from tasks.quality.answer_kind import decide

    split = data.eval[: profile.evaluate.max_samples]
    if not split:
        return []
    tokenizer = local_tokenizer(profile, data)
    if tokenizer is None and profile.evaluate.max_new_tokens == "auto":
        metric = decide(profile.evaluate.model_copy(update={"max_new_tokens": 1}), split)[1].metric
        length = f"auto: from {profile.base_model.source}'s tokenizer when the run has it"
    else:
        judging = decide(profile.evaluate, split, tokenizer)[1]
        metric, length = judging.metric, f"{judging.answer_tokens.value} tokens ({judging.answer_tokens.why})"
    return [f"  metric                 {metric.value} ({metric.why})", f"  answers of up to       {length}"]


def local_tokenizer(profile, data):
    """The base model's tokenizer where it needs no download, else None."""
    from pathlib import Path

    source = profile.base_model.source
    if source == "tiny-qwen2":
        from tasks.base_model import corpus, train_tokenizer

        return train_tokenizer(corpus(data.train), profile.base_model.tiny.vocab_size)
    if Path(source).is_dir():
        from tasks.quality.models import load_tokenizer

        return load_tokenizer(Path(source))
    return None
