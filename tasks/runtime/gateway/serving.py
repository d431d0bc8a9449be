"""OpenAI's chat and text completions on Triton's generate API: a request becomes generate inputs, the answer
becomes a completion (or its server-sent events), with stop sequences, finish_reason and usage.

Token counts (usage, and finish_reason "length") use the champion's tokenizer and encode the prompt as the
served model does; without a tokenizer they are 0 and every answer finishes with "stop".
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse

from tasks.control.contract import RouteTable, Version
from tasks.quality.chat import encode_prompt
from tasks.runtime.gateway.access import GatewayMetrics, current, reserve_tokens
from tasks.runtime.gateway.capture import Capture
from tasks.runtime.gateway.openai_fields import Engine, check_fields, sampling, scored_prompt, scored_tokens
from tasks.runtime.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    GenerateInputs,
    GenerateRequest,
    RequestError,
    UsageInfo,
)
from tasks.runtime.gateway.replicas import Replicas
from tasks.runtime.gateway.reply import Reply, answered_by, ended_on_its_own
from tasks.runtime.gateway.shadow import Shadow
from tasks.runtime.gateway.stops import StopScanner, cut_at_stop
from tasks.runtime.gateway.tool_calls import TemplateProbe, ToolCalling
from tasks.runtime.gateway.work import Pools

DONE = b"data: [DONE]\n\n"


def bounded_max_tokens(value: int | None, name: str, context_tokens: int, default: int) -> int:
    """The answer's token budget: as asked, never over the model's context; the default where none was asked."""
    if value is None:
        return min(default, context_tokens)
    if value > context_tokens:
        raise RequestError(
            400,
            f"{name} {value} is more than the model's context of {context_tokens} tokens",
            param=name,
            code="context_length_exceeded",
        )
    return value


def conversation(inputs: GenerateInputs | GenerateRequest) -> list[dict[str, str]]:
    """The messages a generate request carries: its earlier turns (chat_history), then the question."""
    return [*json.loads(inputs.chat_history or "[]"), {"role": "user", "content": inputs.text_input}]


def made_tokens(outputs: dict[str, Any], scored: list[dict[str, Any]] | None) -> int | None:
    """The tokens an engine made for one of its responses: its token_count (every engine here sends it), or where
    it sent none, its scored tokens (logprobs); None where it said neither (usage then re-encodes the text)."""
    if outputs.get("token_count") is not None:
        return int(outputs["token_count"])
    return None if scored is None else len(scored)


@dataclass
class Tally:
    """What an engine's streamed responses said besides their text: the tokens made (None: it counted none), the
    last scored ones (whether the answer ended on its own) and its finish reason, on its last response."""

    made: int | None = None
    last: list[dict[str, Any]] | None = None
    reason: str | None = None

    def add(self, piece: dict[str, Any], scored: list[dict[str, Any]] | None) -> None:
        if (count := made_tokens(piece, scored)) is not None:
            self.made = (self.made or 0) + count
        self.last = scored or self.last
        self.reason = piece.get("finish_reason") or self.reason


class OpenAIServing:
    """The /v1 completions of the service, each answered by the version `draw` gives, on Triton; the tokenizer of
    `tokenizer_dir` counts usage (None: none counted)."""

    def __init__(
        self,
        triton: Replicas,
        service: str,
        context_tokens: int,
        default_max_tokens: int,
        tokenizer_dir: Path | None = None,
        apply_chat_template=True,
        shadow: Shadow | None = None,
        capture: Capture | None = None,
        draw: Callable[[], Version] | None = None,
        metrics: GatewayMetrics | None = None,
        table: Callable[[], RouteTable] | None = None,
        engine: Engine = "python",
        version_pinning: bool = False,
        pools: Pools | None = None,
    ):
        self.triton, self.service = triton, service
        self.pools = pools or Pools()
        self.context_tokens, self.default_max_tokens = context_tokens, default_max_tokens
        self.apply_chat_template, self.shadow = apply_chat_template, shadow
        self.tokenizer: Any = None
        if tokenizer_dir is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.capture, self.metrics = capture, metrics or GatewayMetrics()
        self.draw = draw or (lambda: Version(service, service))
        self.table = table or (lambda: RouteTable(service))
        self.engine = engine  # serve.backend: which request fields are honoured (openai_fields.py)
        self.version_pinning = version_pinning  # serve.version_pinning: a request may name a live version
        self.tokenizer_lock = threading.Lock()
        self.tool_template = TemplateProbe(self.tokenizer, apply_chat_template, self.tokenizer_lock)

    def check_model(self, model: str | None) -> Version | None:
        """The version a request for `model` pins: None for the service (the route table draws the version), or a
        live version of the table where serve.version_pinning allows it. Only the table's versions, each with the
        model and adapter the gateway gave it: a request never names a Triton model or an adapter."""
        if model in (None, self.service):
            return None
        version = self.table().version(model)
        if version is None:
            raise RequestError(404, f"model {model!r} is not served here; GET /v1/models lists it", "model")
        if not self.version_pinning:
            message = f"model {model!r} is a version of {self.service!r}; pinning a version is off here "
            raise RequestError(400, message + "(serve.version_pinning): ask for the service", "model")
        return version

    def models(self) -> dict[str, Any]:
        """GET /v1/models: the service, then its live versions as the route table has them (a request may name one
        where serve.version_pinning allows it)."""
        model = {"id": self.service, "object": "model", "created": 0, "owned_by": "llmops"}
        versions = [{**model, "id": v.name, "parent": self.service} for v in self.table().versions()]
        return {"object": "list", "data": [model, *versions]}

    def named(self, pinned: Version | None) -> str:
        """The model an answer names: the version a request pinned, or the service."""
        return pinned.name if pinned is not None else self.service

    def max_tokens(self, value: int | None, name: str) -> int:
        return bounded_max_tokens(value, name, self.context_tokens, self.default_max_tokens)

    async def chat(self, request: ChatCompletionRequest) -> Response:
        pinned = self.check_model(request.model)
        check_fields("chat", request.sent(), self.engine)
        tools = ToolCalling.of(request, self.tool_template.renders_tools() if request.tools else None)
        *earlier, question = request.messages
        history = [m.model_dump() for m in earlier]
        if request.max_completion_tokens is not None:
            max_tokens = self.max_tokens(request.max_completion_tokens, "max_completion_tokens")
        else:
            max_tokens = self.max_tokens(request.max_tokens, "max_tokens")
        inputs = GenerateInputs(
            text_input=question.content,
            chat_history=json.dumps(history, ensure_ascii=False) if history else None,
            **(sampling(request, max_tokens) | (tools.inputs() if tools else {})),
        )
        return await self.complete(
            inputs, request.stop, bool(request.stream), Reply(self.named(pinned), chat=True, tools=tools), pinned
        )

    async def completion(self, request: CompletionRequest) -> Response:
        pinned = self.check_model(request.model)
        check_fields("completions", request.sent(), self.engine)
        max_tokens = self.max_tokens(request.max_tokens, "max_tokens")
        # raw text, as OpenAI's and vLLM's completions: harnesses score a prompt's own tokens (echo)
        inputs = GenerateInputs(
            text_input=request.prompt,
            apply_chat_template=False,
            prompt_logprobs=request.logprobs if request.echo else None,
            **sampling(request, max_tokens),
        )
        reply = Reply(self.named(pinned), chat=False, echo=request.prompt if request.echo else None)
        return await self.complete(inputs, request.stop, bool(request.stream), reply, pinned)

    async def complete(
        self, inputs: GenerateInputs, stop: list[str], stream: bool, reply: Reply, pinned: Version | None = None
    ) -> Response:
        version = pinned or self.draw()
        started = time.perf_counter()
        reserve_tokens(inputs.max_tokens)
        if not stream:
            try:
                outputs = await self.triton.generate_outputs(version, inputs.payload())
            except RequestError as error:
                self.metrics.observe(version.name, error.status, time.perf_counter() - started)
                raise
            self.metrics.observe(version.name, 200, time.perf_counter() - started)
            text, stopped = cut_at_stop(str(outputs["text_output"]), stop)
            self.copy_to_shadow(inputs, text, stop, started, reply)
            tokens = scored_tokens(outputs, inputs)
            usage = await self.usage(inputs, text, made_tokens(outputs, tokens))
            current().tokens = usage.total_tokens or inputs.max_tokens  # uncounted (no tokenizer): the budget
            ended = stopped or ended_on_its_own(tokens)
            finish = self.finish_reason(ended, usage, inputs, outputs.get("finish_reason"))
            self.keep_exchange(inputs, text, reply, usage, finish, started)
            whole = reply.whole(text, finish, usage, tokens, scored_prompt(outputs, inputs))
            return JSONResponse(whole, headers=answered_by(version.name))
        pieces = self.triton.generate_stream_outputs(version, inputs.payload())
        try:
            first = await anext(pieces, None)  # errors before the first token still get a status code
        except RequestError as error:
            self.metrics.observe(version.name, error.status, time.perf_counter() - started)
            raise
        self.metrics.first_token(version.name, time.perf_counter() - started)
        events = self.events(pieces, first, stop, reply, inputs, started, version)
        return StreamingResponse(events, media_type="text/event-stream", headers=answered_by(version.name))

    def copy_to_shadow(
        self, inputs: GenerateInputs, answer: str, stop: list[str], started: float, reply: Reply
    ) -> None:
        """A copy for the shadowed version of an answer the routes gave (a pinned version's answer is no champion's)."""
        if self.shadow is not None and reply.model == self.service:
            self.shadow.copy(inputs.payload(), answer, stop, time.perf_counter() - started)

    async def events(
        self,
        pieces: AsyncGenerator[dict[str, Any], None],
        first: dict[str, Any] | None,
        stop: list[str],
        reply: Reply,
        inputs: GenerateInputs,
        started: float,
        version: Version,
    ) -> AsyncIterator[bytes]:
        """The completion's server-sent events; a failure after the first piece ends them with an error event."""
        if reply.chat:
            yield reply.chunk({"role": "assistant", "content": ""})
        if reply.echo is not None:  # the prompt first, with its scored tokens (which ride on the first piece)
            yield reply.chunk({"content": reply.echo}, tokens=scored_prompt(first or {}, inputs))
        scanner, tally = StopScanner(stop), Tally()
        try:
            piece = first
            while piece is not None:
                current().produced += 1  # charged if the stream ends before its usage is counted
                delta = scanner.feed(str(piece.get("text_output", "")))
                tokens = scored_tokens(piece, inputs)
                tally.add(piece, tokens)
                if delta or tokens:
                    for event in reply.text_events(delta, tokens):
                        yield event
                if scanner.stopped:
                    break
                piece = await anext(pieces, None)
        except RequestError as error:
            self.metrics.observe(version.name, error.status, time.perf_counter() - started)
            failure = ErrorResponse(error=ErrorInfo(message=error.message, type="server_error"))
            yield f"data: {failure.model_dump_json()}\n\n".encode()
            return
        finally:
            await pieces.aclose()
        self.metrics.observe(version.name, 200, time.perf_counter() - started, streamed=True)
        for event in reply.text_events(scanner.flush(), last=True):
            yield event
        self.copy_to_shadow(inputs, scanner.text, stop, started, reply)
        usage = await self.usage(inputs, scanner.text, tally.made)
        current().tokens = usage.total_tokens or inputs.max_tokens
        finish = self.finish_reason(scanner.stopped or ended_on_its_own(tally.last), usage, inputs, tally.reason)
        self.keep_exchange(inputs, scanner.text, reply, usage, finish, started)
        if reply.tools is not None and reply.calls is not None:
            finish = reply.tools.finish_reason(finish, reply.calls.called)
        yield reply.chunk(None, finish, usage)
        yield DONE

    def keep_exchange(
        self, inputs: GenerateInputs, answer: str, reply: Reply, usage: UsageInfo, finish: str, started: float
    ) -> None:
        """The exchange, for capture (serve.capture), unless capture is off or the client opted out. Not one with tools:
        a harvest makes training conversations of text answers, with no tools in their prompts."""
        if self.capture is None or reply.tools is not None:
            return
        request = current()
        if not request.capture:
            self.capture.opted_out()
            return
        self.capture.exchange(
            {
                "id": reply.id,
                "request_id": request.id,
                "at": time.time(),
                "client": request.client,
                "api": "chat" if reply.chat else "text",
                "routes": self.table().describe(),
                "messages": conversation(inputs),
                "answer": answer,
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "latency_s": round(time.perf_counter() - started, 6),
                "finish_reason": finish,
            }
        )

    @staticmethod
    def finish_reason(stopped: bool, usage: UsageInfo, inputs: GenerateInputs, engines: str | None = None) -> str:
        """ "stop" where the gateway cut the answer at a stop sequence, else the engine's own reason (each engine here
        sends it); without one, "length" where the answer used its whole token budget (ignore_eos: always)."""
        if stopped:
            return "stop"
        if engines in ("stop", "length"):
            return engines
        forced = inputs.min_length == inputs.max_tokens  # re-encoding the text may count fewer tokens than were made
        return "length" if forced or usage.completion_tokens >= inputs.max_tokens else "stop"

    async def usage(self, inputs: GenerateInputs, answer: str, made: int | None = None) -> UsageInfo:
        """Token counts, in a worker thread: a long chat's tokenization would hold every other client's
        request on the event loop meanwhile. One at a time: a fast tokenizer used from two threads at once
        can fail with "Already borrowed". `made`: the answer's tokens as the engine counted them (it counts each
        for logprobs), which re-encoding the text can miss (a token of half a character decodes to U+FFFD)."""
        if self.tokenizer is None:
            usage = UsageInfo(prompt_tokens=0, completion_tokens=0, total_tokens=0)
        else:
            usage = await self.pools.answer(self.count_tokens, inputs, answer)
        if made is None:
            return usage
        return UsageInfo(
            prompt_tokens=usage.prompt_tokens, completion_tokens=made, total_tokens=usage.prompt_tokens + made
        )

    def count_tokens(self, inputs: GenerateInputs, answer: str) -> UsageInfo:
        history, tools = json.loads(inputs.chat_history or "[]"), json.loads(inputs.tools or "null")
        templated = self.apply_chat_template and inputs.apply_chat_template is not False
        with self.tokenizer_lock:
            prompt = encode_prompt(self.tokenizer, inputs.text_input, history, templated, tools)
            prompt_tokens = len(prompt)
            completion_tokens = len(self.tokenizer.encode(answer, add_special_tokens=False)) if answer else 0
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
