"""The rollout controller: the service walks a release's rollout itself (tasks/control/rollout.py).

It runs in the gateway's own event loop (in `llmops serve`, and in the temporary gateway of a release without one:
one code path) and converges the route table to the rollout's plan: it routes each step, watches the step's window
on the gateway's own counters of the candidate's requests (every client's), rolls back on a breach (the champion
alone, the candidate out of the table: the serve's reconciler unloads it once no live owner declares it), and after
the last window promotes (the candidate the champion, in the table and its record). Every change is one `amend`:
the record holds the step, the window and the outcome before a request is routed by them.

A release that stops renewing its hold is rolled back by the gateway's lease watch (RouteTable.lapsed); one that
aborts is rolled back by the control API. A serve started again rolls an unfinished rollout back (Gateway.
starting_table): its Tritons start with the record's champion alone, and the window's counters died with the
process, so there is no step it could honestly resume; the release sees `rolled_back` with the reason and ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from tasks.control.contract import RouteTable, Version
from tasks.control.rollout import DECISIONS, Rollout, RolloutError, Window
from tasks.runtime.gateway.access import ERROR_LOG, OUTCOMES, GatewayMetrics
from tasks.runtime.gateway.protocol import RequestError
from tasks.runtime.gateway.replicas import Replicas
from tasks.serving.service import VersionCounters

Change = Callable[[RouteTable], RouteTable | None]

TICK_S = 0.2  # how often the controller looks at the rollout and the lease: a window ends, a lapse is seen this late


def counted(metrics: GatewayMetrics, version: str) -> VersionCounters:
    """The gateway's counters of `version` now, read from its own registry (the release reads the same ones from the
    /metrics text: tasks/serving/service.py version_counters)."""

    def value(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"version": version, **labels}) or 0.0

    outcomes = {o: value("llmops_gateway_version_requests_total", outcome=o) for o in OUTCOMES}
    return VersionCounters(**outcomes, seconds=value("llmops_gateway_version_seconds_total"))


def breach(rollout: Rollout, requests: float, failures: float, mean_ms: float | None) -> str | None:
    if requests and failures / requests > rollout.max_error_rate:
        return f"candidate failed {failures:.0f}/{requests:.0f} requests (max error rate {rollout.max_error_rate:g})"
    if mean_ms is not None and mean_ms > rollout.max_mean_latency_ms:
        return f"candidate mean latency {mean_ms:.1f} ms > canary.max_mean_latency_ms {rollout.max_mean_latency_ms:g}"
    return None


def step_weights(table: RouteTable, rollout: Rollout, step: int) -> dict[str, float]:
    weight = rollout.steps[step]
    weights = {rollout.candidate: weight}
    if table.champion is not None and weight < 100:
        weights[table.champion.name] = 100 - weight
    return weights


def routed(table: RouteTable, rollout: Rollout, step: int, now: float) -> RouteTable:
    """`table` routing `rollout`'s step `step` from `now`."""
    started = replace(rollout, phase="ramping", step=step, step_started_at=now, updated_at=now)
    return replace(table, weights=step_weights(table, rollout, step), rollout=started, updated_at=now)


def promoted(table: RouteTable, rollout: Rollout, now: float) -> RouteTable:
    """The candidate the champion, alone in the routes; no release holds them any more."""
    candidate = table.candidate
    assert candidate is not None and candidate.name == rollout.candidate  # checked by `same` before
    return replace(
        table,
        champion=candidate,
        candidate=None,
        weights={candidate.name: 100.0},
        shadow=None,
        shadow_fraction=0.0,
        release=None,
        expires_at=None,
        rollout=rollout.ended("promoted", None, now),
        updated_at=now,
    )


def same(table: RouteTable, rollout: Rollout) -> bool:
    """Whether the table still holds the rollout as the controller saw it (no abort, lapse or new plan since)."""
    now = table.rollout
    return (
        now is not None
        and table.candidate is not None
        and (now.release, now.phase, now.step, now.step_started_at)
        == (rollout.release, rollout.phase, rollout.step, rollout.step_started_at)
    )


def submitted(current: RouteTable, data: dict[str, Any], lease_s: float, now: float) -> RouteTable:
    """The table holding the release's plan (PUT /control/v1/rollout) for its candidate, under its hold for lease_s."""
    candidate = current.candidate.name if current.candidate else None
    try:
        rollout = Rollout.planned(data, candidate, data.get("release"))
    except RolloutError as exc:
        raise RequestError(400, str(exc)) from None
    held = replace(rollout, updated_at=now)
    return replace(current, rollout=held, release=rollout.release, expires_at=now + lease_s, updated_at=now)


def decided(current: RouteTable, data: dict[str, Any], now: float) -> RouteTable | None:
    """The table after the release's decision (POST /control/v1/rollout/decision); None: the rollout ended already."""
    decision, release, rollout = data.get("decision"), data.get("release"), current.rollout
    if decision not in DECISIONS:
        raise RequestError(400, f"decision: one of {', '.join(DECISIONS)}")
    if rollout is None or rollout.release != release:
        raise RequestError(409, f"release: no rollout of {release!r} here")
    if not rollout.active:
        return None
    if decision == "abort":
        return current.champion_alone(f"aborted by release {release}: {str(data.get('reason'))[:300]}", now)
    last = rollout.step + 1 == len(rollout.steps)
    if rollout.phase != "paused" or (decision == "promote") != last:
        wanted = "promote: after the last step" if decision == "promote" else "next: before the last step"
        raise RequestError(409, f"decision: {wanted}, in a rollout paused for the release (it is {rollout.phase})")
    if last:
        return promoted(current, rollout, now)
    following = replace(rollout, phase="ramping", step=rollout.step + 1, step_started_at=0.0, updated_at=now)
    return replace(current, rollout=following, updated_at=now)


