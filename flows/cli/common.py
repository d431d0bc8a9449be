"""What several `llmops` commands share: the exit-code epilog, the --set flag, the gate's `Rejected`
outcome, the services a command started for itself, and where the Prefect API is."""

from __future__ import annotations

import argparse
import os

from tasks.platform.errors import REJECTED_EXIT_CODE, exit_codes_text
from tasks.platform.project import llmops_home

EXIT_CODES = exit_codes_text()

RUN_SERVICES: list = []  # what command_run started for this process alone; stopped when main returns


class Rejected(Exception):
    """Not an error of the run: the gate or the canary said no. Exit 10, after the summary."""

    exit_code = REJECTED_EXIT_CODE

    def __init__(self, table: str, message: str):
        self.table = table
        super().__init__(message)


def add_overrides_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    """The repeatable `--set KEY=VALUE` of the commands that load a profile."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=help_text,
    )


def say(line: str) -> None:
    """A progress line, printed at once (a long command's lines must not wait for its end)."""
    print(line, flush=True)


def prefect_api_env() -> dict:
    """PREFECT_API_URL from the environment, else the local stack's; a clear error without either."""
    if os.environ.get("PREFECT_API_URL"):
        return {}
    from tasks.platform.local_stack import require_running

    return require_running(llmops_home())
