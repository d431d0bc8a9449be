"""evaluate: base vs candidate (base + adapter) on the held-out split.

Metrics: answer-token loss and perplexity (the loss LlamaFactory trains on: answer tokens and
the closing <|im_end|>, prompt masked), and the task metric (exact match of the greedy answer).
Prompts are encoded with the tokenizer's chat template, answers separately, the way
LlamaFactory's template encodes them, so the eval sees the same token boundaries as training.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tasks.config import EvaluateSection
from tasks.data import eval_conversations
from tasks.errors import CheckFailed
from tasks.stage import RunContext, StageResult, logger, run_cached

BATCH = 32


@dataclass
class Scores:
    loss: float
    perplexity: float
    exact_match: float
    predictions: list[str]

    def as_metrics(self, prefix: str) -> dict:
        return {f"{prefix}_loss": self.loss, f"{prefix}_perplexity": self.perplexity, f"{prefix}_exact_match": self.exact_match}


def load_model(base_dir: Path, adapter_dir: Path | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    return tokenizer


def prompt_ids(tokenizer, conversation: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def answer_ids(tokenizer, conversation: list[dict]) -> list[int]:
    return tokenizer(conversation[-1]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def batches(items: list, size: int = BATCH):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def answer_loss(model, tokenizer, conversations: list[list[dict]]) -> float:
    import torch

    total, count = 0.0, 0
    for group in batches(conversations):
        rows = [(prompt_ids(tokenizer, c), answer_ids(tokenizer, c)) for c in group]
        width = max(len(p) + len(a) for p, a in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, (p, a) in enumerate(rows):
            seq = p + a
            input_ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(p) : len(seq)] = torch.tensor(a)
            mask[i, : len(seq)] = 1
        with torch.no_grad():
            logits = model(input_ids=input_ids, attention_mask=mask).logits[:, :-1]
        target = labels[:, 1:]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                ignore_index=-100, reduction="sum")
        total += nll.item()
        count += int((target != -100).sum())
    return total / max(count, 1)


def generate_answers(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int) -> list[str]:
    import torch

    answers = []
    for group in batches(conversations):
        prompts = [prompt_ids(tokenizer, c) for c in group]
        batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        new_tokens = out[:, batch["input_ids"].shape[1]:]
        answers += [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new_tokens]
    return answers


def exact_match(predictions: list[str], conversations: list[list[dict]]) -> float:
    hits = sum(p.strip() == c[-1]["content"].strip() for p, c in zip(predictions, conversations))
    return hits / max(len(conversations), 1)


def score(model, tokenizer, conversations: list[list[dict]], cfg: EvaluateSection) -> Scores:
    loss = answer_loss(model, tokenizer, conversations)
    predictions = generate_answers(model, tokenizer, conversations, cfg.max_new_tokens)
    return Scores(loss, math.exp(min(loss, 50.0)), exact_match(predictions, conversations), predictions)


def evaluate(ctx: RunContext, data: StageResult, base: StageResult, adapter: StageResult) -> StageResult:
    cfg = ctx.profile.evaluate
    key = {"data": data.artifact.digest, "base": base.artifact.digest, "adapter": adapter.artifact.digest,
           "evaluate": cfg.model_dump()}

    def produce(out_dir: Path) -> dict:
        conversations = eval_conversations(ctx, data, cfg.max_samples)
        base_dir = ctx.store.fetch(base.artifact.digest)
        tokenizer = load_tokenizer(base_dir)
        base_scores = score(load_model(base_dir), tokenizer, conversations, cfg)
        candidate_scores = score(load_model(base_dir, ctx.store.fetch(adapter.artifact.digest)), tokenizer,
                                 conversations, cfg)
        metrics = {**base_scores.as_metrics("base"), **candidate_scores.as_metrics("candidate"),
                   "improvement": candidate_scores.exact_match - base_scores.exact_match, "samples": len(conversations)}
        samples = [{"prompt": c[:-1], "expected": c[-1]["content"], "base": b, "candidate": p}
                   for c, b, p in zip(conversations, base_scores.predictions, candidate_scores.predictions)]
        (out_dir / "evaluation.json").write_text(json.dumps({"metrics": metrics, "samples": samples}, indent=1))
        logger().info(
            f"evaluate: {'':10} {'loss':>8} {'ppl':>8} {'exact':>7}\n"
            f"  base      {base_scores.loss:8.3f} {base_scores.perplexity:8.2f} {base_scores.exact_match:7.3f}\n"
            f"  candidate {candidate_scores.loss:8.3f} {candidate_scores.perplexity:8.2f} {candidate_scores.exact_match:7.3f}"
        )
        if metrics["improvement"] < cfg.min_improvement:
            raise CheckFailed(
                f"evaluate: candidate exact match {candidate_scores.exact_match:.3f} beats base "
                f"{base_scores.exact_match:.3f} by {metrics['improvement']:.3f} < evaluate.min_improvement {cfg.min_improvement}"
            )
        return metrics

    return run_cached(ctx, "evaluate", key, produce,
                      headline=lambda m: f"exact {m['base_exact_match']:.2f} -> {m['candidate_exact_match']:.2f}")
