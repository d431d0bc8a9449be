"""The gate's checks and its report: each check's value, interval, sample size, threshold and verdict (pass,
FAIL, or INCONCLUSIVE where an interval straddles the threshold), and the decision as JSON and markdown. The gate
(tasks/gate.py) and the shadow window's checks (tasks/shadow.py) build them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from tasks.quality.stats import Decides, Difference, RatioInterval


@dataclass
class Check:
    name: str
    value: float | None
    threshold: float
    comparison: str  # "<=" or ">="
    passed: bool
    interval: list[float] | None = None  # the interval the verdict used (its bound), if any
    samples: int | None = None  # paired samples, or benchmark rounds, behind the interval
    inconclusive: bool = False  # the interval straddles the threshold (a failed check: the gate cannot tell)

    @property
    def verdict(self) -> str:
        return "pass" if self.passed else "INCONCLUSIVE" if self.inconclusive else "FAIL"


@dataclass
class GateReport:
    model: str
    candidate_version: str
    champion_version: str | None
    passed: bool
    checks: list[Check] = field(default_factory=list)
    metric: str = ""
    served_artifact: str = ""
    measured_artifact: str = ""

    @property
    def decision(self) -> str:
        return "promote" if self.passed else "reject"

    def summary(self) -> str:
        failed = [
            f"{c.name} {c.value if c.value is None else round(c.value, 4)}"
            + (f" (interval {c.interval[0]:.4g}..{c.interval[1]:.4g})" if c.interval else "")
            + f" (needs {c.comparison} {c.threshold:g})"
            + ((f" inconclusive on {c.samples} samples" if c.samples else " inconclusive") if c.inconclusive else "")
            for c in self.checks
            if not c.passed
        ]
        return "; ".join(failed) or "all checks pass"

    def as_dict(self) -> dict:
        return {**asdict(self), "decision": self.decision}

    def description(self) -> str:
        """One paragraph for the registry's version page: the decision and its headline numbers."""
        numbers = "; ".join(
            f"{c.name} {'n/a' if c.value is None else format(c.value, '.4g')} "
            f"({c.verdict.lower()}, {c.comparison} {c.threshold:g})"
            for c in self.checks
        )
        against = f"v{self.champion_version}" if self.champion_version else "no champion (first release)"
        return f"Gate: {self.decision} against {against}. {numbers}."

    def markdown(self) -> str:
        lines = [
            f"# Gate: {self.decision.upper()} {self.model} v{self.candidate_version}",
            "",
            f"Champion: {'v' + self.champion_version if self.champion_version else 'none (first release)'}",
            "",
            f"Task metric: {self.metric or 'n/a'}; served artifact {self.served_artifact[:12] or 'n/a'}, "
            f"measured artifact {self.measured_artifact[:12] or 'n/a'}",
            "",
            "| check | value | interval | samples | threshold | verdict |",
            "|---|---|---|---|---|---|",
        ]
        for c in self.checks:
            value = "n/a" if c.value is None else f"{c.value:.4g}"
            interval = f"{c.interval[0]:.4g}..{c.interval[1]:.4g}" if c.interval else ""
            samples = "" if c.samples is None else str(c.samples)
            lines.append(
                f"| {c.name} | {value} | {interval} | {samples} | {c.comparison} {c.threshold:g} | {c.verdict} |"
            )
        return "\n".join(lines) + "\n"

    @classmethod
    def read(cls, path: Path) -> GateReport:
        """A report as `write` left it (its `decision` is derived, not read)."""
        fields = json.loads(path.read_text())
        fields.pop("decision", None)
        return cls(**{**fields, "checks": [Check(**check) for check in fields.get("checks", [])]})

    def write(self, folder: Path) -> tuple[Path, Path]:
        folder.mkdir(parents=True, exist_ok=True)
        json_path, md_path = folder / "gate_report.json", folder / "gate_report.md"
        json_path.write_text(json.dumps(self.as_dict(), indent=2))
        md_path.write_text(self.markdown())
        return json_path, md_path


def at_most(name: str, value: float | None, threshold: float, difference: Difference | None = None) -> Check:
    """value <= threshold; with an interval, its upper bound must be."""
    bound = difference.high if difference is not None and difference.high is not None else value
    return Check(
        name,
        value,
        threshold,
        "<=",
        bound is not None and bound <= threshold,
        difference.interval() if difference else None,
        difference.samples if difference else None,
    )


def at_least(name: str, value: float | None, threshold: float) -> Check:
    return Check(name, value, threshold, ">=", value is not None and value >= threshold)


def ratio_check(name: str, ratio: RatioInterval, threshold: float, comparison: Literal[">=", "<="]) -> Check:
    """A candidate/champion ratio over the benchmark's paired runs, decided on its interval."""
    return interval_check(name, ratio, threshold, comparison, ratio.rounds)


def interval_check(
    name: str, estimate: Decides, threshold: float, comparison: Literal[">=", "<="], samples: int
) -> Check:
    """pass, fail or inconclusive on the estimate's interval (tasks/quality/stats.py: Decides.verdict)."""
    verdict = estimate.verdict(threshold, comparison)
    return Check(
        name,
        estimate.value,
        threshold,
        comparison,
        verdict == "pass",
        estimate.interval(),
        samples,
        verdict == "inconclusive",
    )
