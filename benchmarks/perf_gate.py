"""The gate's performance half on cpu-tiny: candidates equal to the champion and candidates served
slower, each released against the champion, with the gate's verdict side by side with the baseline
(what the gate did before: one genai-perf run per model, one after the other, and the ratio of
genai-perf's output tokens/s). Prints a table.

- equal: trained with another seed (`train.seed`), same data, same served config: the ratio's
  interval should hold 1.0 and the gate should promote.
- slow: another seed, served with `serve.max_queue_delay_us=20000`: Triton's dynamic batcher holds
  each batch 20 ms for requests that never come (8 fit, the benchmark sends 4 at a time), about
  half the throughput: the gate should reject on the throughput ratio. (`serve.max_batch_size=1` is
  no slowdown here: at concurrency 4 the tiny model is not what bounds the rate.)

The baseline is read from the same run: the first round's genai-perf export of each model (one
measurement each, champion first, as before) and its token-throughput ratio.

    .venv/bin/python benchmarks/perf_gate.py [--equal 5] [--slow 5] [--home DIR] [--tool genai-perf|aiperf]
        [--set KEY=VALUE ...]

With `--tool aiperf` a round is bench.profile_runs pairs of single AIPerf runs, so the ratio's samples are
rounds x runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from itertools import zip_longest
from pathlib import Path

from flows.cli.common import add_overrides_flag

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SLOW = ["--set", "serve.max_queue_delay_us=20000"]


def release(home: Path, *overrides: str) -> dict:
    """One `llmops run`; what its gate and benchmark said of the throughput ratio."""
    env = {**os.environ, "LLMOPS_HOME": str(home)}
    env.pop("PREFECT_HOME", None)
    done = subprocess.run([str(BIN / "llmops"), "run", *overrides], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode not in (0, 10):  # 10: rejected by the gate
        sys.exit(f"llmops run {' '.join(overrides)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    seconds = stage_seconds(done.stdout + done.stderr, "benchmark")
    report_path = re.search(r"gate report: (\S+)", done.stdout + done.stderr)
    if report_path is None:
        return {"returncode": done.returncode, "benchmark_s": seconds}
    report = json.loads(Path(report_path[1]).read_text())
    bench = json.loads((home / "work" / "benchmark" / Path(report_path[1]).parent.name / "benchmark.json").read_text())
    check = next((c for c in report["checks"] if c["name"] == "throughput ratio vs champion"), None)
    first = {role: rounds[0]["output_tokens_per_s"] for role, rounds in bench["rounds"].items()}
    return {
        "returncode": done.returncode,
        "decision": report["decision"],
        "benchmark_s": seconds,
        "check": check,
        "baseline_ratio": first["candidate"] / first["champion"] if "champion" in first else None,
    }


def stage_seconds(output: str, stage: str) -> float | None:
    """From the first to the last of a stage's Prefect log lines (HH:MM:SS.mmm | ... Task run 'stage-...)."""
    times = [
        int(h) * 3600 + int(m) * 60 + float(s)
        for h, m, s in re.findall(rf"^(\d\d):(\d\d):([\d.]+) \| \w+\s+\| Task run '{stage}-", output, re.M)
    ]
    return times[-1] - times[0] if times else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--equal", type=int, default=5, help="candidates equal to the champion (other seeds)")
    parser.add_argument("--slow", type=int, default=5, help="candidates served 20 ms slower a batch")
    parser.add_argument("--home", type=Path, help="LLMOPS_HOME (default: a fresh temporary folder)")
    parser.add_argument(
        "--tool", choices=("genai-perf", "aiperf"), default="genai-perf", help="bench.tool of every release"
    )
    add_overrides_flag(parser, "a profile override for every release (e.g. bench.rounds=1)")
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="llmops-perf-gate-"))
    tool = ["--set", f"bench.tool={args.tool}", *(f"--set={override}" for override in args.overrides)]
    first = release(home, *tool)
    print(f"home {home}; first release: {first.get('decision', first)}", flush=True)
    header = f"{'candidate':<18} {'baseline ratio':>14} {'ratio':>7} {'interval':>15} {'samples':>7} {'verdict':>13} {'gate':>8} {'bench s':>7}"
    print(header + "\n" + "-" * len(header), flush=True)
    equal = [("equal", 40 + i, []) for i in range(args.equal)]
    slow = [("slow", 60 + i, SLOW) for i in range(args.slow)]
    # alternating, so that whatever the machine does over the half hour falls on both kinds
    runs = [run for pair in zip_longest(slow, equal) for run in pair if run is not None]
    for kind, seed, extra in runs:
        measured = release(home, "--set", f"train.seed={seed}", *tool, *extra)
        check = measured["check"]
        verdict = "pass" if check["passed"] else "inconclusive" if check["inconclusive"] else "FAIL"
        print(
            f"{kind + ' seed ' + str(seed):<18} {measured['baseline_ratio']:>14.3f} {check['value']:>7.3f} "
            f"{check['interval'][0]:>7.3f}..{check['interval'][1]:<6.3f} {check['samples']:>7} {verdict:>13} "
            f"{measured['decision']:>8} {measured['benchmark_s'] or 0:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
