"""genai-perf's runs forked from one process (tasks/runners/genai_perf_fork.py): each run has its own exit code and
output, and a failed run is one line naming the model. Its measurements run against real Tritons in the
integration tests (test_serving, test_attach, test_release)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tasks.load.genai_perf import GenaiPerf, genai_perf_command
from tasks.platform.config import load_profile
from tasks.platform.errors import CheckFailed, TransientError
from tasks.platform.run_log import exit_code
from tasks.serving.models import Served


def test_runs_fork_from_one_process_each_with_its_own_exit_code_and_output(tmp_path: Path):
    listening = socket.create_server(("127.0.0.1", 0))  # a server that accepts: the failure is the run's own
    genai_perf = GenaiPerf(f"127.0.0.1:{listening.getsockname()[1]}", load_profile("cpu-tiny").bench, tmp_path)
    served = Served("1", "m-v1", tmp_path / "no-tokenizer")
    with pytest.raises(CheckFailed) as failed:
        genai_perf.measure(served, 2)
    message = str(failed.value)
    assert message.startswith("benchmark: genai-perf on m-v1 exited with 1: ") and "\n" not in message
    assert "no-tokenizer" in message and "no-tokenizer" in (tmp_path / "m-v1-c2.log.err").read_text()
    assert exit_code(failed.value) == 3
    # the same run against a Triton that died under it (nothing accepts on its port): a service away, exit 4
    listening.close()
    with pytest.raises(TransientError) as away:
        genai_perf.measure(served, 2)
    assert exit_code(away.value) == 4 and "does not answer: Connection refused" in str(away.value)
    assert genai_perf.forked is not None and genai_perf.forked.process is not None
    runner = genai_perf.forked.process.pid
    usage = genai_perf_command("m", "127.0.0.1:9", tmp_path, load_profile("cpu-tiny").bench, 2, tmp_path)[:1]
    assert genai_perf.forked.run([*usage, "--help"], tmp_path / "help.log") == 0
    assert "usage: genai-perf" in (tmp_path / "help.log").read_text()
    assert genai_perf.forked.process.pid == runner  # the same runner, imported once
    # it imported transformers' tokenizers without scikit-learn (nor the scipy that comes with it): no library of
    # theirs is mapped into the runner's memory
    libraries = Path(f"/proc/{runner}/maps").read_text()
    assert "tokenizers" in libraries and "/sklearn/" not in libraries and "/scipy" not in libraries
    genai_perf.forked.stop()
    assert genai_perf.forked.process is None
