"""The release report's plots, drawn by matplotlib as inline SVG: no file, no script, no font fetched (text stays
text, in the page's font), the same bytes for the same numbers (a fixed id salt, no date)."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

COLORS = {"candidate": "#d6604d", "champion": "#4393c3", "offline": "#7f7f7f"}


def figure(rows: int = 1, columns: int = 1, width: float = 7.5, height: float = 3.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "llmops-release-report", "font.size": 9})
    return plt.subplots(rows, columns, figsize=(width, height), squeeze=False)


def as_svg(fig) -> str:
    """The figure as an <svg> element (the XML prolog and doctype left out: it sits inside the page)."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    fig.tight_layout()
    fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    plt.close(fig)
    text = buffer.getvalue()
    return text[text.index("<svg") :]


def cdf(series: Mapping[str, Sequence[float]], xlabel: str) -> str:
    """One empirical CDF per role on one plot; a role with no values is left out."""
    fig, axes = figure()
    ax = axes[0][0]
    for role, values in series.items():
        if not values:
            continue
        ordered = sorted(values)
        shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
        ax.step(ordered, shares, where="post", label=f"{role} ({len(ordered)})", color=COLORS.get(role))
    ax.set(xlabel=xlabel, ylabel="share of requests", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return as_svg(fig)


def score_histogram(scores: Mapping[str, Sequence[float]], metric: str) -> str:
    """Per-example scores of each role, side by side in ten bins over [0, 1] (wider where a score is past 1)."""
    fig, axes = figure()
    ax = axes[0][0]
    present = {role: list(values) for role, values in scores.items() if values}
    top = max([1.0, *(max(values) for values in present.values())])
    ax.hist(
        list(present.values()),
        bins=10,
        range=(0, top),
        label=[f"{role} (mean {sum(v) / len(v):.3f})" for role, v in present.items()],
        color=[COLORS.get(role, "#999999") for role in present],
    )
    ax.set(xlabel=f"{metric} per example", ylabel="examples")
    ax.grid(alpha=0.3)
    ax.legend()
    return as_svg(fig)


def canary_timeline(steps: Sequence[Mapping[str, object]]) -> str:
    """The ramp over time: the candidate's traffic share, requests and failures per step's window, and latencies."""
    fig, axes = figure(1, 2, width=9.0)
    start = float(steps[0]["at"])  # type: ignore[arg-type]
    seconds = [float(s["at"]) - start for s in steps]  # type: ignore[arg-type]
    share = axes[0][0]
    counts = share.twinx()
    share.step(seconds, [s["weight"] for s in steps], where="post", color=COLORS["candidate"], label="candidate %")
    share.set(xlabel="seconds into the ramp", ylabel="candidate's traffic share (%)", ylim=(0, 105))
    counts.plot(seconds, [s["requests"] for s in steps], "o-", color=COLORS["champion"], label="requests")
    counts.plot(seconds, [s["failures"] for s in steps], "x--", color="black", label="failed")
    counts.set(ylabel="requests per window")
    share.legend(loc="upper left")
    counts.legend(loc="lower right")
    latency = axes[0][1]
    mean = [s.get("candidate_mean_latency_ms") for s in steps]
    p99 = [s.get("client_p99_ms") for s in steps]
    latency.plot(seconds, [m if m is not None else float("nan") for m in mean], "o-", label="candidate mean")
    latency.plot(seconds, [p if p is not None else float("nan") for p in p99], "s--", label="clients' p99")
    latency.set(xlabel="seconds into the ramp", ylabel="ms")
    latency.grid(alpha=0.3)
    latency.legend()
    return as_svg(fig)
