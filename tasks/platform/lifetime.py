"""Child processes that die with the process that started them, even a SIGKILLed one.

Linux's PR_SET_PDEATHSIG, armed in the child before it runs its program: the kernel sends the child SIGTERM when
the *thread* that forked it ends. So it is for children started from a thread that lives as long as they should
(a program's main thread), never from a pool's worker thread.

It is armed by util-linux's `setpriv --pdeathsig TERM`, which execs the program right after (util-linux is in
every Debian and Ubuntu base image), not by a Popen preexec_fn: a preexec_fn runs Python between fork and exec,
which is unsafe while other threads run (the gateway's, Prefect's): a lock another thread held at the fork stays
held in the child forever. What setpriv cannot do that the preexec_fn did: notice a parent that died in the
microseconds before the signal was armed.
"""

from __future__ import annotations

import shutil


def dying_with_this_thread(command: list[str]) -> list[str]:
    """`command`, run so that it gets SIGTERM when the calling thread (and so its process) is gone."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:  # not a Linux with util-linux: the child outlives a SIGKILLed parent, as anywhere else
        return command
    return [setpriv, "--pdeathsig", "TERM", "--", *command]
