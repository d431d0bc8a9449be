"""genai-perf, the load generator of the benchmark stage: its command line, one run on one served model,
its export parsed into a LoadLevel, and the prompts of a first run kept for every later one.

genai-perf drives perf_analyzer in kserve mode (TensorRT-LLM-style inputs, gRPC streaming) with
prompts of `bench.input_tokens` tokens and exactly `bench.output_tokens` output tokens per request
(`min_length` = `max_tokens`), counted with the model's own tokenizer from its local folder (no hub).
The prompts are synthesized once (the first run) and every later run reads them back with
`--input-file`: both models get the same prompts, and each run skips the synthesis. The synthesis
tokenizes genai-perf's whole 142,719-line corpus (inputs/retrievers/synthetic_prompt_generator.py,
`_initialize_corpus`) before it writes a prompt: 2.7 s with cpu-tiny's tokenizer on an idle 2-core
machine. Its output depends only on the tokenizer and the prompt settings
(fixed seed), so it is also kept in `$LLMOPS_HOME/cache/genai-perf-prompts/` for the next release with the
same tokenizer, which then skips it too and runs on the same prompts as the releases before it.

The runs of one GenaiPerf fork from one process that imported genai-perf and transformers' tokenizer once
(tasks/runners/genai_perf_fork.py): those imports took 8 s of CPU every run, several times the measurement.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.load.load_level import LoadLevel, tool_failed
from tasks.platform.child_env import child_env
from tasks.platform.config import BenchSection
from tasks.platform.errors import BadInput, CheckFailed

if TYPE_CHECKING:
    from tasks.serving.models import Served


def parse_profile_export(path: Path) -> LoadLevel:
    """genai-perf's JSON export at one level."""
    return LoadLevel.read_export(path, "genai-perf", "request_goodput")  # request_goodput: with --goodput only


def genai_perf_command(
    model: str,
    grpc_url: str,
    tokenizer_dir: Path,
    cfg: BenchSection,
    concurrency: int,
    artifact_dir: Path,
    prompts: Path | None = None,
    goodput: dict[str, float] | None = None,
    adapter: str | None = None,
) -> list[str]:
    """One genai-perf run; with `prompts` (JSONL of {"text": ...}) it reads them instead of synthesizing; with
    `goodput` (objectives in ms, e.g. {"time_to_first_token": 1000}) it counts the requests that meet them all
    (genai_perf/parser.py: --goodput, nargs="+", KEY:VALUE pairs; exported as request_goodput). With `adapter`,
    every request names it as `lora_name` (serve.lora adapter: `model` is the base engine): --extra-inputs adds an
    input to each kserve request (genai_perf/inputs/converters/tensorrtllm_converter.py:76-78, 0.0.16)."""
    inputs = (
        ["--input-file", str(prompts)]
        if prompts is not None
        else ["--synthetic-input-tokens-mean", str(cfg.input_tokens), "--synthetic-input-tokens-stddev", "0"]
    )
    return [
        str(Path(sys.executable).parent / "genai-perf"),
        "profile",
        "-m",
        model,
        "--endpoint-type",
        "kserve",
        "--backend",
        "tensorrtllm",
        "--streaming",
        "-u",
        grpc_url,
        "--tokenizer",
        str(tokenizer_dir),
        *inputs,
        "--output-tokens-mean",
        str(cfg.output_tokens),
        "--output-tokens-mean-deterministic",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(cfg.request_count),
        "--warmup-request-count",
        str(cfg.warmup_request_count),
        "--artifact-dir",
        str(artifact_dir),
        *(["--goodput", *(f"{key}:{value:g}" for key, value in goodput.items())] if goodput else []),
        *(["--extra-inputs", f"lora_name:{adapter}"] if adapter else []),
    ]


# What genai-perf reads of a tokenizer folder (transformers' AutoTokenizer files): the prompts' cache key.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
)


def prompts_key(tokenizer_dir: Path, cfg: BenchSection) -> str:
    """What the synthesized prompts depend on: the tokenizer's files, the prompt settings, genai-perf's release."""
    from importlib.metadata import version

    digest = hashlib.sha256(
        json.dumps([version("genai-perf"), cfg.input_tokens, cfg.request_count, cfg.warmup_request_count]).encode()
    )
    for name in TOKENIZER_FILES:
        path = tokenizer_dir / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


RUN_TIMEOUT_S = 900.0


