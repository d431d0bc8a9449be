"""`llmops`: the command line of the release pipeline.

Exit codes: 0 ok, 2 bad input (data, profile, arguments), 3 a stage's check failed,
4 a service stayed unreachable after retries, 5 an artifact is missing or corrupt, 1 anything else.
The last line of a failed command is one `llmops: error: ...` line naming what to fix.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_CODES = """exit codes:
  0  success
  2  bad input: data, profile or arguments (nothing is written)
  3  a stage's check failed (evaluation margin, merge exactness, quantization accuracy)
  4  a service (S3, MLflow, Prefect) stayed unreachable after retries
  5  an artifact is missing or does not match its sha256
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmops", description="Release pipeline for fine-tuned LLMs: data -> QLoRA -> merge -> quantize -> registry.",
        epilog=EXIT_CODES + "\nstate lives in $LLMOPS_HOME (default ./.llmops); a fresh folder is a fresh start.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run", help="run the release flow on a profile",
        description="Run the release DAG. Stages whose inputs did not change are cache hits.",
        epilog=EXIT_CODES + """
examples:
  llmops run                                         # embedded default: cpu-tiny, no server needed
  llmops run --set train.learning_rate=1e-3 --set evaluate.max_new_tokens=4
  llmops run --data s3://datasets/sft/ --artifacts s3://artifacts/llmops --tracking-uri http://127.0.0.1:5000
  (S3 endpoint/credentials: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...; Prefect server: PREFECT_API_URL)""",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--profile", default="cpu-tiny", help="profile name in profiles/ or a YAML path (default: cpu-tiny)")
    run.add_argument("--data", help="dataset file, folder or s3:// URI (overrides data.source)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a profile value, e.g. train.learning_rate=1e-4 (repeatable)")
    run.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under $LLMOPS_HOME)")
    run.add_argument("--artifacts", help="artifact store: folder or s3://bucket/prefix (default: $LLMOPS_HOME/store)")

    profiles = commands.add_parser("profiles", help="list, show or validate profiles",
                                   description="Inspect the run profiles in profiles/.")
    actions = profiles.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="list the available profiles", description="List profiles with their descriptions.")
    for action, text in (("show", "print a profile with every default filled in"),
                         ("validate", "check a profile (and overrides) without running anything")):
        sub = actions.add_parser(action, help=text, description=text.capitalize() + ".")
        sub.add_argument("profile", help="profile name or YAML path")
        sub.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                         help="override a profile value (repeatable)")
    return parser


def prepare_environment(home: Path) -> None:
    """Keep Prefect's and MLflow's local state under $LLMOPS_HOME; must run before Prefect is imported."""
    os.environ["LLMOPS_HOME"] = str(home)
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def check_machine(profile) -> None:
    """A GPU profile on a machine without CUDA fails here, before any stage does work."""
    from tasks.errors import BadInput

    if profile.hardware.accelerator != "cuda":
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < profile.hardware.gpus:
        raise BadInput(f"profile {profile.name}: hardware needs {profile.hardware.gpus} CUDA GPU(s), this machine has "
                       f"{found}; run it on a GPU machine or pick a CPU profile (llmops profiles list)")


def summary(result) -> str:
    rows = [(s.stage, "cached" if s.cached else "ran", f"{s.seconds:.1f}", s.headline) for s in result.stages]
    rows.append(("register", "reused" if result.registered.reused else "new", "",
                 f"{result.registered.name} v{result.registered.version}"))
    widths = [max(len(r[i]) for r in rows + [("stage", "result", "seconds", "key metric")]) for i in range(4)]
    line = "  ".join("{:<%d}" % w for w in widths)
    table = [line.format("stage", "result", "seconds", "key metric"), line.format(*("-" * w for w in widths))]
    table += [line.format(*row).rstrip() for row in rows]
    return "\n".join(["", *table, "", f"MLflow run: {result.tracker.url()}",
                      f"model: models:/{result.registered.name}/{result.registered.version}  source {result.registered.source}"])


def command_run(args) -> str:
    from tasks.config import load_profile

    profile = load_profile(args.profile, args.overrides, args.data)  # bad input fails before anything is created
    check_machine(profile)
    Path(os.environ["LLMOPS_HOME"]).mkdir(parents=True, exist_ok=True)
    from flows.release import release

    result = release(profile=args.profile, data_source=args.data, overrides=args.overrides,
                     tracking_uri=args.tracking_uri, artifacts=args.artifacts)
    return summary(result)


def command_profiles(args) -> None:
    import yaml

    from tasks.config import available_profiles, load_profile

    if args.action == "list":
        for name in available_profiles():
            profile = load_profile(name)
            print(f"{name:28} {profile.hardware.accelerator:5} {profile.description}")
    elif args.action == "show":
        print(yaml.safe_dump(load_profile(args.profile, args.overrides).model_dump(mode="json"), sort_keys=False), end="")
    else:
        profile = load_profile(args.profile, args.overrides)
        print(f"profile {profile.name}: valid (digest {profile.digest[:12]})")


def stop_prefect_services() -> None:
    """Flush Prefect's log/event queues and stop its temporary API server now, not at interpreter
    exit, so that nothing Prefect prints comes after our last line."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.server.api.server import SubprocessASGIServer

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    for server in list(SubprocessASGIServer._instances.values()):
        server.stop()


def describe_failure(exc: BaseException) -> tuple[int, str]:
    from tasks.errors import LlmopsError, is_transient

    if isinstance(exc, LlmopsError):
        return exc.exit_code, str(exc)
    if is_transient(exc):
        return 4, f"unreachable after retries: {type(exc).__name__}: {exc}"
    return 1, f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prepare_environment(Path(os.environ.get("LLMOPS_HOME", ".llmops")).resolve())
    epilogue = None
    try:
        epilogue = {"run": command_run, "profiles": command_profiles}[args.command](args)
        code, message = 0, None
    except KeyboardInterrupt:
        code, message = 130, "interrupted"
    except Exception as exc:
        code, message = describe_failure(exc)
    stop_prefect_services()
    if code == 0 and epilogue:
        print(epilogue)
    sys.stdout.flush()
    if message:
        print(f"llmops: error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
