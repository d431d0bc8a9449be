"""Task quality where users are served: the eval split answered by the versions the service serves.

Each eval question goes through the service's gateway to `/v2/models/<candidate or champion>/generate` with the
inputs a client sends (text_input, chat_history for a system prompt or earlier turns, max_tokens), so the answers
pass through the gateway and the serving model's own prompt encoding, tokenizer and stop tokens. They are scored
with the same metrics as the offline answers (tasks/quality/metrics.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from tasks.quality.chat import Conversation, serving_request
from tasks.quality.metrics import text_scores

SERVED_ANSWERS_FILE = "served_answers.json"


@dataclass
class ServedScores:
    model: str
    answers: list[str]
    per_sample: dict[str, list[float]]
    answer_tokens: list[int]  # tokens of each served answer, by the served model's tokenizer


class Answers(Protocol):
    """What answers a version by name (the service's control API: tasks/serving/service.py)."""

    def generate(
        self, name: str, text: str, max_tokens: int, timeout: float, history: Sequence[Mapping[str, object]] | None
    ) -> str: ...


def ask(triton: Answers, model: str, conversations: list[Conversation], max_tokens: int, concurrency: int) -> list[str]:
    """Every conversation's answer, `concurrency` in flight: what the version's engine batches, as for clients."""

    def one(conversation: Conversation) -> str:
        text, history = serving_request(conversation)
        return triton.generate(model, text, max_tokens=max_tokens, timeout=120, history=history).strip()

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, conversations))


def score_served(
    triton: Answers, model: str, conversations: list[Conversation], max_tokens: int, tokenizer, concurrency: int
) -> ServedScores:
    answers = ask(triton, model, conversations, max_tokens, concurrency)
    per_sample = text_scores(answers, [c[-1]["content"] for c in conversations])
    tokens = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers]
    return ServedScores(model, answers, per_sample, tokens)


def stop_probe(offline_answers: list[str], tokenizer, max_tokens: int) -> int | None:
    """The eval sample the model answers in the fewest tokens offline (it stopped at EOS well before
    max_tokens): served, it must stop before max_tokens too. None when no answer is that short."""
    lengths = [len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in offline_answers]
    short = [(n, i) for i, n in enumerate(lengths) if 0 < n <= max_tokens // 2]
    return min(short)[1] if short else None
