"""Harvest: a training set from what the service served (tasks/data/exchanges.py) and how clients judged it.

Each captured exchange becomes at most one record (its conversation and an answer), best first:
1. corrected: the client's correction as the answer (`POST /v1/feedback` with a correction);
2. good: the served answer, rated good;
3. unrated: the served answer, no feedback (only with min_rating "none").
Rated bad without a correction: out. Feedback counts only from the client that got the answer, and the newest
feedback on an answer wins. Then, counted in the report:
- near-duplicates: one record per prompt once case, spacing and punctuation are set aside (the best one);
- eval overlap: a prompt of the fixed held-out set (data.eval_source; without one, the eval split of the previous
  data) is never trained on, so the gate does not score the model on what it learned;
- already trained: a record the previous data holds (same prompt, same answer) adds nothing.
"""

from __future__ import annotations

import re
import statistics
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from tasks.data.exchanges import ExchangeLog
from tasks.data.records import CleanData, normalize
from tasks.platform.errors import BadInput
from tasks.quality.chat import Conversation

MinRating = Literal["good", "none"]
TIERS = ("corrected", "good", "unrated")
CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def prompt_key(conversation: Conversation) -> str:
    """A prompt (every turn before the answer) as near-duplicates share it: case, spacing, punctuation aside."""
    text = "\n".join(f"{m['role']}:{m['content']}" for m in conversation[:-1])
    text = "".join(c for c in unicodedata.normalize("NFKC", text).casefold() if unicodedata.category(c)[0] != "P")
    return " ".join(text.split())


def record_key(conversation: Conversation) -> str:
    return f"{prompt_key(conversation)}\n=>{' '.join(conversation[-1]['content'].casefold().split())}"


def language(conversation: Conversation) -> str:
    """zh where CJK characters make up a third of the letters, en where Latin letters do the rest, else other;
    a script count is all the report needs (no language-identification model is at hand)."""
    text = " ".join(m["content"] for m in conversation)
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return "other"
    if len(CJK.findall(text)) / len(letters) >= 1 / 3:
        return "zh"
    return "en" if sum(c.isascii() for c in letters) / len(letters) >= 0.5 else "other"


def length_stats(conversations: list[Conversation]) -> dict[str, float]:
    prompts = [sum(len(m["content"]) for m in c[:-1]) for c in conversations]
    answers = [len(c[-1]["content"]) for c in conversations]
    if not conversations:
        return {}
    deciles = statistics.quantiles(prompts, n=10) if len(prompts) > 1 else [prompts[0]] * 9
    return {
        "prompt_chars_mean": round(statistics.fmean(prompts), 1),
        "prompt_chars_p50": statistics.median(prompts),
        "prompt_chars_p90": round(deciles[8], 1),
        "answer_chars_mean": round(statistics.fmean(answers), 1),
    }


def shift(harvested: list[Conversation], previous: list[Conversation]) -> dict[str, Any]:
    """How the harvest differs from the previous training data: lengths, languages, and the two-sample
    Kolmogorov-Smirnov statistic of prompt lengths (0: same distribution, 1: disjoint)."""
    from scipy.stats import ks_2samp

    if not harvested or not previous:
        return {}

    def prompt_lengths(conversations: list[Conversation]) -> list[int]:
        return [sum(len(m["content"]) for m in c[:-1]) for c in conversations]

    return {
        "previous": length_stats(previous) | {"languages": dict(Counter(map(language, previous)))},
        "prompt_length_ks": round(float(ks_2samp(prompt_lengths(harvested), prompt_lengths(previous)).statistic), 3),
    }


@dataclass
class Candidate:
    tier: int
    at: float
    conversation: Conversation


@dataclass
class Harvest:
    records: list[Conversation]
    counts: dict[str, int] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)  # the captured objects read: the dataset's lineage

    def report(self, previous: CleanData | None) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "languages": dict(Counter(map(language, self.records))),
            "lengths": length_stats(self.records),
            "shift": shift(self.records, previous.train + previous.eval) if previous else {},
            "captured_objects": self.objects,
        }


