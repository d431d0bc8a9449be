"""AIPerf (NVIDIA's successor to genai-perf), the benchmark's second load generator (bench.tool aiperf): its
command line, one measurement of one served model (bench.profile_runs runs), each run's export parsed into a
LoadLevel.

AIPerf speaks HTTP only, so it streams from Triton's own HTTP endpoint, `/v2/models/<model>/generate_stream`
(Server-Sent Events, one `text_output` per event), through its `template` endpoint type: the request body is the
Jinja template below and each event's text is read at the JMESPath `text_output`. That is the same served model,
inputs and stream genai-perf reaches over gRPC, so the two tools measure the same thing by other clients (HTTP
and SSE here against gRPC there). Every request asks exactly `bench.output_tokens` tokens (`min_length` =
`max_tokens`, as genai-perf's --output-tokens-mean-deterministic does). Prompts are AIPerf's own synthetic ones of
`bench.input_tokens` tokens with the model's tokenizer, the same for every run and model (a fixed seed).

AIPerf runs in an environment of its own (.venv-aiperf, infra/local/setup-aiperf.sh): its pins collide with the
orchestrator's. Read at aiperf 0.13.0 (site-packages/aiperf):
- endpoints/template_endpoint.py:26-86: `endpoint.template.body` (Jinja, with `text` and `max_tokens`; autoescaped, so
  every value goes through `tojson`, l.63) and `response_field` (JMESPath on each SSE event's JSON, l.154-194; Triton's
  `text_output` is not among the auto-detected fields, base_endpoint.py:441-471);
- TTFT is the first event with text (metrics/types/ttft_metric.py:44-56), request latency the last
  (request_latency_metric.py:38-49); SSE is parsed where Triton answers `text/event-stream`
  (transports/aiohttp_client.py:176-179). AIPerf finds no input length in a `text_input` body
  (endpoints/payload_extraction.py:260-277), so its input-token statistics are absent; none is read here;
- the CLI flags below, as `aiperf profile --help` prints them at 0.13.0;
- with --num-profile-runs N > 1, each run writes `profile_runs/run_000K/profile_export_aiperf.json` (metrics keyed
  by name, each with `avg`, `p50`, `p90`, `p99`, `std`, ...; `goodput` with `avg` where --goodput was given) and the
  whole writes `aggregate/profile_export_aiperf_aggregate.json` with AIPerf's own interval per statistic: mean +- t *
  sd / sqrt(n), ddof 1 (orchestrator/aggregation/confidence.py:306-350); one run writes its export at the top of the
  artifact folder (orchestrator/orchestrator.py:38-89).

The gate's comparison does not use --num-profile-runs: N runs of one model back to back share whatever the machine
did meanwhile, so pairing them run by run with the other model's block gave intervals narrower than the truth (an
equal candidate measured 0.503..0.721 on 3 such pairs; docs/benchmarks.md). Its rounds run single-run profiles of
the two models in turn instead (tasks/benchmark.py: compare_in_rounds) and compute AIPerf's interval themselves
(tasks/quality/stats.py: mean_interval). Measurements that are not compared (lower concurrency levels, a first
release) still make one `aiperf profile` of N runs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.load.load_level import LoadLevel, tool_failed
from tasks.platform.child_env import child_env
from tasks.platform.config import BenchSection
from tasks.platform.errors import BadInput, CheckFailed
from tasks.platform.project import PROJECT_ROOT

if TYPE_CHECKING:
    from tasks.serving.models import Served

DEFAULT_ENVIRONMENT = PROJECT_ROOT / ".venv-aiperf"

# Triton's generate_stream body; `stream` makes Triton answer with Server-Sent Events.
PAYLOAD_TEMPLATE = (
    '{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens|tojson }}, '
    '"min_length": {{ max_tokens|tojson }}, "stream": true}'
)


def payload_template(adapter: str | None) -> str:
    """The body, naming the adapter the base engine answers with (serve.lora adapter), as the gateway does."""
    return PAYLOAD_TEMPLATE if adapter is None else PAYLOAD_TEMPLATE[:-1] + f', "lora_name": {json.dumps(adapter)}}}'


def aiperf_executable(cfg: BenchSection) -> Path:
    """The `aiperf` of bench.aiperf_environment (default: the repository's .venv-aiperf); a clear error without it."""
    environment = Path(cfg.aiperf_environment) if cfg.aiperf_environment else DEFAULT_ENVIRONMENT
    executable = environment / "bin" / "aiperf"
    if not executable.is_file():
        raise BadInput(
            f"bench.tool aiperf: no aiperf in {environment} (run `make setup-aiperf`, or set bench.aiperf_environment)"
        )
    return executable


def parse_run_export(path: Path) -> LoadLevel:
    """One profile run's profile_export_aiperf.json."""
    return LoadLevel.read_export(path, "AIPerf", "goodput")  # goodput: with --goodput only


def aiperf_command(
    executable: Path,
    model: str,
    http_url: str,
    tokenizer_dir: Path,
    cfg: BenchSection,
    concurrency: int,
    artifact_dir: Path,
    goodput: dict[str, float] | None = None,
    runs: int = 1,
    adapter: str | None = None,
) -> list[str]:
    """One `aiperf profile` of `model` on Triton's HTTP stream (asked for `adapter` where given): `runs` runs of
    bench.request_count requests at `concurrency`, with goodput under `goodput` (objectives in ms, AIPerf's metric
    names)."""
    return [
        str(executable),
        "profile",
        "--model",
        model,
        "--url",
        http_url,
        "--endpoint-type",
        "template",
        "--endpoint",
        f"/v2/models/{model}/generate_stream",
        "--streaming",
        # One JSON object: AIPerf splits a KEY:VALUE value on commas (config/loader/parsing.py:188-207), and the
        # template has commas; an argument starting with "{" is read as JSON (l.190-192). payload_template and
        # response_field become endpoint.template (config/flags/_converter_endpoint.py:26-38).
        "--extra-inputs",
        json.dumps({"payload_template": payload_template(adapter), "response_field": "text_output"}),
        "--tokenizer",
        str(tokenizer_dir),
        "--synthetic-input-tokens-mean",
        str(cfg.input_tokens),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(cfg.output_tokens),
        "--output-tokens-stddev",
        "0",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(cfg.request_count),
        "--warmup-request-count",
        str(cfg.warmup_request_count),
        "--num-profile-runs",
        str(runs),
        # AIPerf's own interval needs 2 runs or more (orchestrator/aggregation/confidence.py:136-160).
        *(["--confidence-level", f"{cfg.confidence:g}"] if runs > 1 else []),
        "--random-seed",
        "0",
        "--ui-type",
        "none",
        "--no-server-metrics",  # Triton's metrics are read by the benchmark itself (failed requests), not scraped
        "--no-gpu-telemetry",
        "--artifact-dir",
        str(artifact_dir),
        *(["--goodput", " ".join(f"{key}:{value:g}" for key, value in goodput.items())] if goodput else []),
    ]


@dataclass
class AIPerf:
    """AIPerf measurements against one Triton's HTTP endpoint, their files kept under `out_dir`."""

    http_url: str
    cfg: BenchSection
    out_dir: Path
    executable: Path
    goodput: dict[str, float] | None = None  # objectives in ms; each run's export then has `goodput`

    @property
    def runs_per_round(self) -> int:
        return self.cfg.profile_runs

    def measure(self, served: Served, concurrency: int, label: str = "") -> LoadLevel:
        """One AIPerf run (its own `aiperf profile`, start-up and warm-up included)."""
        return self.profile(served, concurrency, label, runs=1)[0]

    def measure_runs(self, served: Served, concurrency: int, label: str = "") -> list[LoadLevel]:
        """bench.profile_runs runs of `served` at `concurrency` in one `aiperf profile`, in the order run."""
        return self.profile(served, concurrency, label, runs=self.cfg.profile_runs)

    def profile(self, served: Served, concurrency: int, label: str, runs: int) -> list[LoadLevel]:
        """One `aiperf profile` of `runs` runs; each run's export parsed."""
        artifact_dir = self.out_dir / f"{served.name}-c{concurrency}{label}"
        model, adapter = served.answered_by
        command = aiperf_command(
            self.executable,
            model,
            self.http_url,
            served.model_dir,
            self.cfg,
            concurrency,
            artifact_dir,
            self.goodput,
            runs,
            adapter,
        )
        # AIPerf's services talk over ZMQ sockets under TMPDIR, whose paths must fit 107 bytes (sockaddr_un): a short
        # folder of its own, removed afterwards with the mmap folders AIPerf leaves there.
        scratch = Path(tempfile.mkdtemp(prefix="aiperf-"))
        env = child_env(  # AIPerf needs none of this process's secrets
            {
                "TMPDIR": str(scratch),
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "PATH": os.pathsep.join([str(self.executable.parent), os.environ.get("PATH", "")]),
            }
        )
        # Not HF_HUB_OFFLINE: with it, AIPerf 0.13.0 looks a local tokenizer folder up as a hub snapshot and fails
        # (common/tokenizer.py:559-567, 667-697); without it, an existing folder is read without the network (l.313-322).
        for offline in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.pop(offline, None)
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if done.returncode != 0:
            error = first_error(artifact_dir, done.stderr or done.stdout)
            raise tool_failed(
                f"benchmark: AIPerf on {served.name} exited with {done.returncode}: {error[:400]} "
                f"(logs: {artifact_dir}/**/aiperf.log)",
                self.http_url,
                error,
            )
        # One run writes its export at the top; N runs write profile_runs/run_000K/ (orchestrator/orchestrator.py:38-89).
        exports = sorted(artifact_dir.glob("profile_runs/run_*/profile_export_aiperf.json")) or sorted(
            artifact_dir.glob("profile_export_aiperf.json")
        )
        if not exports:
            raise CheckFailed(f"benchmark: AIPerf wrote no profile run under {artifact_dir}")
        return [parse_run_export(path) for path in exports]


def first_error(artifact_dir: Path, output: str) -> str:
    """What went wrong first: AIPerf's last words ("All runs failed ...") name no cause; its services' logs do."""
    logs = [*sorted(artifact_dir.glob("profile_runs/*/logs/aiperf.log")), artifact_dir / "logs" / "aiperf.log"]
    for log in (path for path in logs if path.is_file()):
        for line in log.read_text(errors="replace").splitlines():
            if " - ERROR - " in line:
                return line.split(" - ERROR - ", 1)[1]
    return (output.strip().splitlines() or ["(no output)"])[-1]
