"""genai-perf's runs forked from one process (tasks/runners/genai_perf_fork.py): each run has its own exit code and
output, and a failed run is one line naming the model. Its measurements run against real Tritons in the
integration tests (test_serving, test_attach, test_release)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.load.genai_perf import GenaiPerf, genai_perf_command
from tasks.platform.config import load_profile
from tasks.platform.errors import CheckFailed
from tasks.serving.models import Served


def test_runs_fork_from_one_process_each_with_its_own_exit_code_and_output(tmp_path: Path):
    genai_perf = GenaiPerf("127.0.0.1:9", load_profile("cpu-tiny").bench, tmp_path)
    served = Served("1", "m-v1", tmp_path / "no-tokenizer")
    with pytest.raises(CheckFailed) as failed:
        genai_perf.measure(served, 2)
    message = str(failed.value)
    assert message.startswith("benchmark: genai-perf on m-v1 exited with 1: ") and "\n" not in message
    assert "no-tokenizer" in message and "no-tokenizer" in (tmp_path / "m-v1-c2.log.err").read_text()
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
