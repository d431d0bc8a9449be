"""lm-evaluation-harness through a running `llmops serve`, held against the same tasks scored in-process (issue 43).

The harness (lm_eval 0.4.13, in its own environment: `make setup-lmeval`) runs the two small local tasks of
tests/data/lmeval/ against the gateway:
- `antonyms_choice` (multiple choice: loglikelihoods) with `local-completions`, which posts each
  context + continuation as one raw prompt with `echo`, `logprobs: 1` and `max_tokens: 1`, and sums
  `token_logprobs[ctxlen:-1]` (lm_eval/models/openai_completions.py);
- `antonyms_generate` (generate_until) with `local-chat-completions` and `--apply_chat_template`: each question as a
  user message, greedy, `stop` from the task's `until`.
The same requests are then answered here, in this process, by transformers on the served model's own folder: each
continuation's log probability after its context (raw tokens, as lm_eval split them), and each question's greedy
answer through the model's chat template (tasks/quality/chat.py, as training and serving encode it).

Used by tests/integration/test_service.py; run it against any serve of a model whose folder is at hand:

    .venv/bin/python -m tests.harness --url URL --service NAME --model-dir DIR [--key-file F] [--cacert PEM]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
TASKS = ROOT / "tests" / "data" / "lmeval"
# Loglikelihoods agree to this (nats, per continuation; measured: under 1e-6 on cpu-tiny): the engine may batch and
# pad prompts (left padding, an attention mask) where this process scores each alone, which moves float32 sums in
# their last digits
TOLERANCE = 1e-4


@dataclass
class Scored:
    """One sample as lm_eval logged it: each request's arguments (loglikelihood: context and continuation;
    generate_until: the chat as JSON and the generation settings), each request's answer (a loglikelihood, or the
    generated text), and the sample's metrics."""

    arguments: list[tuple[Any, Any]]
    answers: list[Any]
    metrics: dict[str, float]

    @classmethod
    def of(cls, row: dict[str, Any]) -> Scored:
        """A line of lm_eval's samples_<task>_<time>.jsonl: `arguments` {"gen_args_<i>": {"arg_0", "arg_1"}},
        `resps` one list per request ([[loglikelihood, is_greedy]] as strings, or [text])."""
        ordered = sorted(row["arguments"].items(), key=lambda item: int(item[0].rsplit("_", 1)[1]))
        arguments = [(request["arg_0"], request["arg_1"]) for _, request in ordered]
        answers = [resp[0][0] if isinstance(resp[0], list) else resp[0] for resp in row["resps"]]
        return cls(arguments, answers, {k: float(row[k]) for k in ("acc", "exact_match") if k in row})