def latest_feedback(log: ExchangeLog, service: str, since: datetime, counts: Counter) -> tuple[dict, list[str]]:
    objects = log.objects("feedback", service, since)
    newest: dict[str, dict] = {}
    for _, judged in log.records(objects):
        counts["feedback"] += 1
        if judged["id"] not in newest or judged["at"] >= newest[judged["id"]]["at"]:
            newest[judged["id"]] = judged
    return newest, [o.key for o in objects]


def candidate(exchange: dict, judged: dict | None, min_rating: MinRating, counts: Counter) -> Candidate | None:
    """The record an exchange gives, or None (counted by why)."""
    if judged is not None and judged.get("client") != exchange.get("client"):
        counts["feedback_from_another_client"] += 1
        judged = None
    if judged is not None and judged.get("correction"):
        tier, answer = 0, judged["correction"]
    elif judged is not None and judged["rating"] == "good":
        tier, answer = 1, exchange["answer"]
    elif judged is not None:
        counts["bad_dropped"] += 1
        return None
    elif min_rating == "none":
        tier, answer = 2, exchange["answer"]
    else:
        counts["unrated_dropped"] += 1
        return None
    try:
        conversation = normalize(
            {"messages": [*exchange["messages"], {"role": "assistant", "content": answer}]}, "openai", "exchange"
        )
    except (BadInput, KeyError, TypeError):
        counts["malformed_dropped"] += 1
        return None
    if not answer.strip():
        counts["empty_answer_dropped"] += 1
        return None
    return Candidate(tier, float(exchange["at"]), conversation)


def harvest(
    log: ExchangeLog,
    service: str,
    since: datetime,
    min_rating: MinRating = "good",
    previous: CleanData | None = None,
    eval_set: list[Conversation] | None = None,
) -> Harvest:
    """The training records of `service`'s exchanges since `since`, best first, with what was dropped and why.
    `previous`: the data the last release trained on; `eval_set`: the fixed held-out set (else previous.eval)."""
    counts: Counter = Counter()
    feedback, feedback_objects = latest_feedback(log, service, since, counts)
    objects = log.objects("exchanges", service, since)
    candidates, answered = [], set()
    for _, exchange in log.records(objects):
        if float(exchange.get("at", 0)) < since.timestamp():
            continue
        counts["exchanges"] += 1
        answered.add(exchange["id"])
        found = candidate(exchange, feedback.get(exchange["id"]), min_rating, counts)
        if found is not None:
            candidates.append(found)
    counts["feedback_without_exchange"] = sum(1 for id_ in feedback if id_ not in answered)
    held_out = {prompt_key(c) for c in (eval_set if eval_set is not None else previous.eval if previous else [])}
    trained = {record_key(c) for c in previous.train} if previous else set()
    records, prompts = [], set()
    for found in sorted(candidates, key=lambda c: (c.tier, -c.at)):  # best tier first; in a tier, the newest
        key = prompt_key(found.conversation)
        if key in prompts:
            counts["near_duplicates_dropped"] += 1
        elif key in held_out:
            counts["eval_overlap_dropped"] += 1
        elif record_key(found.conversation) in trained:
            counts["already_trained_dropped"] += 1
        else:
            prompts.add(key)
            records.append(found.conversation)
            counts[TIERS[found.tier]] += 1
    counts["records"] = len(records)
    return Harvest(records, dict(counts), [o.key for o in objects] + feedback_objects)


def save(harvested: Harvest, out: str, name: str) -> str:
    """The records as JSONL in OpenAI's messages format (what `llmops data push` and prepare_data read) at
    `out`/`name`.jsonl, a folder or an s3:// prefix, written whole; its URI."""
    import json
    import os
    import tempfile
    from pathlib import Path

    text = "".join(json.dumps({"messages": r}, ensure_ascii=False) + "\n" for r in harvested.records)
    if out.startswith("s3://"):
        from tasks.platform.store import s3_client, split_s3_uri

        bucket, prefix = split_s3_uri(out)
        key = f"{prefix.rstrip('/')}/{name}.jsonl" if prefix else f"{name}.jsonl"
        s3_client().put_object(Bucket=bucket, Key=key, Body=text.encode())
        return f"s3://{bucket}/{key}"
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".partial")
    with os.fdopen(fd, "w", encoding="utf-8") as stream:
        stream.write(text)
    target = folder / f"{name}.jsonl"
    os.replace(temporary, target)
    return str(target)
