"""Harvest: a training set from what the service served (tasks/data/exchanges.py) and how clients judged it.

Each captured exchange becomes at most one record (its conversation and an answer), best first:
1. corrected: the client's correction as the answer (`POST /v1/feedback` with a correction); with `trusted`
   (the flywheel's review rules: serve.capture.trusted_clients), only a trusted client's;
2. good: the served answer, rated good;
3. unrated: the served answer, no feedback (only with min_rating "none").
Rated bad without a correction: out. Feedback counts only from the client that got the answer, and the newest
feedback on an answer wins. With `trusted`, a conversation with a client-written system turn is out too (no
person reads it). Then, counted in the report:
- near-duplicates: one record per prompt once case, spacing and punctuation are set aside (the best one);
- eval overlap: a prompt of the fixed held-out set (data.eval_source; without one, the eval split of the previous
  data) is never trained on, so the gate does not score the model on what it learned;
- already trained: a record the previous data holds (same prompt, same answer) adds nothing.

Each record is written with where it came from (`"harvested": {"client", "exchange", "at"}`): prepare_data keeps
such records out of every eval split and refuses a client-written history unless training masks it
(tasks/data/records.py), and retention and a client's deletion request find them by it (tasks/data/forget.py).
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
from tasks.data.objects import local_root, open_location
from tasks.data.records import HARVESTED, CleanData, normalize
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
    client: str
    exchange: str  # the response id the client got
    served: str  # the answer the service gave (the record's answer unless corrected)


@dataclass
class Harvest:
    records: list[Conversation]
    counts: dict[str, int] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)  # the captured objects read: the dataset's lineage
    kept: list[Candidate] = field(default_factory=list)  # what each record came from, in the records' order

    @property
    def clients(self) -> Counter:
        return Counter(c.client for c in self.kept)

    def report(self, previous: CleanData | None, samples: int = 10) -> dict[str, Any]:
        """Counts, languages, lengths and shift, and who contributed what: records per client and each one's
        share, and `samples` corrections beside the answers they replace (what a reviewer reads first)."""
        clients, total = self.clients, max(1, len(self.records))
        corrections = [c for c in self.kept if c.tier == 0]
        return {
            "counts": self.counts,
            "clients": dict(clients.most_common()),
            "client_shares": {name: round(n / total, 4) for name, n in clients.most_common()},
            "largest_client_share": round(max(clients.values(), default=0) / total, 4),
            "distinct_clients": len(clients),
            "corrections": [
                {
                    "client": c.client,
                    "exchange": c.exchange,
                    "prompt": c.conversation[-2]["content"],
                    "served": c.served,
                    "correction": c.conversation[-1]["content"],
                }
                for c in corrections[:samples]
            ],
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


def own_feedback(exchange: dict, judged: dict | None, counts: Counter) -> dict | None:
    """The feedback on an exchange where the client that got the answer sent it; another client's counts for nothing."""
    if judged is not None and judged.get("client") != exchange.get("client"):
        counts["feedback_from_another_client"] += 1
        return None
    return judged


def refused_by_rules(exchange: dict, judged: dict | None, trusted: frozenset[str] | None, counts: Counter) -> bool:
    """The review rules (`trusted` set): an untrusted client's correction, or a client-written system turn, is out."""
    if trusted is None:
        return False
    if judged is not None and judged.get("correction") and judged["client"] not in trusted:
        counts["untrusted_correction_dropped"] += 1
        return True
    if any(m.get("role") == "system" for m in exchange.get("messages") or []):
        counts["system_turn_dropped"] += 1
        return True
    return False


def candidate(
    exchange: dict, judged: dict | None, min_rating: MinRating, counts: Counter, trusted: frozenset[str] | None
) -> Candidate | None:
    """The record an exchange gives, or None (counted by why). `trusted`: the clients whose corrections count
    (None: every client's, for a person to review)."""
    judged = own_feedback(exchange, judged, counts)
    if refused_by_rules(exchange, judged, trusted, counts):
        return None
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
    served = str(exchange.get("answer", ""))
    return Candidate(tier, float(exchange["at"]), conversation, str(exchange.get("client", "")), exchange["id"], served)