def run_lm_eval(
    model: str,
    url: str,
    service: str,
    task: str,
    tokenizer_dir: Path,
    work: Path,
    api_key: str | None,
    cacert: Path | None = None,
) -> list[Scored]:
    """lm_eval's `model` (local-completions or local-chat-completions) on `task` against the gateway at `url`;
    the samples it logged. Offline: the tasks' data is a local JSON file, the tokenizer the served model's."""
    path = "/v1/completions" if model == "local-completions" else "/v1/chat/completions"
    model_args = {
        "base_url": url.rstrip("/") + path,
        "model": service,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tokenizer_dir),
        "tokenized_requests": "False",  # the gateway takes a prompt as text, not token ids
        "num_concurrent": "1",
        "max_retries": "1",
    }
    output = work / f"lm_eval-{task}"
    command = [
        str(LM_EVAL),
        *("--model", model, "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items())),
        *("--tasks", task, "--include_path", str(TASKS), "--batch_size", "1"),
        *("--log_samples", "--output_path", str(output)),
        # chat: the messages as the task makes them (the gateway applies the model's template); completions take
        # the task's text as it is (lm_eval renders a template for them only with token-id prompts, which this
        # gateway does not take), so antonyms_choice writes the tiny model's ChatML turn itself
        *(["--apply_chat_template"] if model == "local-chat-completions" else []),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["HF_HOME"] = str(work / "hf-home")  # lm_eval's datasets cache: not the user's
    env.pop("OPENAI_API_KEY", None)
    if cacert is not None:  # a private CA: lm_eval's requests and aiohttp read these (its ca_cert_path does not reach
        env["REQUESTS_CA_BUNDLE"] = env["SSL_CERT_FILE"] = str(cacert)  # its inference requests, api_models.py:464)
    if api_key is not None:
        env["OPENAI_API_KEY"] = api_key  # local-completions sends it as a Bearer token (its api_key property)
    # the tasks name their data relative to the repository root (tests/data/lmeval/*.yaml)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval {model} {task} exited {done.returncode}:\n{done.stderr[-4000:]}")
    samples = sorted(output.rglob(f"samples_{task}_*.jsonl"))
    if not samples:
        raise RuntimeError(f"lm_eval {model} {task} logged no samples under {output}")
    return [Scored.of(json.loads(line)) for line in samples[-1].read_text().splitlines()]


class InProcess:
    """The served model's folder scored and answered by transformers in this process (float32, one at a time)."""

    def __init__(self, model_dir: Path):
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        transformers.logging.disable_progress_bar()  # our lines, not its loading bars
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def loglikelihood(self, context: str, continuation: str) -> float:
        """log p(continuation | context) on raw tokens, split as lm_eval splits them (TemplateLM._encode_pair:
        trailing spaces of the context go to the continuation; the pair is encoded whole)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
        start = len(self.tokenizer(context, add_special_tokens=False)["input_ids"])
        with self.torch.no_grad():
            logits = self.model(self.torch.tensor([whole])).logits[0].float()
        logprobs = self.torch.log_softmax(logits, -1)
        return float(sum(logprobs[i - 1, whole[i]] for i in range(start, len(whole))))

    def answer(self, messages: list[dict[str, str]], max_tokens: int, until: list[str]) -> str:
        """The greedy answer to a chat, encoded with the model's chat template as the served model encodes it, cut
        at the first `until` sequence (as the gateway cuts `stop`)."""
        from tasks.quality.chat import encode_prompt

        *history, question = messages
        ids = encode_prompt(self.tokenizer, question["content"], history, True)
        with self.torch.no_grad():
            made = self.model.generate(
                self.torch.tensor([ids]),
                attention_mask=self.torch.ones((1, len(ids)), dtype=self.torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
            )[0][len(ids) :]
        text = self.tokenizer.decode(made, skip_special_tokens=True)
        cuts = [text.index(stop) for stop in until if stop in text]
        return text[: min(cuts)] if cuts else text


def compare(
    url: str, service: str, model_dir: Path, api_key: str | None = None, cacert: Path | None = None
) -> dict[str, Any]:
    """Both tasks through the gateway and in-process; what differs beyond TOLERANCE raises AssertionError. Returns
    the harness's scores and the largest loglikelihood difference, for the caller to print."""
    here = InProcess(model_dir)
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as scratch:
        work = Path(scratch)
        asked = (model_dir, work, api_key, cacert)
        choice = run_lm_eval("local-completions", url, service, "antonyms_choice", *asked)
        generate = run_lm_eval("local-chat-completions", url, service, "antonyms_generate", *asked)
    worst = 0.0
    for sample in choice:
        for (context, continuation), answer in zip(sample.arguments, sample.answers, strict=True):
            served = float(answer)
            expected = here.loglikelihood(context, continuation)
            worst = max(worst, abs(served - expected))
            assert abs(served - expected) <= TOLERANCE, (context, continuation, served, expected)
    for sample in generate:
        (chat, settings), served = sample.arguments[0], sample.answers[0]
        messages = json.loads(chat[0] if isinstance(chat, list) else chat)
        expected = here.answer(messages, int(settings.get("max_gen_toks", 8)), list(settings.get("until", [])))
        assert served == expected, (messages, served, expected)
    return {
        "acc": sum(s.metrics["acc"] for s in choice) / len(choice),
        "exact_match": sum(s.metrics["exact_match"] for s in generate) / len(generate),
        "samples": len(choice) + len(generate),
        "largest_loglikelihood_difference": worst,
    }


def served_model_dir(repository: Path, service: str) -> Path:
    """The folder of the newest served version of `service` in a Triton model repository (its config's model_dir)."""
    configs = sorted(repository.glob(f"{service}-v*/config.pbtxt"), key=lambda p: int(p.parent.name.rsplit("v", 1)[1]))
    if not configs:
        raise FileNotFoundError(f"no version of {service} in {repository}")
    from tasks.serving.repository import rendered_parameter

    found = rendered_parameter(configs[-1].parent, "model_dir")
    if not found:
        raise ValueError(f"{configs[-1]} names no model_dir")
    named = Path(found)
    return named if named.is_absolute() else configs[-1].parent / "1" / named


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the gateway's base URL (no /v1)")
    parser.add_argument("--service", required=True, help="the service's model name")
    parser.add_argument("--model-dir", type=Path, required=True, help="the served model's Hugging Face folder")
    parser.add_argument("--key-file", type=Path, help="a file holding a client API key")
    parser.add_argument("--cacert", type=Path, help="the CA certificate of a TLS gateway")
    args = parser.parse_args()
    if not LM_EVAL.exists():
        print(f"harness: {LM_EVAL} is missing; run `make setup-lmeval`", file=sys.stderr)
        return 2
    key = args.key_file.read_text().strip() if args.key_file else None
    print(json.dumps(compare(args.url, args.service, args.model_dir, key, args.cacert)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
