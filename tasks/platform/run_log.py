"""The log file of one `llmops` command, and one terminal line for an expected failure instead of a traceback.

Prefect's run loggers log a failed task or flow with its exception's traceback (Prefect 3.7's task engine:
"Task run failed with exception: ..." in `handle_retry`; its flow engine: "Encountered exception during
execution" in `run_context`, both with exc_info), and the root logger's console handler prints it: some 40
lines above the `llmops: error: ...` line for a check that failed as designed. Here every record of a run,
tracebacks included, goes to $LLMOPS_HOME/logs/<command>-<time>-<pid>.log, and the terminal shows a record
of an expected failure (exit codes 2-5) as its message line and the log's path. Unexpected exceptions
(exit code 1: bugs) keep their traceback in the terminal; `llmops --debug` keeps every traceback there.

How it hooks in: Prefect configures logging when it is imported, with `logging.config.dictConfig`, which
replaces the root logger's handlers (so a handler installed before would be dropped) but keeps the filters of
the loggers it configures. A filter on Prefect's run loggers therefore sees each run record first, once
Prefect's handlers exist, and installs the file handler and the console's formatter there. Commands that run
no flow write no log file (bad input creates nothing under $LLMOPS_HOME).
"""

from __future__ import annotations

import copy
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType

from tasks.platform.errors import LlmopsError, TransientError, is_transient

RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # Prefect's loggers of flow and task runs
FILE_FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | %(name)s - %(message)s"


def exit_code(exc: BaseException) -> int:
    """The documented exit code of a failure (tasks/platform/errors.py's EXIT_CODES); 1 for anything unexpected."""
    if isinstance(exc, LlmopsError):
        return exc.exit_code
    if is_transient(exc):
        return TransientError.exit_code
    return 1


def expected(exc: BaseException) -> bool:
    """Bad input, a failed check, an unreachable service, a missing artifact: not a bug, no traceback needed."""
    return exit_code(exc) != 1


class RunLog(logging.Filter):
    """Use as a context manager around one command; `failed` reports its failure (file and terminal)."""

    def __init__(self, folder: Path, command: str, debug: bool = False):
        super().__init__()
        self.path = folder / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        self.debug = debug
        self.file: logging.FileHandler | None = None
        self.lock = threading.Lock()  # task runs may log from several threads
        self.logged: list[BaseException] = []  # exceptions whose traceback the run's log already holds
        self.shown: list[BaseException] = []  # exceptions whose traceback the terminal already printed

    def __enter__(self) -> RunLog:
        for name in RUN_LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
    ) -> None:
        for name in RUN_LOGGERS:
            logging.getLogger(name).removeFilter(self)
        root = logging.getLogger()
        for handler in root.handlers:
            if isinstance(handler.formatter, OneLineFailures):
                handler.setFormatter(handler.formatter.inner)
        if self.file is not None:
            root.removeHandler(self.file)
            self.file.close()

    def filter(self, record: logging.LogRecord) -> bool:
        self.route()
        if record.exc_info and record.exc_info[1] is not None:
            self.logged.append(record.exc_info[1])
        return True

    def route(self) -> None:
        """The run's records to the file, and the terminal's tracebacks of expected failures out of the way."""
        root = logging.getLogger()
        with self.lock:
            if self.file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.file = logging.FileHandler(self.path, encoding="utf-8")
                self.file.setFormatter(file_formatter())
            if self.file not in root.handlers:
                root.addHandler(self.file)
            for handler in root.handlers:
                if is_terminal(handler) and not isinstance(handler.formatter, OneLineFailures):
                    handler.setFormatter(OneLineFailures(handler.formatter, self))

    def failed(self, exc: BaseException, line: str) -> None:
        """The command's failure: its traceback and last line to the run's log, if it has one; its traceback to
        the terminal too for a bug, or with --debug, unless Prefect's logging showed it there already."""
        trace = "".join(traceback.format_exception(exc))
        if self.file is not None:
            failure = None if any(exc is logged for logged in self.logged) else (type(exc), exc, exc.__traceback__)
            self.file.handle(
                logging.makeLogRecord(
                    {"name": "llmops", "levelno": logging.ERROR, "levelname": "ERROR", "msg": line, "exc_info": failure}
                )
            )
        if (self.debug or not expected(exc)) and not any(exc is shown for shown in self.shown):
            sys.stderr.write(trace)


def is_terminal(handler: logging.Handler) -> bool:
    return isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)


def file_formatter() -> logging.Formatter:
    """Prefect's format (task and flow run names on their records), with the date: a log outlives its day."""
    try:
        from prefect.logging.formatters import PrefectFormatter
    except ImportError:
        return logging.Formatter(FILE_FORMAT, "%Y-%m-%d %H:%M:%S")
    return PrefectFormatter(
        FILE_FORMAT,
        "%Y-%m-%d %H:%M:%S",
        flow_run_fmt=FILE_FORMAT.replace("%(name)s", "Flow run %(flow_run_name)r"),
        task_run_fmt=FILE_FORMAT.replace("%(name)s", "Task run %(task_run_name)r"),
    )


class OneLineFailures(logging.Formatter):
    """A terminal formatter around the handler's own: a record of an expected failure loses its traceback and
    names the run's log instead (unless --debug)."""

    def __init__(self, inner: logging.Formatter | None, run_log: RunLog):
        super().__init__()
        self.inner = inner or logging.Formatter()
        self.run_log = run_log

    def format(self, record: logging.LogRecord) -> str:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return self.inner.format(record)
        if self.run_log.debug or not expected(exc):
            self.run_log.shown.append(exc)
            return self.inner.format(record)
        line = copy.copy(record)  # the other handlers (the run's log, Prefect's API) keep the traceback
        line.msg, line.args = f"{record.getMessage()} (traceback in {self.run_log.path})", None
        line.exc_info, line.exc_text = None, None
        return self.inner.format(line)


class Said(logging.Handler):
    """The project's log lines (the `llmops` logger, which a thread outside a flow logs to) of one thread while the
    block runs: what a service's load said, sent back to the release that asked for it, whose terminal showed those
    lines when it loaded its versions itself."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.thread, self.lines = threading.get_ident(), list[str]()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append(record.getMessage())

    def __enter__(self) -> list[str]:
        log = logging.getLogger("llmops")
        self.level = log.level
        log.addHandler(self)
        if not log.isEnabledFor(logging.INFO):
            log.setLevel(logging.INFO)
        return self.lines

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("llmops")
        log.removeHandler(self)
        log.setLevel(self.level)
