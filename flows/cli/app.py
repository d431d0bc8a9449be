"""The `llmops` parser (each command's module registers its own subparser and handler), and main: run one
command, stop what it started, print its result or one `llmops: error|rejected: ...` line, return its exit code."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from flows.cli import approval, data, deploy, gate, predict, profiles, run, serve, stack, store, triton
from flows.cli.common import EXIT_CODES, RUN_SERVICES, Rejected
from tasks.platform.project import llmops_home
from tasks.platform.quiet import quiet_libraries
from tasks.platform.run_log import RunLog, exit_code
from tasks.platform.unused_imports import PIPELINE, leave_out

COMMANDS = (run, serve, triton, predict, gate, approval, stack, store, deploy, data, profiles)  # in --help's order

DESCRIPTION = (
    "Release pipeline for fine-tuned LLMs: data -> (Q)LoRA -> merge -> quantize -> Triton canary -> gate -> "
    "promote | rollback."
)
EPILOG = (
    EXIT_CODES
    + "\nstate lives in $LLMOPS_HOME (default ./.llmops); a fresh folder is a fresh start."
    + "\nthe log of a command that runs a flow, tracebacks included: $LLMOPS_HOME/logs/<command>-<time>-<pid>.log"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmops",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of every failure in the terminal too (a run's log always has them)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(commands)
    return parser


def prepare_environment(home: Path) -> None:
    """Keep Prefect's and MLflow's local state under $LLMOPS_HOME; must run before Prefect is imported."""
    os.environ["LLMOPS_HOME"] = str(home)
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    quiet_libraries()
    leave_out(PIPELINE)


@dataclass
class Outcome:
    code: int
    epilogue: str | None = None  # printed on success or rejection: the summary table, a report
    message: str | None = None  # the last line's text on failure
    error: BaseException | None = None


def run_command(args) -> Outcome:
    try:
        return Outcome(0, epilogue=args.handler(args))
    except KeyboardInterrupt:
        return Outcome(130, message="interrupted")
    except Rejected as exc:
        return Outcome(exc.exit_code, epilogue=exc.table, message=str(exc))
    except Exception as exc:
        code, message = describe_failure(exc)
        return Outcome(code, message=message, error=exc)


def describe_failure(exc: BaseException) -> tuple[int, str]:
    from tasks.platform.errors import LlmopsError

    code = exit_code(exc)
    if isinstance(exc, LlmopsError):
        return code, str(exc)
    if code != 1:  # a network fault that outlasted its retries
        return code, f"unreachable after retries: {type(exc).__name__}: {exc}"
    return code, f"{type(exc).__name__}: {exc}"


def stop_prefect_services() -> None:
    """Flush Prefect's log/event queues and stop its temporary API server now, not at interpreter
    exit, so that nothing Prefect prints comes after our last line."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    server_module = sys.modules.get("prefect.server.api.server")  # importing it costs seconds: only if Prefect did
    for server in list(server_module.SubprocessASGIServer._instances.values()) if server_module else []:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    home = llmops_home()
    prepare_environment(home)
    with RunLog(home / "logs", args.command, debug=args.debug) as run_log:
        outcome = run_command(args)
        stop_prefect_services()
        while RUN_SERVICES:
            RUN_SERVICES.pop().stop()
        if outcome.epilogue and outcome.code in (0, Rejected.exit_code):
            print(outcome.epilogue)
        sys.stdout.flush()
        if outcome.message:
            line = f"llmops: {'rejected' if outcome.code == Rejected.exit_code else 'error'}: {outcome.message}"
            if outcome.error is not None:
                run_log.failed(outcome.error, line)
            print(line, file=sys.stderr)
    return outcome.code


def entry() -> None:
    """The `llmops` console command: main(), then a quick exit. The interpreter's teardown of what a run
    imports (torch, transformers, MLflow, Prefect) takes about a second on its own, a tenth of a cached
    rerun; what must happen at exit (the atexit hooks, flushed streams, closed log handlers) is done
    first, then the process ends without the teardown."""
    code = main()
    atexit._run_exitfuncs()  # CPython's exit hooks, now rather than during teardown
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
