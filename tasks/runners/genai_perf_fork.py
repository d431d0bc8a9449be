"""genai-perf runs forked from one interpreter that imported it once.

A genai-perf 0.0.16 run spends most of its time starting: it imports itself (pandas, plotly) and then
transformers' AutoTokenizer (`genai_perf/tokenizer.py:43`), whose import pulls in torch and transformers'
generation and modeling code: 8 s of CPU and 8 to 19 s of wall time on 2 busy cores, against 1 to 2 s measuring a
benchmark's 16 to 128 requests. A benchmark runs it 2 to 12 times, a serving search dozens. This process imports
both once and forks for every run, so each run starts from the state a new `genai-perf` process would have after
its imports, with its own output file and exit code, and leaves nothing behind for the next one.

Protocol: one JSON object a line on stdin, {"args": [genai-perf's arguments], "stdout": PATH, "stderr": PATH}; for
each, one line on stdout, {"returncode": N}. End of stdin: the process exits.
"""

from __future__ import annotations

import json
import os
import sys
from typing import NoReturn

from tasks.platform.unused_imports import ACCELERATE, SCIKIT_LEARN, leave_out


def main() -> None:
    # genai-perf uses neither, and its tokenizer loads without a device map: 1.5 s of scikit-learn (with scipy) and
    # 0.4 s of accelerate (with boto3) of every benchmark's first run
    leave_out([SCIKIT_LEARN, ACCELERATE])
    import genai_perf.main
    from transformers import AutoTokenizer  # noqa: F401  (each run's tokenizer: imported once, here)

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(genai_perf.main.main, request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def run(genai_perf_main, request: dict) -> NoReturn:
    """In the forked child: genai-perf's own `main` on the request's arguments, its output to the request's files."""
    code = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        sys.argv = ["genai-perf", *request["args"]]
        code = genai_perf_main()
    except SystemExit as exit:  # argparse's --help and usage errors
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
