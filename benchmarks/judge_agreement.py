"""How far an LLM judge (evaluate.judge) agrees with exact match and ROUGE-L on the data the project ships, and what it
costs per example: run it against the judge you mean to gate on before you trust its score.

For each shipped exam (cpu-tiny's antonyms, cpu-tiny-qa-zh's Chinese finance answers: the eval split each profile's
data section gives) and its first --examples records, three answers of known quality are graded against the
reference, through the gate's own judge code (tasks/quality/judge.py: rubric, scale, parsing):

- reference  the reference itself: a judge that agrees grades it at the top
- partial    its first half (words, or characters for Chinese): exact match 0, ROUGE-L in between
- other      another record's reference: wrong, whatever its wording

Prints per exam and kind the judge's mean score, exact match and ROUGE-L; Spearman's rank correlation of the judge's
scores with each metric over every graded answer; how often the judge's pass (score >= 0.5) agrees with exact
match; the share of answers without a grade; and the cost: seconds and the endpoint's tokens per answer.

    .venv/bin/python benchmarks/judge_agreement.py --url https://HOST/v1 --model NAME [--api-key-env VAR]
        [--examples 30] [--concurrency 4] [--out judge_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tasks.platform.config import load_profile  # noqa: E402
from tasks.platform.config.training import JudgeSection  # noqa: E402

EXAMS = {"antonyms": "cpu-tiny", "finance_qa_zh": "cpu-tiny-qa-zh"}
KINDS = ("reference", "partial", "other")


def exam(profile_name: str, examples: int) -> tuple[list[str], list[str]]:
    """The questions and references of a profile's eval split, as prepare_data makes it."""
    from tasks.data.records import read_data

    split = read_data(load_profile(profile_name).data).eval[:examples]
    return [c[-2]["content"] for c in split], [c[-1]["content"] for c in split]


def half(text: str) -> str:
    words = text.split()
    if len(words) > 1:
        return " ".join(words[: len(words) // 2])
    return text[: max(1, len(text) // 2)] if len(text) > 1 else ""


def answers_of_known_quality(references: list[str]) -> dict[str, list[str]]:
    shift = max(1, len(references) // 2)  # another record's reference, never the same one
    return {
        "reference": list(references),
        "partial": [half(r) for r in references],
        "other": [references[(i + shift) % len(references)] for i in range(len(references))],
    }


def agreement(cfg: JudgeSection, questions: list[str], references: list[str]) -> dict:
    from scipy.stats import spearmanr

    from tasks.quality.judge import judge
    from tasks.quality.metrics import exact_match, mean, rouge

    rows: list[tuple[str, float | None, float, float]] = []  # kind, judge score, exact match, ROUGE-L
    found: dict = {"kinds": {}}
    seconds = tokens = 0.0
    for kind, answers in answers_of_known_quality(references).items():
        judged = judge(cfg, questions, references, answers)
        seconds, tokens = seconds + judged.seconds, tokens + judged.tokens
        matches = [exact_match(a, r) for a, r in zip(answers, references, strict=True)]
        overlaps = [rouge(a, r)["rouge_l"] for a, r in zip(answers, references, strict=True)]
        rows += list(zip([kind] * len(answers), judged.scores, matches, overlaps, strict=True))
        found["kinds"][kind] = {
            "judge": judged.mean,
            "exact_match": mean(matches),
            "rouge_l": mean(overlaps),
            "malformed": judged.malformed_count,
            "malformed_examples": judged.malformed,
        }
    graded = [(score, em, rl) for _, score, em, rl in rows if score is not None]
    answered = len(rows)
    found |= {
        "answers": answered,
        "without_grade_share": round(1 - len(graded) / answered, 3),
        "seconds_per_answer": round(seconds / answered, 3),
        "tokens_per_answer": round(tokens / answered, 1),
    }
    if len({score for score, _, _ in graded}) > 1:
        scores = [score for score, _, _ in graded]
        found["spearman_vs_exact_match"] = round(float(spearmanr(scores, [em for _, em, _ in graded])[0]), 3)
        found["spearman_vs_rouge_l"] = round(float(spearmanr(scores, [rl for _, _, rl in graded])[0]), 3)
    else:
        found["spearman_vs_exact_match"] = found["spearman_vs_rouge_l"] = None  # a judge that gave one grade
    if graded:
        found["pass_agrees_with_exact_match"] = round(
            mean([float((s >= 0.5) == (em == 1.0)) for s, em, _ in graded]), 3
        )
    return found


def table(results: dict[str, dict]) -> str:
    def number(value) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'exam':<14} {'answer':<10} {'judge':>6} {'exact':>6} {'rouge_l':>8} {'no grade':>9}"]
    for name, found in results.items():
        for kind, row in found["kinds"].items():
            lines.append(
                f"{name:<14} {kind:<10} {number(row['judge']):>6} {row['exact_match']:>6.3f} {row['rouge_l']:>8.3f} "
                f"{row['malformed']:>9}"
            )
    lines.append("")
    lines.append(f"{'exam':<14} {'rho vs exact':>12} {'rho vs rouge_l':>14} {'pass = exact':>12} {'no grade':>9} {'s/answer':>9} {'tokens':>7}")  # fmt: skip
    for name, found in results.items():
        lines.append(
            f"{name:<14} {number(found['spearman_vs_exact_match']):>12} {number(found['spearman_vs_rouge_l']):>14} "
            f"{number(found.get('pass_agrees_with_exact_match')):>12} {found['without_grade_share']:>9.3f} "
            f"{found['seconds_per_answer']:>9.3f} {found['tokens_per_answer']:>7.1f}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the judge's OpenAI-compatible base URL (…/v1)")
    parser.add_argument("--model", required=True, help="the model name the endpoint serves")
    parser.add_argument("--api-key-env", default="LLMOPS_JUDGE_API_KEY", help="the variable holding its key")
    parser.add_argument("--examples", type=int, default=30, help="records of each exam (three answers each)")
    parser.add_argument("--concurrency", type=int, default=4, help="judge requests in flight")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens of the judge's answer")
    parser.add_argument("--exam", action="append", choices=sorted(EXAMS), help="one exam (default: both)")
    parser.add_argument("--out", type=Path, help="the numbers as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = JudgeSection(
        url=args.url,
        model=args.model,
        api_key_env=args.api_key_env,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
    )
    results = {}
    for name in args.exam or sorted(EXAMS):
        questions, references = exam(EXAMS[name], args.examples)
        print(f"judge-agreement: {name}: {len(references)} records x {len(KINDS)} answers ...", flush=True)
        results[name] = agreement(cfg, questions, references)
    print(f"\njudge-agreement: {args.model} at {args.url}\n")
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps({"judge": {"url": args.url, "model": args.model}, "exams": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
