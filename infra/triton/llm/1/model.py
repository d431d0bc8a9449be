"""Triton Python-backend model: a causal LM from a Hugging Face folder, batched, streaming, with a KV cache.

Each `execute` receives the requests Triton's dynamic batcher gathered; they are decoded together
(left-padded prefill, then one token per step for the whole batch, reusing past key/values, so a
token costs the same at step 1 and step 100). Streaming requests get one response per token,
the others one response at the end; every request ends with the FINAL flag (decoupled mode).
"""

import gc
import json
import sys
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

# model_text.py is tasks/text/model_text.py, copied next to this file when the model is rendered
from model_roots import served_folder
from model_text import (
    chat_history,
    chat_template_on,
    encode_prompt,
    input_value,
    scored_token,
    stream_delta,
    unscored_token,
)


@dataclass
class Job:
    sender: object
    prompt: str
    ids: list
    max_tokens: int
    min_length: int
    stream: bool
    echo: bool
    temperature: float
    top_k: int
    top_p: float = 1.0  # nucleus: sample from the fewest most likely tokens whose probability reaches top_p
    logprobs: int = -1  # alternatives per token with each token's log probability; -1: no log probabilities
    prompt_logprobs: int = -1  # the same for the prompt's tokens (the gateway's echo); -1: none
    prompt_scores: list | None = None  # the prompt's tokens, scored by the prefill; sent with the first response
    made: int = 0  # tokens picked, the end of sequence included (usage)
    counted: int = 0  # of them, those a response has counted
    finish_reason: str = ""  # stop (the end of sequence) or length (max_tokens), once finished
    generator: object = None
    tokens: list = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)  # of the tokens not yet sent
    sent_text: str = ""
    done: bool = False


