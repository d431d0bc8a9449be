"""What a load generator (genai-perf or AIPerf) measured of one served model at one concurrency level, read from
either tool's JSON export: AIPerf keeps genai-perf's metric and statistic names."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tasks.platform.errors import CheckFailed, TransientError

if TYPE_CHECKING:
    from tasks.serving.models import Served

# (exported metric, statistic) -> LoadLevel's field; latencies in ms, throughputs per second.
EXPORTED = {
    ("time_to_first_token", "p50"): "ttft_p50_ms",
    ("time_to_first_token", "p90"): "ttft_p90_ms",
    ("time_to_first_token", "p99"): "ttft_p99_ms",
    ("inter_token_latency", "avg"): "itl_avg_ms",
    ("inter_token_latency", "p99"): "itl_p99_ms",
    ("request_latency", "p50"): "latency_p50_ms",
    ("request_latency", "p90"): "latency_p90_ms",
    ("request_latency", "p99"): "latency_p99_ms",
    ("output_token_throughput", "avg"): "output_tokens_per_s",
    ("request_throughput", "avg"): "requests_per_s",
    ("request_count", "avg"): "request_count",
}


@dataclass
class LoadLevel:
    """One run's statistics; latencies in ms, throughputs per second."""

    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_avg_ms: float
    itl_p99_ms: float
    latency_p50_ms: float
    latency_p90_ms: float
    latency_p99_ms: float
    output_tokens_per_s: float  # the tool's count: the streamed text re-tokenized (tasks/benchmark.py says why)
    requests_per_s: float
    request_count: float
    goodput_per_s: float = 0.0  # requests/s that met every latency objective; 0 where none was given

    @classmethod
    def read_export(cls, path: Path, tool: str, goodput_key: str) -> LoadLevel:
        """`tool`'s JSON export of one run, goodput under `goodput_key` where the run had objectives; a missing or
        malformed file is a clear error."""
        if not path.is_file():
            raise CheckFailed(f"benchmark: {tool} wrote no {path.name} (looked in {path.parent})")
        try:
            data = json.loads(path.read_text())
            level = cls(**{name: float(data[key][stat]) for (key, stat), name in EXPORTED.items()})
            if data.get(goodput_key):
                level.goodput_per_s = float(data[goodput_key]["avg"])
            return level
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise CheckFailed(f"benchmark: {path}: malformed {tool} export ({type(exc).__name__}: {exc})") from None

    @classmethod
    def median(cls, measured: list[LoadLevel]) -> LoadLevel:
        """Each statistic's median over repeated measurements (the rounds)."""
        return cls(**{name: statistics.median(getattr(m, name) for m in measured) for name in asdict(measured[0])})


class LoadTool(Protocol):
    """A load generator the benchmark drives (tasks/load/genai_perf.py, tasks/load/aiperf.py)."""

    @property
    def runs_per_round(self) -> int:
        """Paired runs per model in one of the benchmark's rounds: one for genai-perf, bench.profile_runs for AIPerf."""
        ...

    def measure(self, served: Served, concurrency: int, label: str = "") -> LoadLevel:
        """One run of `served` at `concurrency` (one sample of a paired comparison)."""
        ...

    def measure_runs(self, served: Served, concurrency: int, label: str = "") -> list[LoadLevel]:
        """Every run of one measurement of `served` at `concurrency`, in the order run (one for genai-perf,
        bench.profile_runs for AIPerf)."""
        ...


# What the measured server answered where one of its model processes died (Triton 2.51's python backend,
# src/python_be.cc: "Stub process '<instance>' is not healthy."): `llmops serve` loads that model again within
# seconds (tasks/runtime/fleet.py:Fleet.recover), so the measurement is retried, not failed.
SERVER_FAULTS = ("is not healthy",)


def tool_failed(message: str, url: str, output: str = "") -> CheckFailed | TransientError:
    """A load generator that exited non-zero: a TransientError (exit 4 once the retries are spent) where the server it
    measured does not accept a connection any more (a Triton that died under it) or its `output` shows a model process
    of that server died (SERVER_FAULTS), else a CheckFailed (exit 3)."""
    import socket
    from urllib.parse import urlsplit

    if any(fault in output for fault in SERVER_FAULTS):
        return TransientError(f"{message} (a model process of the server at {url} died under it)")
    parts = urlsplit(url if "://" in url else f"//{url}")
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=3):
            return CheckFailed(message)
    except OSError as exc:
        return TransientError(f"{message} ({url} does not answer: {exc.strerror or type(exc).__name__})")