def harvest(
    log: ExchangeLog,
    service: str,
    since: datetime,
    min_rating: MinRating = "good",
    previous: CleanData | None = None,
    eval_set: list[Conversation] | None = None,
    trusted: frozenset[str] | None = None,
) -> Harvest:
    """The training records of `service`'s exchanges since `since`, best first, with what was dropped and why.
    `previous`: the data the last release trained on; `eval_set`: the fixed held-out set (else previous.eval);
    `trusted`: only these clients' corrections, and no client-written system turn (None: all, for review)."""
    counts: Counter = Counter()
    feedback, feedback_objects = latest_feedback(log, service, since, counts)
    objects = log.objects("exchanges", service, since)
    candidates, answered = [], set()
    for _, exchange in log.records(objects):
        if float(exchange.get("at", 0)) < since.timestamp():
            continue
        counts["exchanges"] += 1
        answered.add(exchange["id"])
        found = candidate(exchange, feedback.get(exchange["id"]), min_rating, counts, trusted)
        if found is not None:
            candidates.append(found)
    counts["feedback_without_exchange"] = sum(1 for id_ in feedback if id_ not in answered)
    held_out = {prompt_key(c) for c in (eval_set if eval_set is not None else previous.eval if previous else [])}
    trained = {record_key(c) for c in previous.train} if previous else set()
    kept: list[Candidate] = []
    prompts: set[str] = set()
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
            kept.append(found)
            counts[TIERS[found.tier]] += 1
    counts["records"] = len(kept)
    counts["with_history"] = sum(1 for c in kept if has_history(c.conversation))
    lineage = [o.key for o in objects] + feedback_objects
    return Harvest([c.conversation for c in kept], dict(counts), lineage, kept)


def has_history(conversation: Conversation) -> bool:
    """Whether a conversation holds an assistant turn before its answer: a client wrote it."""
    return any(m["role"] == "assistant" for m in conversation[:-1])


def dataset_text(harvested: Harvest) -> str:
    """The records as JSONL in OpenAI's messages format, each with where it came from."""
    import json

    return "".join(
        json.dumps(
            {"messages": c.conversation, HARVESTED: {"client": c.client, "exchange": c.exchange, "at": c.at}},
            ensure_ascii=False,
        )
        + "\n"
        for c in harvested.kept
    )


def dataset_sha256(harvested: Harvest) -> str:
    """The sha256 of the dataset's bytes as save writes them: what an approval of it is bound to."""
    import hashlib

    return hashlib.sha256(dataset_text(harvested).encode()).hexdigest()


def admission_refusals(report: dict[str, Any], max_client_share: float, min_clients: int) -> list[str]:
    """Why the flywheel's review rules do not admit a harvest unreviewed (empty: admitted). The harvest itself
    already kept only trusted clients' corrections and no client-written system turn."""
    refusals = []
    largest = report.get("largest_client_share", 1.0)
    if largest > max_client_share:
        top = next(iter(report.get("clients", {})), "?")
        refusals.append(
            f"client {top} contributed {largest:.1%} of the records, above flywheel.max_client_share "
            f"{max_client_share:.1%}"
        )
    if report.get("distinct_clients", 0) < min_clients:
        refusals.append(
            f"{report.get('distinct_clients', 0)} distinct clients, fewer than flywheel.min_clients {min_clients}"
        )
    return refusals


def save(harvested: Harvest, out: str, name: str) -> str:
    """The records (dataset_text: what `llmops data push` and prepare_data read) at `out`/`name`.jsonl."""
    return save_text(dataset_text(harvested), out, name)


def save_text(text: str, out: str, name: str) -> str:
    """JSONL `text` at `out`/`name`.jsonl, a folder or an s3:// prefix, written whole (mode 600 in a folder); its URI
    (a path for a folder)."""
    location = open_location(out)
    location.put(f"{name}.jsonl", text)
    return location.uri_of(f"{name}.jsonl") if out.startswith("s3://") else str(local_root(out) / f"{name}.jsonl")
