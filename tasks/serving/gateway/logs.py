"""The gateway's log lines (its access log and its fault log), written to a stream by a thread of their own.

A handler that writes on the event loop's thread stops every request once the stream stops taking lines:
`llmops serve` with its stderr a pipe that nobody reads (a supervisor that reads it late, a paused
`llmops serve 2>&1 | less`) answered 385 requests and then none, /health included, once the pipe's 64 KiB were
full. Here the loop only queues a line. While `lines` wait, further lines are dropped, and the writer says how
many before the next line it writes.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable
from logging.handlers import QueueHandler
from typing import TextIO

LINES = 10_000  # lines waiting for the stream (about 2 MB of access log) before lines are dropped
FORMAT = "%(asctime)s %(name)s %(message)s"


class DroppingQueueHandler(QueueHandler):
    """QueueHandler that drops a line where the queue is full (QueueHandler's own would print a traceback per
    line, to the very stream that is not read), and counts it."""

    def __init__(self, lines: queue.Queue) -> None:
        super().__init__(lines)
        self.dropped = 0
        self.counting = threading.Lock()  # the fault log is written from worker threads too (asyncio.to_thread)

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            with self.counting:
                self.dropped += 1


class LogWriter:
    """Loggers whose lines go to `stream` from a daemon thread: start() attaches them, close() detaches them."""

    def __init__(self, stream: TextIO, lines: int = LINES) -> None:
        self.lines: queue.Queue[logging.LogRecord | None] = queue.Queue(lines)
        self.handler = DroppingQueueHandler(self.lines)
        self.target = logging.StreamHandler(stream)
        self.target.setFormatter(logging.Formatter(FORMAT))
        self.reported = 0  # drops already said
        self.loggers: list[logging.Logger] = []
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
        while (record := self.lines.get()) is not None:
            dropped = self.handler.dropped
            if dropped > self.reported:
                self.target.handle(
                    logging.makeLogRecord(
                        {
                            "name": "llmops.gateway",
                            "levelno": logging.WARNING,
                            "levelname": "WARNING",
                            "msg": f"log: {dropped - self.reported} lines dropped: they came faster than the "
                            "stream took them",
                        }
                    )
                )
                self.reported = dropped
            self.target.handle(record)

    def close(self, timeout_s: float = 2.0) -> None:
        """Detach; the lines still waiting are written within `timeout_s` (not at all where the stream is stuck)."""
        for logger in self.loggers:
            logger.removeHandler(self.handler)
        try:
            self.lines.put(None, timeout=timeout_s)
        except queue.Full:
            return
        self.thread.join(timeout_s)
