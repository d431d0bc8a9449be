"""The one chat-prompt encoder: how a conversation becomes the prompt's token ids.

Evaluation, the merge probe, quantization and every serving model encode prompts with
`encode_prompt`. It is defined in tasks/text/model_text.py, the module each rendered Triton model
folder carries a copy of (Triton loads a model folder on its own), and re-exported here with
`stream_delta`; tests/unit/test_chat_encoding.py checks every rendered model's copy against them.
"""

from __future__ import annotations

from typing import TypedDict

from tasks.text.model_text import encode_prompt, stream_delta

__all__ = [
    "Conversation",
    "Message",
    "answer_ids",
    "encode_prompt",
    "prompt_ids",
    "serving_request",
    "stream_delta",
]


class Message(TypedDict):
    role: str  # system, user or assistant
    content: str


# One conversation: an optional system message, then user/assistant turns ending with the assistant's answer.
Conversation = list[Message]


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
