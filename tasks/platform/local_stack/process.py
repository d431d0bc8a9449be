"""A supervised service process: started in a session of its own, ready when its probe says so, stopped
with everything it started (even children that left its process group), found again by PID after a restart
of `llmops`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from tasks.platform.child_env import child_env
from tasks.platform.errors import CheckFailed

BIN = Path(sys.executable).parent


@dataclass
class Server:
    """A started service process (its own process group) and where it listens."""

    name: str
    pid: int
    url: str
    log: str
    command: list[str]
    process: subprocess.Popen | None = None

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        try:  # the PID must still be the process we started, not a reused number
            cmdline = Path(f"/proc/{self.pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        # a script's argv[0] is its interpreter and argv[1] the script
        return self.command[0].encode() in cmdline[:2]

    def stop(self, timeout: float = 20) -> None:
        if not self.alive():
            return
        # Children that left the process group (a flow run's Triton runs in its own session) are
        # stopped after it, so `stack down` during a run leaves nothing behind.
        try:
            strays = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            strays = []
        self._stop_group(timeout)
        alive = []
        for process in strays:
            try:
                if process.status() != psutil.STATUS_ZOMBIE:
                    process.terminate()
                    alive.append(process)
            except psutil.NoSuchProcess:
                pass
        for process in psutil.wait_procs(alive, timeout=10)[1]:
            process.kill()

    def _stop_group(self, timeout: float) -> None:
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.alive():
            if self.process is not None:
                try:
                    self.process.wait(0.2)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.2)
        if self.alive():
            os.killpg(self.pid, signal.SIGKILL)
            if self.process is not None:
                self.process.wait(10)

    def record(self) -> dict:
        return {"name": self.name, "pid": self.pid, "url": self.url, "log": self.log, "command": self.command}


def start(
    name: str,
    command: list[str],
    url: str,
    ready: Callable[[], bool],
    log_dir: Path,
    env: dict | None = None,
    timeout: float = 120,
    user: str | None = None,
) -> Server:
    """Start `command` in its own session, logging to log_dir/<name>.log; return once `ready()` is true.
    Its environment: this one without its secrets, plus `env` (what it needs; tasks/platform/child_env.py).
    `user`: the account to run it as (root only)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "ab") as handle:
        process = subprocess.Popen(
            command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env(env),
            start_new_session=True,
            user=user,
            group=user,
            extra_groups=[] if user else None,
        )
    server = Server(name, process.pid, url, str(log), command, process)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise CheckFailed(f"{name} exited with code {process.returncode} while starting; see {log}: {tail(log)}")
        try:
            if ready():
                return server
        except Exception:
            pass
        time.sleep(0.3)
    server.stop()
    raise CheckFailed(f"{name} not ready after {timeout:.0f}s; see {log}: {tail(log)}")


def tail(log: Path, lines: int = 3) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""
