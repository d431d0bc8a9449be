"""What a load generator (genai-perf or AIPerf) measured of one served model at one concurrency level."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tasks.serving.models import Served


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
    def median(cls, measured: list[LoadLevel]) -> LoadLevel:
        """Each statistic's median over repeated measurements (the rounds)."""
        return cls(**{name: statistics.median(getattr(m, name) for m in measured) for name in asdict(measured[0])})


class LoadTool(Protocol):
    """A load generator the benchmark drives (tasks/serving/genai_perf.py, tasks/serving/aiperf.py)."""

    def measure_runs(self, served: Served, concurrency: int, label: str = "") -> list[LoadLevel]:
        """Every run of one measurement of `served` at `concurrency`, in the order run (one for genai-perf,
        bench.profile_runs for AIPerf)."""
        ...
