"""Child processes that die with the process that started them, even a SIGKILLed one.

Linux's PR_SET_PDEATHSIG, armed in the child between fork and exec: the kernel sends the child SIGTERM
when the *thread* that forked it ends. So it is for children started from a thread that lives as long
as they should (a program's main thread), never from a pool's worker thread.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def die_with(parent: int) -> Callable[[], None]:
    """A Popen preexec_fn: SIGTERM to the child when `parent` (os.getpid() of the caller) is gone."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def arm() -> None:
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            os._exit(127)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
