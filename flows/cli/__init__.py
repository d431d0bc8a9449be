"""`llmops`: the command line of the release pipeline (entry point `flows.cli:entry`).

One module per command (run, serve, triton, gate, stack, deploy, data, profiles), each registering its subparser and
handlers; app.py builds the parser and runs a command. Exit codes: tasks/platform/errors.py's EXIT_CODES (also
in --help and the README). The last line of a failed command is one `llmops: error: ...` line naming what to
fix; an expected failure (exit codes 2-5) prints no traceback: it is in the run's log file under
$LLMOPS_HOME/logs/ (tasks/platform/run_log.py), and `llmops --debug ...` prints it too.
"""

from flows.cli.app import build_parser, entry, main, prepare_environment, stop_prefect_services

__all__ = ["build_parser", "entry", "main", "prepare_environment", "stop_prefect_services"]
