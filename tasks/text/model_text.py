"""The text helpers every served Triton model runs: request inputs, the chat history, the prompt's token ids,
the streamed deltas. Defined once here and copied next to each rendered model's model.py
(tasks/serving/repository.py:render_model), so the served models encode exactly as training does
(tasks/quality/chat.py re-exports encode_prompt and stream_delta from here).

Standard library only, and no project import: the copy runs inside Triton's Python-backend stub, whose
sys.path has the model's version folder (where the copy lies) but not this project, in NGC images too.
"""

from __future__ import annotations

import json
from typing import Any

# The file name of the copy in a rendered model's version folder; model.py imports it by this name. Distinct
# from any installed package: the stub appends the version folder to sys.path, after site-packages.
FILE_NAME = "model_text.py"


def input_value(request: Any, name: str, default: Any) -> Any:
    """The value of a request's scalar input `name` (a str for a BYTES input), or `default` when it was not sent.
    As pb_utils.get_input_tensor_by_name, through the request's own inputs()."""
    tensor = next((t for t in request.inputs() if t.name() == name), None)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def chat_history(text: str) -> list[dict[str, str]]:
    """The optional `chat_history` input: a JSON list of earlier {role, content} messages (a system prompt among them)."""
    if not text:
        return []
    history = json.loads(text)
    if not isinstance(history, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in history):
        raise ValueError("chat_history must be a JSON list of {role, content} messages")
    return history


def chat_template_on(request: Any, model_default: bool) -> bool:
    """Whether a request's prompt goes through the chat template: the model's setting (serve.apply_chat_template),
    unless the request's optional `apply_chat_template` input turns it off (the gateway's /v1/completions, whose
    prompt is raw text as in OpenAI's and vLLM's completions)."""
    return model_default and bool(input_value(request, "apply_chat_template", True))


def tool_definitions(text: str) -> list[dict[str, Any]] | None:
    """The optional `tools` input: a JSON list of OpenAI tool definitions ({type, function: {name, ...}}), which the
    chat template renders into the prompt; None where none was sent."""
    if not text:
        return None
    tools = json.loads(text)
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"] for t in tools
    ):
        raise ValueError("tools must be a JSON list of {type, function: {name, ...}} tool definitions")
    return tools


def encode_prompt(
    tokenizer: Any, text: str, history: list, apply_chat_template: bool, tools: list | None = None
) -> list[int]:
    """Token ids of a prompt: `history` (earlier messages, a system prompt among them) then the user's `text`,
    through the tokenizer's chat template with the assistant's generation prompt (and `tools`, OpenAI tool
    definitions, where the template renders them); or `text` alone, raw."""
    if not apply_chat_template:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": text}], tools=tools, add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def scored_token(
    tokenizer: Any, byte_of: dict[str, int], special: frozenset[int], token_id: int, logprob: float
) -> dict[str, Any]:
    """One answer token with its log probability, as OpenAI's chat logprobs spell it: {token, logprob, bytes}.
    `byte_of`: GPT-2's byte-level alphabet (transformers' bytes_to_unicode, inverted), in which a byte-level BPE
    token (Qwen2's) spells each of its bytes, so a token of half a character gets its own bytes, not U+FFFD's;
    another tokenizer's token gets its text's UTF-8. A `special` token is "" with no bytes, as the answer's text
    (decoded without special tokens) has it."""
    text = tokenizer.decode([token_id], skip_special_tokens=True)
    spelled = tokenizer.convert_ids_to_tokens(token_id)
    if token_id in special:
        raw = []
    elif isinstance(spelled, str) and spelled and all(char in byte_of for char in spelled):
        raw = [byte_of[char] for char in spelled]
    else:
        raw = list(text.encode("utf-8"))
    return {"token": text, "logprob": float(logprob), "bytes": raw}


def unscored_token(tokenizer: Any, byte_of: dict[str, int], special: frozenset[int], token_id: int) -> dict[str, Any]:
    """The prompt's first token as OpenAI's echoed completions logprobs have it: no log probability (nothing comes
    before it), no alternatives."""
    return {**scored_token(tokenizer, byte_of, special, token_id, 0.0), "logprob": None, "top_logprobs": None}


def stream_delta(text: str, sent: str, final: bool) -> tuple[str, str]:
    """What to stream next: the decoded answer so far is `text`, the client has `sent`. Decoding the whole
    answer each step (not token by token) keeps leading spaces and merges; a trailing U+FFFD is the first
    bytes of a character whose other bytes are still to come (a Chinese character split over byte-level
    tokens), so it is held back until the character is whole or the answer ends. Returns (delta, new sent)."""
    if not final:
        text = text.rstrip("\ufffd")
    if not text.startswith(sent):  # the decoder revised what was sent (rare): never send a wrong delta
        return "", sent
    return text[len(sent) :], text
