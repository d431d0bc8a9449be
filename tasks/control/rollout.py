"""A rollout: what a release asks the service to do with its candidate, and how far the service got.

A release submits a rollout (`PUT /control/v1/rollout`) once its candidate is loaded and in the table at 0%: the
steps, each step's window and the live checks with their thresholds. From then on the service's controller
(tasks/runtime/rollouts.py) walks it: it routes each step, watches the window on the gateway's own counters of the
candidate's requests (every client's, the release's probes among them), rolls back on a breach and promotes after
the last window. The release only reads the status and sends decisions (`abort`; `next` where it analyses the windows
itself, `await_decision`: `next` and at the last step `promote`). The status is part of the deployment record, written whole before anything it says is
done, so a reader never sees a step the record does not hold.

Liveness is the table's hold on the routes (`release`, `expires_at`: canary.lease_s, 15 s, renewed every 5 s): a
release that stops renewing is rolled back within the lease and the gateway's half-second check, candidate at 0%.

Plain data and the standard library, as the rest of the record (tasks/control/contract.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

Phase = Literal["ramping", "paused", "promoted", "rolled_back"]
PHASES: tuple[Phase, ...] = ("ramping", "paused", "promoted", "rolled_back")
ACTIVE: tuple[Phase, ...] = ("ramping", "paused")  # the controller acts; the others are how it ended
DECISIONS = ("abort", "next", "promote")  # next, promote: for a rollout paused for the release (await_decision)


class RolloutError(ValueError):
    """A rollout that cannot run: the message names the field."""


@dataclass(frozen=True)
class Window:
    """One step's window as the controller watched it: the candidate's requests (the gateway's counters)."""

    weight: float
    started_at: float
    ended_at: float
    requests: float
    failures: float
    mean_latency_ms: float | None
    step_ms: float  # how long the step's routes took to be in effect (the record written, the table swapped)
    breach: str | None = None

    @classmethod
    def of(cls, data: Any) -> Window:
        if not isinstance(data, dict):
            raise RolloutError("rollout.windows: objects")
        try:
            latency = data.get("mean_latency_ms")
            return cls(
                float(data["weight"]),
                float(data["started_at"]),
                float(data["ended_at"]),
                float(data["requests"]),
                float(data["failures"]),
                float(latency) if latency is not None else None,
                float(data.get("step_ms", 0.0)),
                data.get("breach") or None,
            )
        except (KeyError, TypeError, ValueError):
            raise RolloutError(
                "rollout.windows: weight, started_at, ended_at, requests and failures are numbers"
            ) from None


@dataclass(frozen=True)
class Rollout:
    """The release's plan (release .. await_decision) and the controller's status (phase .. reason)."""

    release: str  # the run it belongs to: the one holding the routes
    candidate: str  # the table's candidate, by version name
    steps: tuple[float, ...]  # the candidate's share at each step, rising, ending at 100
    window_s: float
    max_error_rate: float
    max_mean_latency_ms: float
    await_decision: bool = False  # each passed window waits for the release's `next` (it analyses elsewhere too)
    phase: Phase = "ramping"
    step: int = 0  # the step being watched (an index into steps)
    step_started_at: float = 0.0  # 0: the controller has not routed the step yet
    windows: tuple[Window, ...] = ()
    reason: str | None = None  # why it was rolled back (a breach, an abort, the lease, the serve's restart)
    updated_at: float = 0.0

    @property
    def active(self) -> bool:
        return self.phase in ACTIVE

    @property
    def weight(self) -> float:
        return self.steps[self.step]

    def ended(self, phase: Phase, reason: str | None, now: float) -> Rollout:
        return replace(self, phase=phase, reason=reason, updated_at=now)

    def as_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def planned(cls, data: Any, candidate: str | None, release: str | None) -> Rollout:
        """A release's request (PUT /control/v1/rollout): its plan only, checked; the status starts afresh."""
        if not isinstance(data, dict):
            raise RolloutError("rollout: an object")
        if candidate is None:
            raise RolloutError("rollout: the table has no candidate to roll out (PUT /control/v1/deployment first)")
        if not release:
            raise RolloutError("release: the run holding the candidate's routes")
        if data.get("candidate", candidate) != candidate:
            raise RolloutError(f"candidate: the table's candidate is {candidate}, not {data.get('candidate')}")
        plan = {k: data[k] for k in ("steps", "window_s", "max_error_rate", "max_mean_latency_ms") if k in data}
        return cls.of(
            {**plan, "release": release, "candidate": candidate, "await_decision": data.get("await_decision")}
        )

    @classmethod
    def of(cls, data: Any) -> Rollout:
        if not isinstance(data, dict):
            raise RolloutError("rollout: an object")
        steps = data.get("steps")
        if (
            not isinstance(steps, list | tuple)
            or not steps
            or any(isinstance(s, bool) or not isinstance(s, int | float) or not 0 < s <= 100 for s in steps)
            or list(steps) != sorted(steps)
            or steps[-1] != 100
        ):
            raise RolloutError("rollout.steps: rising percentages in (0, 100] ending at 100")
        numbers = {}
        for key, low, high in (("window_s", 0, 3600), ("max_error_rate", 0, 1), ("max_mean_latency_ms", 0, 3.6e6)):
            value = data.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
                raise RolloutError(f"rollout.{key}: a number from {low} to {high:g}")
            numbers[key] = float(value)
        if numbers["window_s"] <= 0 or numbers["max_mean_latency_ms"] <= 0:
            raise RolloutError("rollout.window_s and rollout.max_mean_latency_ms: above 0")
        phase = data.get("phase", "ramping")
        if phase not in PHASES:
            raise RolloutError(f"rollout.phase: one of {', '.join(PHASES)}")
        step = data.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < len(steps):
            raise RolloutError(f"rollout.step: an index into steps (0 to {len(steps) - 1})")
        for key in ("release", "candidate"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise RolloutError(f"rollout.{key}: required")
        return cls(
            data["release"],
            data["candidate"],
            tuple(float(s) for s in steps),
            numbers["window_s"],
            numbers["max_error_rate"],
            numbers["max_mean_latency_ms"],
            bool(data.get("await_decision")),
            phase,
            step,
            float(data.get("step_started_at") or 0.0),
            tuple(Window.of(w) for w in data.get("windows") or ()),
            data.get("reason") or None,
            float(data.get("updated_at") or 0.0),
        )
