"""`llmops data push|validate`: land a dataset where a retrain deployment watches, or check one first."""

from __future__ import annotations

import argparse
import os

from flows.cli.common import prefect_api_env

VALIDATE_DESCRIPTION = (
    "Read, validate, clean and split a dataset the way prepare_data does, without running anything: "
    "records read, duplicates and empty answers dropped, train/eval counts, fingerprint. Bad data "
    "exits 2 with the first error, naming the file, line and field."
)

VALIDATE_EPILOG = (
    "examples:\n  llmops data validate profiles/data/antonyms.jsonl\n"
    "  llmops data validate my_qa.json --format alpaca --eval-source held_out.jsonl\n"
    "  llmops data validate s3://datasets/sft/ --profile cpu-tiny-qa-zh"
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
    validate.add_argument("--eval-source", help="a fixed held-out set (file, folder or s3://), as data.eval_source")
    validate.add_argument(
        "--profile",
        default="cpu-tiny",
        help="profile whose data settings (eval_fraction, split_salt) apply (default: cpu-tiny)",
    )
    validate.set_defaults(handler=validate_data)


def push_data(args) -> str:
    from flows.deploy import push_data

    os.environ.update(prefect_api_env())
    return push_data(args.source, args.destination)


def validate_data(args) -> str:
    from tasks.data.records import read_data
    from tasks.platform.config import load_profile

    overrides = [f"data.eval_source={args.eval_source}"] if args.eval_source else []
    overrides += [f"data.format={args.format}"] if args.format else []
    cfg = load_profile(args.profile, overrides, args.source).data
    data = read_data(cfg)
    stats = data.stats
    lines = [
        f"data {cfg.source}: valid ({cfg.format} format)",
        f"  records read           {stats['records_read']}",
        f"  duplicates dropped     {stats['duplicates_dropped']}",
        f"  empty answers dropped  {stats['empty_answers_dropped']}",
        f"  train / eval           {stats['train_records']} / {stats['eval_records']}"
        + (
            f"  (eval: data.eval_source {cfg.eval_source}, {stats['eval_overlap_dropped']} overlapping records "
            "left out of training)"
            if cfg.eval_source
            else f"  (data.eval_fraction {cfg.eval_fraction})"
        ),
        f"  fingerprint            {data.fingerprint}",
    ]
    return "\n".join(lines)
