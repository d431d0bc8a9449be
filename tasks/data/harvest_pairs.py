"""Preference pairs from what the service served (issue 78): `llmops data harvest --pairs`.

A pair is a prompt, a better answer and a worse one, from the exchanges `llmops serve` captured and the feedback of
the client that got each answer (tasks/data/harvest.py reads the same log the same way):
1. corrected: the client's correction (chosen) against the answer it was served (rejected);
2. rated: one client's two answers to one prompt, one rated good (chosen) and one bad (rejected), the newest of each.
The flywheel's rules apply as to SFT records: feedback counts only from the client that got the answer, the newest
feedback on an answer wins, `trusted` keeps only those clients' corrections and no client-written system turn; one pair
per prompt (case, spacing and punctuation aside), the best first; a prompt of the held-out set is never a pair.

Each pair is written in LlamaFactory's openai layout with where it came from (`"harvested"`), which `llmops data
forget` finds it by (tasks/data/forget.py) and which keeps it out of every eval split (tasks/data/preferences.py).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from tasks.data.exchanges import ExchangeLog
from tasks.data.harvest import latest_feedback, own_feedback, prompt_key, refused_by_rules
from tasks.data.records import HARVESTED, normalize
from tasks.platform.errors import BadInput
from tasks.quality.chat import Conversation, Message

PAIR_TIERS = ("corrected", "rated")


@dataclass
class Pair:
    tier: int  # PAIR_TIERS
    at: float
    prompt: Conversation
    chosen: str
    rejected: str
    client: str
    exchange: str  # the response id the chosen answer (or the correction) belongs to

    @property
    def key(self) -> str:
        return prompt_key([*self.prompt, Message(role="assistant", content="")])


@dataclass
class PairHarvest:
    pairs: list[Pair]
    counts: dict[str, int] = field(default_factory=dict)
    objects: list[str] = field(default_factory=list)  # the captured objects read: the dataset's lineage

    def report(self, samples: int = 0) -> dict:
        """The counts and each client's share (what the flywheel's review rules read, as of an SFT harvest), and the
        first `samples` pairs for a reviewer: the served or worse answer (rejected) beside the better one (chosen)."""
        clients = Counter(p.client for p in self.pairs)
        total = max(1, len(self.pairs))
        shares = {name: round(n / total, 4) for name, n in clients.most_common()}
        return {
            "counts": self.counts,
            "clients": dict(clients.most_common()),
            "client_shares": shares,
            "distinct_clients": len(clients),
            "largest_client_share": max(shares.values(), default=0.0),
            "corrections": [
                {"client": p.client, "prompt": p.prompt[-1]["content"], "served": p.rejected, "correction": p.chosen}
                for p in self.pairs[:samples]
            ],
            "captured_objects": self.objects,
        }


def prompt_of(exchange: dict) -> Conversation | None:
    """The exchange's turns as a validated prompt (the answer aside), or None where they are malformed."""
    try:
        turns = [*exchange["messages"], {"role": "assistant", "content": "-"}]
        return normalize({"messages": turns}, "openai", "exchange")[:-1]
    except (BadInput, KeyError, TypeError):
        return None


def usable(exchange: dict, judged: dict | None, trusted: frozenset[str] | None, counts: Counter) -> Conversation | None:
    """The exchange's prompt where its client's feedback may make a pair of it (else None, counted by why)."""
    judged = own_feedback(exchange, judged, counts)
    if judged is None:
        counts["unrated_dropped"] += 1
        return None
    if refused_by_rules(exchange, judged, trusted, counts):
        return None
    prompt = prompt_of(exchange)
    if prompt is None:
        counts["malformed_dropped"] += 1
    return prompt


def rated_pairs(rated: dict[tuple[str, str], dict[str, Pair]], counts: Counter) -> list[Pair]:
    """One pair per client and prompt that has an answer rated good and another rated bad (the newest of each)."""
    pairs = []
    for answers in rated.values():
        good, bad = answers.get("good"), answers.get("bad")
        if good is None or bad is None or good.chosen.strip() == bad.chosen.strip():
            counts["rated_without_a_pair_dropped"] += len(answers)
            continue
        pairs.append(Pair(1, max(good.at, bad.at), good.prompt, good.chosen, bad.chosen, good.client, good.exchange))
    return pairs


def harvest_pairs(
    log: ExchangeLog,
    service: str,
    since: datetime,
    eval_set: list[Conversation] | None = None,
    trusted: frozenset[str] | None = None,
) -> PairHarvest:
    """The preference pairs of `service`'s exchanges since `since`, best first, with what was dropped and why."""
    counts: Counter = Counter()
    feedback, feedback_objects = latest_feedback(log, service, since, counts)
    objects = log.objects("exchanges", service, since)
    found: list[Pair] = []
    rated: dict[tuple[str, str], dict[str, Pair]] = defaultdict(dict)  # (client, prompt) -> rating -> newest answer
    for _, exchange in log.records(objects):
        at = float(exchange.get("at", 0))
        if at < since.timestamp():
            continue
        counts["exchanges"] += 1
        judged = feedback.get(exchange["id"])
        prompt = usable(exchange, judged, trusted, counts)
        if prompt is None or judged is None:
            continue
        client, served, correction = (
            str(exchange.get("client", "")),
            str(exchange.get("answer", "")),
            judged.get("correction"),
        )
        if correction and (not served.strip() or served.strip() == str(correction).strip()):
            counts["correction_without_other_answer_dropped"] += 1
        elif correction:
            found.append(Pair(0, at, prompt, str(correction), served, client, exchange["id"]))
        else:
            answer = Pair(1, at, prompt, served, "", client, exchange["id"])
            newest = rated[(client, answer.key)].get(judged["rating"])
            if newest is None or at >= newest.at:
                rated[(client, answer.key)][judged["rating"]] = answer
    held_out = {prompt_key(c) for c in eval_set or []}
    kept: list[Pair] = []
    prompts: set[str] = set()
    for pair in sorted(found + rated_pairs(rated, counts), key=lambda p: (p.tier, -p.at)):  # corrections first, newest
        if pair.key in prompts:
            counts["near_duplicates_dropped"] += 1
        elif pair.key in held_out:
            counts["eval_overlap_dropped"] += 1
        else:
            prompts.add(pair.key)
            kept.append(pair)
            counts[PAIR_TIERS[pair.tier]] += 1
    counts["pairs"] = len(kept)
    return PairHarvest(kept, dict(counts), [o.key for o in objects] + feedback_objects)


def pairs_text(harvested: PairHarvest) -> str:
    """The pairs as JSONL in LlamaFactory's openai preference layout, each with where it came from."""
    return "".join(
        json.dumps(
            {
                "messages": p.prompt,
                "chosen": p.chosen,
                "rejected": p.rejected,
                HARVESTED: {"client": p.client, "exchange": p.exchange, "at": p.at},
            },
            ensure_ascii=False,
        )
        + "\n"
        for p in harvested.pairs
    )
