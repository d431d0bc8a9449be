"""Live checks read from Prometheus (`canary.prometheus_url`), the way Argo Rollouts' and Flagger's
analyses do: Triton's per-model-version counters as the Prometheus that watches the service sees them,
rather than as this process scraped them itself.

Only Prometheus' HTTP query API is used (`/api/v1/query`), through requests: a client library would
add nothing for three instant queries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import requests

from tasks.platform.errors import TransientError


@dataclass
class ModelCounters:
    successes: float
    failures: float
    duration_us: float


def query(url: str, expr: str, at: float | None = None) -> list[dict]:
    """An instant query's result vector; a Prometheus that cannot be reached is a transient fault."""
    params: dict[str, str | float] = {"query": expr}
    if at is not None:
        params["time"] = at
    try:
        response = requests.get(f"{url.rstrip('/')}/api/v1/query", params=params, timeout=10)
    except requests.RequestException as exc:
        raise TransientError(f"Prometheus {url}: {type(exc).__name__}") from None
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    if response.status_code != 200 or body.get("status") != "success":
        raise TransientError(f"Prometheus {url}: query {expr!r} failed: {body.get('error', response.text[:200])}")
    return body["data"]["result"]


def scalar(url: str, expr: str, at: float | None = None) -> float:
    result = query(url, expr, at)
    return float(result[0]["value"][1]) if result else 0.0


def wait_for_scrape(url: str, model: str, after: float, timeout: float) -> float:
    """The time of the first scrape of `model`'s counters after `after` (the end of a window)."""
    deadline = time.monotonic() + timeout
    while True:
        latest = scalar(url, f'max(timestamp(nv_inference_request_success{{model="{model}"}}))')
        if latest >= after:
            return latest
        if time.monotonic() > deadline:
            raise TransientError(
                f"Prometheus {url}: no scrape of {model} after the window within {timeout:.0f}s "
                f"(is Triton's metrics endpoint a target, scraped more often than canary.window_s?)"
            )
        time.sleep(0.5)


def model_counters(url: str, model: str, start: float, end: float) -> ModelCounters:
    """How Triton's counters of `model` moved between the scrapes at or before `start` and `end`."""

    def moved(metric: str) -> float:
        expr = f'sum({metric}{{model="{model}"}})'
        return scalar(url, expr, end) - scalar(url, expr, start)

    return ModelCounters(
        moved("nv_inference_request_success"),
        moved("nv_inference_request_failure"),
        moved("nv_inference_request_duration_us"),
    )
