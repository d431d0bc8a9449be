"""Children that die with the thread that started them (tasks/platform/lifetime.py), on the real kernel."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

from tasks.platform.lifetime import dying_with_this_thread


def running(pid: int, program: bytes) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(program)
    except OSError:
        return False


def test_a_child_gets_sigterm_when_the_thread_that_started_it_ends():
    children: list[subprocess.Popen] = []

    def start() -> None:
        child = subprocess.Popen(dying_with_this_thread(["sleep", "60"]))
        children.append(child)
        deadline = time.monotonic() + 5
        while not running(child.pid, b"sleep") and time.monotonic() < deadline:  # setpriv armed it, then exec'd
            time.sleep(0.01)

    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
    try:
        assert children[0].wait(5) == -signal.SIGTERM
    finally:
        children[0].kill()


def test_without_it_a_child_outlives_the_thread():
    children: list[subprocess.Popen] = []
    starter = threading.Thread(target=lambda: children.append(subprocess.Popen(["sleep", "60"])))
    starter.start()
    starter.join()
    try:
        time.sleep(0.3)
        assert children[0].poll() is None
    finally:
        children[0].kill()
        children[0].wait()
