"""`llmops predict`: a dataset answered by a released version through the public OpenAI endpoint of a running
`llmops serve` (tasks/serving/predict.py), with a progress bar, resumable output and an errors file."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows.cli.common import add_overrides_flag
from tasks.platform.errors import BadInput, TransientError
from tasks.platform.project import llmops_home

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
the service refused) or 4 (the service failed some after retries). A running `llmops serve` answers its champion by the service's
name, another version only where its gateway lists it by name; where no `llmops serve` runs for this LLMOPS_HOME (and
no --url is given), predict starts a Triton and a gateway of its own for the version (from --artifacts), on loopback,
and stops them when done.
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
    predict.add_argument(
        "--artifacts",
        help="artifact store of the version's files, where predict starts its own Triton (default: $LLMOPS_HOME/store)",
    )
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
        profile,
        args.data,
        output,
        errors,
        args.version,
        args.concurrency,
        args.max_tokens,
        args.url,
        args.tracking_uri,
        args.artifacts,
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
    artifacts: str | None = None,
):
    """`llmops predict` and the scheduled `predict` flow alike: the rows of `data` answered by `version` of the
    service at `url` (default: the running `llmops serve` of this LLMOPS_HOME; where none runs, a Triton and a gateway
    of this run's own serving `version` from the store at `artifacts`) into `output`."""
    from tasks.data.prompt_rows import read_rows
    from tasks.platform.tracking import default_tracking_uri
    from tasks.serving.predict import Target, registered_target, registered_version

    rows = read_rows(data)
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(llmops_home())
    base_url = url or running_gateway()
    if base_url is not None:
        target = registered_target(profile, version, tracking_uri, batch_known=concurrency is not None)
        return answer_rows(profile, rows, base_url, target, output, errors, concurrency, max_tokens)
    from flows.serve_alone import serving_alone
    from tasks.serving.predict import engine_batch, released_settings

    found, _ = registered_version(profile, version, tracking_uri)
    print(
        f"predict: no `llmops serve` runs for LLMOPS_HOME {llmops_home()}: starting a Triton and a gateway of its own "
        f"for {profile.registry.model_name} v{found.version} (stopped when done)",
        file=sys.stderr,
        flush=True,
    )
    batch = engine_batch(released_settings(profile, found.tags.get("serve.model_settings")))
    with serving_alone(profile, found, tracking_uri, artifacts) as base_url:
        # the version is the only one this gateway serves: under the service's name, as its champion
        return answer_rows(profile, rows, base_url, Target(None, None, batch), output, errors, concurrency, max_tokens)


def answer_rows(profile, rows, base_url: str, target, output: Path, errors: Path, concurrency, max_tokens):
    import asyncio

    from tasks.serving.predict import Requests, predict

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


def running_gateway() -> str | None:
    """The gateway of the `llmops serve` running for this LLMOPS_HOME, if one runs."""
    from tasks.serving.publication import serving_gateway

    return serving_gateway(llmops_home())


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
