"""The gateway's log lines (its access log and its fault log), written to a stream by a thread of their own.

A handler that writes on the event loop's thread stops every request once the stream stops taking lines:
`llmops serve` with its stderr a pipe that nobody reads (a supervisor that reads it late, a paused
`llmops serve 2>&1 | less`) answered 385 requests and then none, /health included, once the pipe's 64 KiB were
full. Here the loop only appends the record to a deque; every `every_s` the writer formats what waits and writes it
in one call. While `lines` wait, further lines are dropped, and the writer says how many before the next it writes.

Not logging.handlers.QueueHandler/QueueListener: their queue wakes the writer for each line, which cost the gateway
8% more CPU per request than writing each line itself (benchmarks/gateway_overhead.py's gateway, concurrency 8);
one write every `every_s` costs less than either.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterable
from typing import TextIO

LINES = 10_000  # lines waiting for the stream (about 2 MB of access log) before lines are dropped
EVERY_S = 0.1  # how often the writer writes what waits: a line appears at most this late
FORMAT = "%(asctime)s %(name)s %(message)s"


class WaitingLines(logging.Handler):
    """The records logged and not yet written, up to `lines`; past that each is dropped and counted."""

    def __init__(self, lines: int) -> None:
        super().__init__()
        self.lines = lines
        self.waiting: collections.deque[logging.LogRecord] = collections.deque()
        self.dropped = 0
        self.counting = threading.Lock()  # the fault log is written from worker threads too (asyncio.to_thread)

    def handle(self, record: logging.LogRecord) -> bool:
        # no lock, no filters: a deque's append is atomic, and the loggers this handler serves have no filters
        if len(self.waiting) < self.lines:
            self.waiting.append(record)
        else:
            with self.counting:
                self.dropped += 1
        return True

    def emit(self, record: logging.LogRecord) -> None:  # pragma: no cover -- handle() does its work
        self.handle(record)


class LogWriter:
    """Loggers whose lines go to `stream` from a daemon thread: start() attaches them, close() detaches them."""

    def __init__(self, stream: TextIO, lines: int = LINES, every_s: float = EVERY_S) -> None:
        self.handler = WaitingLines(lines)
        self.stream, self.every_s = stream, every_s
        self.formatter = logging.Formatter(FORMAT)
        self.reported = 0  # drops already said
        self.loggers: list[logging.Logger] = []
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self.write, name="gateway-log", daemon=True)

    def start(self, names: Iterable[str]) -> LogWriter:
        for name in names:
            logger = logging.getLogger(name)
            logger.addHandler(self.handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
            self.loggers.append(logger)
        self.thread.start()
        return self

    def write(self) -> None:
        while not self.closing.wait(self.every_s):
            self.write_waiting()
        self.write_waiting()

    def write_waiting(self) -> None:
        waiting = self.handler.waiting
        records = [waiting.popleft() for _ in range(len(waiting))]
        if not records:
            return
        lines = []
        dropped = self.handler.dropped
        if dropped > self.reported:
            said = logging.makeLogRecord(
                {
                    "name": "llmops.gateway",
                    "levelno": logging.WARNING,
                    "levelname": "WARNING",
                    "msg": f"log: {dropped - self.reported} lines dropped: they came faster than the stream took them",
                }
            )
            lines.append(self.formatter.format(said))
            self.reported = dropped
        lines.extend(self.formatter.format(record) for record in records)
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()

    def close(self, timeout_s: float = 2.0) -> None:
        """Detach; what still waits is written within `timeout_s` (not at all where the stream is stuck)."""
        for logger in self.loggers:
            logger.removeHandler(self.handler)
        self.closing.set()
        self.thread.join(timeout_s)
