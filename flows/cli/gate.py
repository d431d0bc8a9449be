"""`llmops gate`: a gate report's decision as an exit code, for release pipelines (0 promote, 10 reject)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flows.cli.common import Rejected
from tasks.platform.errors import BadInput


def register(commands) -> None:
    gate = commands.add_parser(
        "gate",
        help="read a gate report; exit 0 on promote, 10 on reject (for release pipelines)",
        description="Print a gate report written by `llmops run` and exit with its decision: 0 promote, 10 reject.",
        epilog="example (a CI/CD step):\n  llmops gate .llmops/work/gate/<mlflow-run-id>/gate_report.json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gate.add_argument("report", help="gate_report.json path (printed by llmops run)")
    gate.set_defaults(handler=command_gate)


def command_gate(args) -> str:
    path = Path(args.report)
    try:
        report = json.loads(path.read_text())
        decision, checks = report["decision"], report["checks"]
    except FileNotFoundError:
        raise BadInput(f"gate report {path}: not found") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise BadInput(f"gate report {path}: not a gate report ({type(exc).__name__}: {exc})") from None
    lines = [f"gate: {decision} {report['model']} v{report['candidate_version']} ({path})"]
    lines += [
        f"  {verdict(c)}  {c['name']}: {c['value']} {c['comparison']} {c['threshold']}"
        + (f" (interval {c['interval'][0]:.4g}..{c['interval'][1]:.4g})" if c.get("interval") else "")
        for c in checks
    ]
    if decision != "promote":
        failed = "; ".join(c["name"] for c in checks if not c["passed"])
        raise Rejected("\n".join(lines), f"gate rejected {report['model']} v{report['candidate_version']}: {failed}")
    return "\n".join(lines)


def verdict(check: dict) -> str:
    """pass, FAIL, or INCONCLUSIVE (a ratio whose interval straddles its threshold; reports before the
    benchmark's rounds have no `inconclusive` field)."""
    return "pass" if check["passed"] else "INCONCLUSIVE" if check.get("inconclusive") else "FAIL"