class ForkedRuns:
    """genai-perf runs, each forked from one process started at the first run (tasks/runners/genai_perf_fork.py);
    that process exits when this object goes away (its stdin closes) or its run outlives the timeout (killed)."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.process: subprocess.Popen | None = None

    def run(self, command: list[str], output: Path, timeout_s: float = RUN_TIMEOUT_S) -> int:
        """genai-perf `command` (its executable first), its output to `output` and its errors to `output`.err;
        its exit code."""
        process = self.started()
        assert process.stdin is not None and process.stdout is not None
        request = {"args": command[1:], "stdout": str(output), "stderr": f"{output}.err"}
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        ready, _, _ = select.select([process.stdout], [], [], timeout_s)
        answer = process.stdout.readline() if ready else ""
        if not answer:
            self.stop()
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] if self.log.is_file() else []
            why = f"no answer within {timeout_s:g}s" if not ready else f"its runner ended: {(tail or ['?'])[0][:300]}"
            raise CheckFailed(f"benchmark: genai-perf: {why}")
        return int(json.loads(answer)["returncode"])

    def started(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            with open(self.log, "a") as log:  # the runner's own errors; each run's output goes to its own file
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "tasks.runners.genai_perf_fork"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    env=self.env,
                    start_new_session=True,  # a run that hangs is killed with its perf_analyzer
                )
            weakref.finalize(self, stop_runner, self.process)
        return self.process

    def stop(self) -> None:
        if self.process is not None:
            stop_runner(self.process, kill=True)
            self.process = None


def stop_runner(process: subprocess.Popen, kill: bool = False) -> None:
    """End of input: the runner exits after the run in progress; `kill`: at once, with what it forked."""
    if kill and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.stdin is not None and not process.stdin.closed:
        try:
            process.stdin.close()
        except BrokenPipeError:
            pass
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def runner_env() -> dict[str, str]:
    """genai-perf needs none of this process's secrets; offline, with this environment's executables first."""
    return child_env(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        }
    )


@dataclass
class GenaiPerf:
    """genai-perf runs against one Triton, its files kept under `out_dir`; every run sends the prompts the
    first run synthesized (`prompts`), or, where `prompts_cache` holds them, those of an earlier release."""

    grpc_url: str
    cfg: BenchSection
    out_dir: Path
    prompts: Path | None = None
    prompts_cache: Path | None = None  # a folder; None: no reuse across releases
    goodput: dict[str, float] | None = None  # objectives in ms; the export then has request_goodput (goodput_of)
    forked: ForkedRuns | None = field(default=None, repr=False)

    runs_per_round = 1

    def measure_runs(self, served: Served, concurrency: int, label: str = "") -> list[LoadLevel]:
        return [self.measure(served, concurrency, label)]

    def measure(self, served: Served, concurrency: int, label: str = "") -> LoadLevel:
        """One genai-perf run on one served model at one concurrency level."""
        cached = None
        if self.prompts is None and self.prompts_cache is not None:
            cached = self.prompts_cache / f"{prompts_key(served.model_dir, self.cfg)}.jsonl"
            if cached.is_file():
                self.prompts = Path(shutil.copyfile(cached, self.out_dir / "prompts.jsonl"))
        artifact_dir = self.out_dir / f"{served.name}-c{concurrency}{label}"
        model, adapter = served.answered_by
        command = genai_perf_command(
            model,
            self.grpc_url,
            served.model_dir,
            self.cfg,
            concurrency,
            artifact_dir,
            self.prompts,
            self.goodput,
            adapter,
        )
        self.out_dir.mkdir(parents=True, exist_ok=True)  # where the run's output files go, beside its own folder
        if self.forked is None:
            self.forked = ForkedRuns(runner_env(), self.out_dir / "genai-perf-runner.log")
        output = artifact_dir.with_name(f"{artifact_dir.name}.log")
        returncode = self.forked.run(command, output)
        if returncode != 0:
            files = (Path(f"{output}.err"), output)  # absent where the run failed before it could open them
            said = [path.read_text(errors="replace").strip() for path in files if path.is_file()]
            tail = next((text.splitlines()[-1:] for text in said if text), [])
            said_last = (tail or ["(no output)"])[0][:300]
            raise tool_failed(
                f"benchmark: genai-perf on {served.name} exited with {returncode}: {said_last}",
                self.grpc_url,
                "\n".join(said),
            )
        exports = sorted(artifact_dir.rglob("profile_export_genai_perf.json"))
        measured = parse_profile_export(exports[0] if exports else artifact_dir / "profile_export_genai_perf.json")
        if self.prompts is None:
            self.prompts = write_prompts(exports[0].parent / "inputs.json", self.out_dir / "prompts.jsonl")
            if cached is not None:
                keep(self.prompts, cached)
        return measured


def goodput_of(artifact_dir: Path) -> float:
    """Requests per second that met every goodput objective, from a run with objectives."""
    exports = sorted(artifact_dir.rglob("profile_export_genai_perf.json"))
    try:
        return float(json.loads(exports[0].read_text())["request_goodput"]["avg"])
    except (IndexError, KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
        raise CheckFailed(
            f"tune_serving: no request_goodput in genai-perf's export under {artifact_dir} ({exc})"
        ) from None


def keep(prompts: Path, cached: Path) -> None:
    """A copy of `prompts` at `cached`, whole or not at all (two releases may write it at once)."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    staged = cached.with_name(f"{cached.name}.{secrets.token_hex(6)}.partial")
    shutil.copyfile(prompts, staged)
    os.replace(staged, cached)


def write_prompts(inputs_json: Path, prompts: Path) -> Path:
    """genai-perf's synthesized requests (inputs.json, kserve/tensorrtllm shape) as the JSONL its
    `--input-file` reads: {"text": prompt} a line."""
    try:
        requests = json.loads(inputs_json.read_text())["data"]
        lines = [json.dumps({"text": request["text_input"][0]}) for request in requests]
    except (OSError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise CheckFailed(f"benchmark: {inputs_json}: no prompts to reuse ({type(exc).__name__}: {exc})") from None
    prompts.write_text("\n".join(lines) + "\n")
    return prompts


def check_tokenizer(folder: Path) -> None:
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise BadInput(f"benchmark: no tokenizer in {folder}")
