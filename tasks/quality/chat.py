"""The one chat-prompt encoder: how a conversation becomes the prompt's token ids.

Evaluation, the merge probe, quantization and every serving model encode prompts with
`encode_prompt`. The Triton model folders (infra/triton/llm, infra/triton/tensorrtllm/preprocessing)
are self-contained, as Triton loads them, so they carry a copy of this function;
tests/unit/test_chat_encoding.py pins every copy to this one on the same conversations.
"""

from __future__ import annotations

from typing import TypedDict


class Message(TypedDict):
    role: str  # system, user or assistant
    content: str


# One conversation: an optional system message, then user/assistant turns ending with the assistant's answer.
Conversation = list[Message]


def encode_prompt(tokenizer, text, history, apply_chat_template):
    """Token ids of a prompt: `history` (earlier messages, a system prompt among them) then the user's `text`,
    through the tokenizer's chat template with the assistant's generation prompt; or `text` alone, raw."""
    if not apply_chat_template:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def stream_delta(text, sent, final):
    """What to stream next: the decoded answer so far is `text`, the client has `sent`. Decoding the whole
    answer each step (not token by token) keeps leading spaces and merges; a trailing U+FFFD is the first
    bytes of a character whose other bytes are still to come (a Chinese character split over byte-level
    tokens), so it is held back until the character is whole or the answer ends. Returns (delta, new sent)."""
    if not final:
        text = text.rstrip("\ufffd")
    if not text.startswith(sent):  # the decoder revised what was sent (rare): never send a wrong delta
        return "", sent
    return text[len(sent) :], text


def serving_request(conversation: Conversation) -> tuple[str, list[Message]]:
    """(text_input, chat_history) for a conversation that ends with the assistant's answer."""
    *history, question, _answer = conversation
    return question["content"], history


def prompt_ids(tokenizer, conversation: Conversation) -> list[int]:
    """The prompt of a conversation that ends with the assistant's answer, as training encoded it."""
    text, history = serving_request(conversation)
    return encode_prompt(tokenizer, text, history, True)


def answer_ids(tokenizer, conversation: Conversation) -> list[int]:
    """The answer's token ids and the closing EOS, as LlamaFactory's template encodes an assistant turn."""
    return tokenizer(conversation[-1]["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