class TritonPythonModel:
    def initialize(self, args):
        # transformers imports these whenever they are installed, and this model calls none of them: scikit-learn
        # (assisted generation's confidence threshold, generation/candidate_generator.py), scipy (object-detection
        # losses, loss/loss_for_object_detection.py) and accelerate (big-model hooks for a device_map, which this
        # model does not pass; it imports boto3 for its SageMaker config). Each instance starts about 0.9 CPU-s
        # sooner and holds 52 MiB less (365 instead of 417 MiB loading cpu-tiny's model, docs/benchmarks.md). A None
        # entry in sys.modules makes importlib.util.find_spec, and so transformers, find each absent.
        for unused in ("sklearn", "scipy", "accelerate"):
            sys.modules.setdefault(unused, None)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("torch_threads", "1")))
        self.torch = torch
        # cuda: the profile's hardware.compute_dtype (bf16 on the GPU profiles); cpu: fp32.
        self.device = params.get("device", "cpu")
        dtype = getattr(torch, params.get("dtype", "float32"))
        # A relative model_dir is inside this model's version folder: the weights came with the load request.
        model_dir = served_folder(args, params["model_dir"], "model_dir")  # its folder or the store's (model_roots.py)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.chat = params.get("apply_chat_template", "true") == "true"
        self.default_max_tokens = int(params.get("default_max_tokens", "16"))
        self.context_tokens = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self.eos = self.tokenizer.eos_token_id
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        # Suppressed while an answer is shorter than its min_length (the gateway's min_tokens, ignore_eos): the end of
        # sequence, and every other special token, which decodes to nothing and would leave the answer short of it
        self.unspoken = sorted({self.eos, *self.tokenizer.all_special_ids} - {None})
        self.special = frozenset(self.tokenizer.all_special_ids)
        # GPT-2's byte-level alphabet (the character that spells each byte), which Qwen2's tokenizer uses
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}

    def finalize(self):
        # The stub ends with the interpreter's finalization, whose last garbage collection walks every object torch
        # and the model made: about 3 s an instance here, and an unload finalizes instances one after another. Frozen,
        # they are left to the process's exit (gc.freeze: 0.3 s instead of 3 s for cpu-tiny's model).
        gc.freeze()

    def parse(self, request):
        text = input_value(request, "text_input", None)
        if text is None:
            raise ValueError("text_input is required")
        history = chat_history(input_value(request, "chat_history", ""))
        max_tokens = int(input_value(request, "max_tokens", self.default_max_tokens))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        ids = encode_prompt(self.tokenizer, text, history, chat_template_on(request, self.chat))
        if len(ids) + max_tokens > self.context_tokens:
            raise ValueError(
                f"max_tokens {max_tokens} + {len(ids)} prompt tokens exceed the model's context of "
                f"{self.context_tokens} tokens; ask for at most {max(self.context_tokens - len(ids), 0)}"
            )
        job = Job(
            sender=request.get_response_sender(),
            prompt=text,
            ids=ids,
            max_tokens=max_tokens,
            min_length=int(input_value(request, "min_length", 0)),
            stream=bool(input_value(request, "stream", False)),
            echo=not bool(input_value(request, "exclude_input_in_output", False)),
            temperature=float(input_value(request, "temperature", 0.0)),
            top_k=int(input_value(request, "top_k", 0)),
            top_p=float(input_value(request, "top_p", 1.0)),
            logprobs=int(input_value(request, "logprobs", -1)),
            prompt_logprobs=int(input_value(request, "prompt_logprobs", -1)),
        )
        seed = input_value(request, "random_seed", None)
        if job.temperature > 0:
            job.generator = self.torch.Generator().manual_seed(int(seed) if seed is not None else 0)
        return job

    def execute(self, requests):
        jobs = []
        for request in requests:
            try:
                jobs.append(self.parse(request))
            except Exception as exc:  # a bad request fails alone, not its batch
                request.get_response_sender().send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
        if jobs:
            try:
                self.generate(jobs)
            except Exception as exc:
                for job in jobs:
                    if not job.done:
                        job.sender.send(
                            pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                        )
        return None

    def respond(self, job, text, final):
        outputs = [
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("token_count", np.array([[job.made - job.counted]], dtype=np.int32)),
        ]
        job.counted = job.made
        if final:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([[job.finish_reason.encode()]], dtype=np.object_)))
        if job.logprobs >= 0:  # the tokens this response carries, each with its log probability (OpenAI's shape)
            sent = json.dumps(job.pending_logprobs, ensure_ascii=False).encode("utf-8")
            outputs.append(pb_utils.Tensor("logprobs", np.array([[sent]], dtype=np.object_)))
            job.pending_logprobs = []
        if job.prompt_scores is not None:  # the first response carries the prompt's scores
            sent = json.dumps(job.prompt_scores, ensure_ascii=False).encode("utf-8")
            outputs.append(pb_utils.Tensor("prompt_logprobs", np.array([[sent]], dtype=np.object_)))
            job.prompt_scores = None
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        job.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)

    def token_logprobs(self, logits, token, alternatives):
        """The chosen token's log probability under the model (its logits before any sampling setting), and the
        `alternatives` most likely tokens' (OpenAI's top_logprobs): each as {token, logprob, bytes}."""
        logprobs = self.torch.log_softmax(logits, -1)

        def entry(token_id):
            return scored_token(self.tokenizer, self.byte_of, self.special, token_id, logprobs[token_id])

        top = self.torch.topk(logprobs, alternatives).indices.tolist() if alternatives > 0 else []
        return {**entry(token), "top_logprobs": [entry(t) for t in top]}

    def score_prompts(self, jobs, logits, width):
        """Each prompt's tokens with their log probabilities, where its job asked (echo), from the prefill's `logits`
        (left-padded to `width` columns; the logits at a column predict the next column's token): the first token
        has none."""
        for i, job in enumerate(jobs):
            if job.prompt_logprobs < 0:
                continue
            start, row = width - len(job.ids), logits[i].float().cpu()
            first = unscored_token(self.tokenizer, self.byte_of, self.special, job.ids[0])
            scored = [
                self.token_logprobs(row[start + j - 1], token, job.prompt_logprobs)
                for j, token in enumerate(job.ids[1:], start=1)
            ]
            job.prompt_scores = [first, *scored]

    def pick(self, job, logits):
        if len(job.tokens) < job.min_length:
            logits[self.unspoken] = float("-inf")
        if job.temperature <= 0:
            return int(logits.argmax())
        logits = logits / job.temperature
        if job.top_k > 0:
            cutoff = self.torch.topk(logits, job.top_k).values[-1]
            logits[logits < cutoff] = float("-inf")
        if job.top_p < 1:  # keep the most likely tokens until their probability reaches top_p (the first always)
            ordered, order = self.torch.sort(self.torch.softmax(logits, -1), descending=True)
            logits[order[(ordered.cumsum(-1) - ordered) >= job.top_p]] = float("-inf")
        return int(self.torch.multinomial(self.torch.softmax(logits, -1), 1, generator=job.generator))

    def generate(self, jobs):
        torch = self.torch
        width = max(len(job.ids) for job in jobs)
        input_ids = torch.full((len(jobs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for i, job in enumerate(jobs):  # left padding: every sequence ends at the last column
            input_ids[i, width - len(job.ids) :] = torch.tensor(job.ids)
            mask[i, width - len(job.ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past, step_ids, step_positions = None, input_ids, positions
        with torch.no_grad():
            for _ in range(max(job.max_tokens for job in jobs)):
                out = self.model(
                    input_ids=step_ids.to(self.device),
                    attention_mask=mask.to(self.device),
                    position_ids=step_positions.to(self.device),
                    past_key_values=past,
                    use_cache=True,
                )
                if past is None:  # the prefill: the prompts' scores, where asked (echo)
                    self.score_prompts(jobs, out.logits, width)
                past, logits = out.past_key_values, out.logits[:, -1, :].float().cpu()
                next_ids = torch.full((len(jobs),), self.pad, dtype=torch.long)
                for i, job in enumerate(jobs):
                    if job.done:
                        continue
                    token = self.pick(job, logits[i].clone())
                    next_ids[i] = token
                    finished = token == self.eos or len(job.tokens) + 1 >= job.max_tokens
                    job.finish_reason = "stop" if token == self.eos else "length"
                    job.made += 1
                    if job.logprobs >= 0:  # every token made, the end of sequence too (as vLLM's server scores)
                        job.pending_logprobs.append(self.token_logprobs(logits[i], token, job.logprobs))
                    if token != self.eos:
                        job.tokens.append(token)
                    self.emit(job, finished)
                if all(job.done for job in jobs):
                    break
                step_ids = next_ids[:, None]
                step_positions = step_positions[:, -1:] + 1
                mask = torch.cat([mask, torch.ones((len(jobs), 1), dtype=torch.long)], dim=1)

    def emit(self, job, finished):
        text = self.tokenizer.decode(job.tokens, skip_special_tokens=True)
        if job.stream:
            delta, job.sent_text = stream_delta(text, job.sent_text, finished)
            if delta or finished:
                self.respond(job, delta, finished)
        elif finished:
            self.respond(job, (job.prompt + text) if job.echo else text, True)
        job.done = finished
