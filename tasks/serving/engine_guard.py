"""The engine processes of a served model die with the Triton that served it.

vLLM's engine core (a child of the Triton Python stub) and TensorRT-LLM's MPI workers (spawned by the stub's
`tensorrt_llm.LLM`, at tensor parallelism 1 too) run in processes that nothing ties to the stub's life: SIGKILL
tritonserver and they outlive it as orphans holding their GPU memory, so the next start's memory plan (or vLLM's
free-memory check) fails. The model starts this watcher once its engine is up: a separate process, since nothing in
a dead one can act, that kills the engine's processes as soon as tritonserver or the stub is gone, and the stub too
once tritonserver is: a vLLM stub whose tritonserver was SIGKILLed was seen stuck in its own exit (1 run in 2), an
orphan holding its memory with the killed engine core its zombie child.

Copied next to each rendered model's model.py (tasks/serving/repository.py:MODEL_HELPERS), so standard library only
at import and no project import; psutil, which vLLM and TensorRT-LLM both require, is imported where it is used.
"""

from __future__ import annotations

import os
import subprocess
import sys

# The file name of the copy in a rendered model's version folder; model.py imports it by this name.
FILE_NAME = "engine_guard.py"

# argv[1]: the watched pids, tritonserver first, then the stub; argv[2]: the engine's pids. Each pid is taken as a
# psutil.Process at the start, so a pid the kernel hands to a new process later is not killed (psutil checks the
# process's start time before it signals).
WATCHER = """
import sys, time
import psutil
def process(pid):
    try:
        return psutil.Process(int(pid))
    except psutil.NoSuchProcess:
        return None
watched = [process(pid) for pid in sys.argv[1].split(",")]
victims = [process(pid) for pid in sys.argv[2].split(",") if pid]
def alive(process):  # a SIGKILLed tritonserver stays a zombie until its parent reaps it
    try:
        return process is not None and process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
while all(alive(process) for process in watched):
    time.sleep(0.5)
if not alive(watched[0]):  # tritonserver is gone: nothing will talk to its stub again
    victims += watched[1:]
for victim in victims:
    try:
        if victim is not None and victim.is_running():
            victim.kill()
    except psutil.NoSuchProcess:
        pass
"""


def engine_processes() -> list[int]:
    """This process's descendants: an engine's core, its workers, an MPI daemon and the ranks it spawned."""
    import psutil

    return [child.pid for child in psutil.Process().children(recursive=True)]


def guard_engine(victims: list[int], watched: list[int] | None = None) -> subprocess.Popen:
    """Kill `victims` once any of `watched` is gone (default: the stub's parent, tritonserver, and the stub), and the
    rest of `watched` too once its first, tritonserver, is."""
    watched = watched if watched is not None else [os.getppid(), os.getpid()]
    return subprocess.Popen(
        [sys.executable, "-c", WATCHER, ",".join(map(str, watched)), ",".join(map(str, victims))],
        stdin=subprocess.DEVNULL,
    )
