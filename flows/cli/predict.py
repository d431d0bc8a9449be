"""`llmops predict`: a dataset answered by a released version through the public OpenAI endpoint of a running
`llmops serve` (tasks/serving/predict.py), with a progress bar, resumable output and an errors file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from flows.cli.common import add_overrides_flag, llmops_home
from tasks.platform.errors import BadInput, TransientError

API_KEY_ENV = "OPENAI_API_KEY"  # what OpenAI clients read: the key this client sends, where the service asks one

EPILOG = """examples:
  llmops predict --data tickets.jsonl --out answers.jsonl           # the champion of the running `llmops serve`
  llmops predict --data prompts.txt --concurrency 16
  llmops predict --data s3://bucket/tickets/ --out answers.jsonl --url https://llm.example.com

input: what prepare_data reads (a file, a folder or an S3 prefix of alpaca, sharegpt or OpenAI-messages records; a
last assistant turn is kept as the reference, not sent), {"prompt": ...} records, or a text file of one prompt a
line. output: JSONL, one row per answered input in input order (id, prompt, answer, tokens, latency_s,
finish_reason[, reference]); a rerun skips ids already there. Rows that could not be read or answered go to
--errors (default OUT.errors.jsonl) with their line and reason; the exit status is then 2 (unreadable rows, or rows
the service refused) or 4 (the service failed some after retries). The service must be running (`llmops serve`);
it answers its champion by the service's name; another version only where its gateway lists it by name.
API key: $OPENAI_API_KEY; a private CA: $SSL_CERT_FILE."""


def register(commands) -> None:
    predict = commands.add_parser(
        "predict",
        help="answer a dataset with a released version through the service's OpenAI endpoint",
        description="Send each row of a dataset to a released version of a running `llmops serve`, as many at "
        "once as its engine batches, and write the answers in input order.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    predict.add_argument(
        "--data", required=True, help="dataset: a file (.jsonl, .json, or text: a prompt a line), folder or s3:// URI"
    )
    predict.add_argument(
        "--version", default="champion", help="champion (default), challenger, or a version number of the model"
    )
    predict.add_argument("--out", type=Path, help="output JSONL (default: DATA's name with .answers.jsonl)")
    predict.add_argument("--errors", type=Path, help="rows not answered, with reasons (default: OUT.errors.jsonl)")
    predict.add_argument(
        "--concurrency",
        type=int,
        help="requests in flight (default: what the version's engine batches: serve.max_batch_size, times the "
        "instances of the Python model; engine.max_batch_size on the LLM API)",
    )
    predict.add_argument("--max-tokens", type=int, help="answer length cap (default: the service's default)")
    predict.add_argument(
        "--url", help="the service's gateway (default: the `llmops serve` running for this LLMOPS_HOME)"
    )
    predict.add_argument("--profile", default="cpu-tiny", help="the profile the service was released with")
    add_overrides_flag(predict, "override a profile value (repeatable)")
    predict.add_argument(
        "--tracking-uri", help="MLflow tracking URI of the registry (default: sqlite under $LLMOPS_HOME)"
    )
    predict.set_defaults(handler=command_predict)


def command_predict(args) -> str:
    from tasks.platform.config import load_profile

    if args.concurrency is not None and args.concurrency < 1:
        raise BadInput(f"--concurrency {args.concurrency}: must be 1 or more")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise BadInput(f"--max-tokens {args.max_tokens}: must be 1 or more")
    output = args.out or default_output(args.data)
    errors = args.errors or errors_beside(output)
    profile = load_profile(args.profile, args.overrides)
    summary = run_predict(
        profile, args.data, output, errors, args.version, args.concurrency, args.max_tokens, args.url, args.tracking_uri
    )
    return outcome(summary)


def run_predict(
    profile,
    data: str,
    output: Path,
    errors: Path,
    version: str = "champion",
    concurrency: int | None = None,
    max_tokens: int | None = None,
    url: str | None = None,
    tracking_uri: str | None = None,
):
    """`llmops predict` and the scheduled `predict` flow alike: the rows of `data` answered by `version` of the
    service at `url` (default: the running `llmops serve` of this LLMOPS_HOME) into `output`."""
    import asyncio

    from tasks.data.prompt_rows import read_rows
    from tasks.platform.tracking import default_tracking_uri
    from tasks.serving.predict import Requests, predict, registered_target

    base_url = url or running_gateway()
    rows = read_rows(data)
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(llmops_home())
    target = registered_target(profile, version, tracking_uri, batch_known=concurrency is not None)
    service = profile.registry.model_name
    requests = Requests(base_url, service, max_tokens, os.environ.get(API_KEY_ENV))
    bars: list = []  # the bar starts with the first row, once the service has answered GET /v1/models

    def advance(rows_done: int) -> None:
        if not bars:
            bars.append(progress_bar(len(rows)))
        bars[0].update(rows_done)

    try:
        return asyncio.run(
            predict(rows, requests, service, target, output, errors, concurrency or target.batch, API_KEY_ENV, advance)
        )
    finally:
        for bar in bars:
            bar.close()


def outcome(summary) -> str:
    """The run's line; rows not answered make it an error: 4 where the service failed some, else 2."""
    if summary.service_failures:
        raise TransientError(summary.describe())
    if summary.failed:
        raise BadInput(summary.describe())
    return summary.describe()


def errors_beside(output: Path) -> Path:
    return output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")


def default_output(data: str) -> Path:
    path = Path(data)
    if path.is_file():
        return path.with_name(path.stem + ".answers.jsonl")
    if data.startswith("s3://") or path.is_dir():
        raise BadInput(f"--data {data}: name the output with --out (the default sits beside a local file)")
    raise BadInput(f"--data {data}: no such file or folder")


def running_gateway() -> str:
    from tasks.serving.server import serving_gateway

    url = serving_gateway(llmops_home())
    if url is None:
        raise BadInput(
            f"no `llmops serve` runs for LLMOPS_HOME {llmops_home()}: start one (`llmops serve`), "
            "or name a service with --url"
        )
    return url


def progress_bar(total: int):
    """rows/s and the ETA on stderr (a line a minute where stderr is not a terminal, e.g. a log file)."""
    import sys

    from tqdm import tqdm

    return tqdm(
        total=total,
        unit="row",
        desc="predict",
        dynamic_ncols=True,
        smoothing=0.1,
        file=sys.stderr,
        mininterval=0.2 if sys.stderr.isatty() else 60,
    )
