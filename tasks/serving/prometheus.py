"""Live checks read from Prometheus (`canary.prometheus_url`), the way Argo Rollouts' and Flagger's
analyses do: the gateway's per-version counters (llmops_gateway_version_*) as the Prometheus that watches the
service sees them, rather than as this process scraped them itself.

Only Prometheus' HTTP query API is used (`/api/v1/query`), through requests: a client library would
add nothing for three instant queries.
"""

from __future__ import annotations

import time

import requests

from tasks.platform.errors import TransientError
from tasks.serving.service import VersionCounters


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


def wait_for_scrape(url: str, version: str, after: float, timeout: float) -> float:
    """The time of the first scrape of `version`'s counters after `after` (the end of a window)."""
    deadline = time.monotonic() + timeout
    while True:
        latest = scalar(url, f'max(timestamp(llmops_gateway_version_requests_total{{version="{version}"}}))')
        if latest >= after:
            return latest
        if time.monotonic() > deadline:
            raise TransientError(
                f"Prometheus {url}: no scrape of {version} after the window within {timeout:.0f}s "
                f"(is the gateway's /metrics a target, scraped more often than canary.window_s?)"
            )
        time.sleep(0.5)


def version_counters(url: str, version: str, start: float, end: float) -> VersionCounters:
    """How the gateway's counters of `version` moved between the scrapes at or before `start` and `end`."""

    def moved(metric: str, labels: str) -> float:
        expr = f'sum({metric}{{version="{version}"{labels}}})'
        return scalar(url, expr, end) - scalar(url, expr, start)

    def outcome(name: str) -> float:
        return moved("llmops_gateway_version_requests_total", f',outcome="{name}"')

    return VersionCounters(
        outcome("ok"), outcome("refused"), outcome("failed"), moved("llmops_gateway_version_seconds_total", "")
    )