class RolloutController:
    def __init__(
        self,
        table: Callable[[], RouteTable],
        amend: Callable[[Change], Awaitable[RouteTable]],
        metrics: GatewayMetrics,
        replicas: Replicas,
    ):
        """`table` and `amend`: the gateway's (the current table; a change of it under its lock, record first)."""
        self.table, self.amend, self.metrics, self.replicas = table, amend, metrics, replicas
        self.baselines: dict[tuple[str, int, float], tuple[VersionCounters, float]] = {}  # step -> (counters, step_ms)

    async def run(self) -> None:
        said: tuple[str, float] = ("", 0.0)  # the last failure said, and when: one line a minute, not five a second
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.converge(time.time())
            except Exception as exc:  # the loop outlives a failed round (a record write refused): the next one tries
                line = f"{type(exc).__name__}: {exc}"
                if line != said[0] or time.monotonic() - said[1] > 60:
                    ERROR_LOG.error("rollout: a round of the controller failed: %s", line[:300])
                    said = (line, time.monotonic())

    async def converge(self, now: float) -> None:
        """One round: the champion alone where the release's hold lapsed; else route the step not yet routed, or end
        the window that is over."""
        table = self.table()
        if table.lapsed(now) is not None:
            await self.lapse(table)
            return
        rollout = table.rollout
        if rollout is None or rollout.phase != "ramping" or table.candidate is None:
            return
        if (
            not rollout.step_started_at
            or (rollout.release, rollout.step, rollout.step_started_at) not in self.baselines
        ):
            await self.route(rollout, rollout.step)  # a new plan, or one whose step this controller did not start
            return
        if now - rollout.step_started_at >= rollout.window_s:
            await self.end_window(table, rollout, now)

    async def lapse(self, table: RouteTable) -> None:
        """The champion alone: the release that holds the routes (a candidate, a step, a copy) died or hangs."""
        after = await self.amend(lambda current: current.lapsed(time.time()))  # again under the lock: renewed?
        if isinstance(after, RouteTable) and after.candidate is None and after.shadow is None:
            holder = (table.release, table.service)
            ERROR_LOG.warning("routes: release %s let its hold on %s lapse; the champion serves alone", *holder)
            self.metrics.leases_expired.inc()

    async def route(self, rollout: Rollout, step: int) -> None:
        """Step `step` routed, from `rollout` (the table's, with what the controller adds to it), and its window begun:
        the candidate's counters noted as the record is written (in effect for the next request)."""
        started, moment = time.perf_counter(), time.time()

        def change(current: RouteTable) -> RouteTable | None:
            return routed(current, rollout, step, moment) if same(current, rollout) else None

        after = await self.amend(change)
        if isinstance(after, RouteTable) and after.rollout is not None and after.rollout.step_started_at == moment:
            step_ms = (time.perf_counter() - started) * 1000
            self.baselines[(rollout.release, step, moment)] = (counted(self.metrics, rollout.candidate), step_ms)
            ERROR_LOG.info(
                "rollout: %s at %g%% for release %s", rollout.candidate, rollout.steps[step], rollout.release
            )

    async def end_window(self, table: RouteTable, rollout: Rollout, now: float) -> None:
        baseline, step_ms = self.baselines.pop((rollout.release, rollout.step, rollout.step_started_at))
        counts = counted(self.metrics, rollout.candidate)
        ok, failed = counts.ok - baseline.ok, counts.failed - baseline.failed
        mean_ms = (counts.seconds - baseline.seconds) / ok * 1000 if ok else None
        candidate: Version = table.candidate  # type: ignore[assignment]  # converge saw one
        not_ready = await self.replicas.not_ready_on(candidate)
        problem = (
            f"{candidate.name} is not ready on {', '.join(not_ready)}"
            if not_ready
            else breach(rollout, ok + failed, failed, mean_ms)
        )
        window = Window(rollout.weight, rollout.step_started_at, now, ok + failed, failed, mean_ms, step_ms, problem)
        watched = replace(rollout, windows=(*rollout.windows, window), updated_at=now)
        last = rollout.step == len(rollout.steps) - 1
        if problem is not None:

            def change(current: RouteTable) -> RouteTable | None:
                return replace(current, rollout=watched).champion_alone(f"canary breach: {problem}", now)

        elif rollout.await_decision:

            def change(current: RouteTable) -> RouteTable | None:
                return replace(current, rollout=replace(watched, phase="paused"), updated_at=now)

        elif last:

            def change(current: RouteTable) -> RouteTable | None:
                return promoted(current, watched, now)

        else:
            await self.route(watched, rollout.step + 1)  # the window and the next step in one write
            return
        await self.amend(lambda current: change(current) if same(current, rollout) else None)
        outcome = (
            f"rolled back: {problem}" if problem else "paused for the release" if rollout.await_decision else "promoted"
        )
        ERROR_LOG.info("rollout: %s %s", rollout.candidate, outcome)
