"""What a completion sends: the whole answer or its server-sent events, in chat's or text completions' shape, with
logprobs as each API spells them, an echoed prompt before the answer (completions' echo), and the tool calls read
from the answer's text (tool_calls.py)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tasks.runtime.gateway.protocol import (
    AssistantMessage,
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunkChoice,
    CompletionResponse,
    StreamChunk,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
)
from tasks.runtime.gateway.tool_calls import CallReader, Delta, ToolCalling

# Every answer names the version that produced it (`<service>-v<N>`), so a client, a canary check or a chaos soak can
# tell which version of the service answered without asking the route table.
VERSION_HEADER = "x-llmops-version"


def answered_by(version: str) -> dict[str, str]:
    """The response headers of an answer `version` gave."""
    return {VERSION_HEADER: version}


def ended_on_its_own(tokens: list[dict[str, Any]] | None) -> bool:
    """Whether scored answer tokens end with the end of sequence (a special token: no text, no bytes), which the
    engines score and count as a made token, as vLLM's server does: the answer stopped, whatever its length."""
    return tokens is not None and len(tokens) > 0 and tokens[-1]["token"] == "" and not tokens[-1]["bytes"]


@dataclass
class Reply:
    """The completion being answered: its id, its kind (chat or text) and the shapes that kind sends; with `tools`,
    the tool calls read from its text (tool_calls.py)."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    text_offset: int = 0  # completions' logprobs: where the next streamed token starts in the answer
    echo: str | None = None  # completions' echo: the prompt, sent before the answer
    tools: ToolCalling | None = None
    calls: CallReader | None = None

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.calls = self.tools.reader() if self.tools else None

    def logprobs(self, tokens: list[dict[str, Any]] | None) -> dict[str, Any] | None:
        """The `logprobs` of a choice in this kind's shape, for the answer tokens the engine scored (None: not asked)."""
        if tokens is None:
            return None
        if self.chat:
            return chat_logprobs(tokens)
        shaped = completion_logprobs(tokens, self.text_offset)
        self.text_offset += sum(len(t["token"]) for t in tokens)
        return shaped

    def whole(
        self,
        text: str,
        finish: str,
        usage: UsageInfo,
        tokens: list[dict[str, Any]] | None = None,
        prompt_tokens: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The whole completion; an echoed prompt (and its scored tokens) before the answer."""
        response: ChatCompletionResponse | CompletionResponse
        if self.echo is not None:
            text = self.echo + text
            tokens = None if tokens is None else [*(prompt_tokens or []), *tokens]
        if self.chat:
            message = AssistantMessage(content=text)
            choice = ChatCompletionChoice(message=message, finish_reason=finish, logprobs=self.logprobs(tokens))
            response = ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
            )
            if self.tools is not None:
                return response.model_dump() | {"choices": [choice.model_dump() | self.tools.choice_of(text, finish)]}
        else:
            text_choice = CompletionChoice(text=text, finish_reason=finish, logprobs=self.logprobs(tokens))
            response = CompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[text_choice], usage=usage
            )
        return response.model_dump()

    def chunk(
        self,
        delta: Delta | None,
        finish: str | None = None,
        usage: UsageInfo | None = None,
        tokens: list[dict[str, Any]] | None = None,
    ) -> bytes:
        """One event; `delta` None is the last one's empty delta, which carries the finish_reason; `tokens` the
        scored answer tokens the event's text came from (logprobs), per chunk as OpenAI streams them."""
        choices: list[ChatChunkChoice] | list[CompletionChunkChoice]
        logprobs = self.logprobs(tokens)
        if self.chat:
            choices = [ChatChunkChoice(delta=delta or {}, finish_reason=finish, logprobs=logprobs)]
        else:
            text = (delta or {}).get("content", "")
            choices = [CompletionChunkChoice(text=text, finish_reason=finish, logprobs=logprobs)]
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return StreamChunk(
            id=self.id, object=kind, created=self.created, model=self.model, choices=choices, usage=usage
        ).event()

    def text_events(self, text: str, tokens: list[dict[str, Any]] | None = None, last: bool = False) -> list[bytes]:
        """The events of a decoded piece of the answer (the `last`: what is left when it has ended), the tool calls
        read from it where tools were sent; its scored tokens ride on the first (an empty delta where the text is held
        back, as a tool call's beginning is)."""
        if self.calls is None:
            deltas: list[Delta] = [{"content": text}] if text or not last else []
        else:
            deltas = [*self.calls.feed(text), *(self.calls.close() if last else [])]
        if tokens and not deltas:
            deltas = [{}]
        return [self.chunk(delta, tokens=tokens if n == 0 else None) for n, delta in enumerate(deltas)]
