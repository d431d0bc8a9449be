"""The train/serve contract: how prompts are encoded and where generation stops, from training to serving.

The failure users of LlamaFactory report most after export (accuracy collapsing in serving)
comes from a chat template, special tokens or EOS that differ between training and serving.
The train stage records the contract of the tokenizer LlamaFactory trained with (its template
rendered into the saved tokenizer); merge, quantize/build_engine and the rendered serving config
are checked against it, and a difference fails the run (exit 3) naming what differs.

What is compared is behaviour, not text: the prompt token ids of fixed probe conversations
(English and Chinese, with and without a system prompt, multi-turn), the EOS/pad/BOS ids, the
special tokens' ids and the stop ids. Two template texts that render the same ids are the same
contract (LlamaFactory rewrites the template's Jinja text when it saves a tokenizer).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.platform.errors import CheckFailed
from tasks.quality.chat import Conversation, prompt_ids

CONTRACT_FILE = "contract.json"
PROBES: list[Conversation] = [
    [{"role": "user", "content": "What is the opposite of hot?"}, {"role": "assistant", "content": "cold"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Opposite of up?"},
        {"role": "assistant", "content": "down"},
    ],
    [{"role": "user", "content": "什么是市盈率？"}, {"role": "assistant", "content": "股价除以每股收益。"}],
    [
        {"role": "system", "content": "你是一名理财顾问。"},
        {"role": "user", "content": "请解释一下复利。"},
        {"role": "assistant", "content": "利滚利。"},
    ],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "债券呢？"},
        {"role": "assistant", "content": "借款凭证。"},
    ],
]


@dataclass(frozen=True)
class Contract:
    prompt_ids_sha256: str  # the probe conversations' prompt ids through the chat template
    eos_token_id: int | None
    pad_token_id: int | None
    bos_token_id: int | None
    special_token_ids: dict[str, int]
    stop_token_ids: list[int]
    chat_template_sha256: str  # recorded for reference; not compared (see the module doc)

    def as_dict(self) -> dict:
        return asdict(self)

    def tags(self) -> dict[str, str]:
        """Registry tags: the values a reader compares across versions."""
        return {
            "contract.prompt_ids_sha256": self.prompt_ids_sha256,
            "contract.eos_token_id": str(self.eos_token_id),
            "contract.pad_token_id": str(self.pad_token_id),
            "contract.stop_token_ids": json.dumps(self.stop_token_ids),
        }


def read_contract(tokenizer_dir: Path, generation_config_dir: Path | None = None) -> Contract:
    """The contract a tokenizer folder (and the generation_config.json next to the weights, if any) implies."""
    from tasks.quality.models import load_tokenizer

    return tokenizer_contract(load_tokenizer(tokenizer_dir), generation_config_dir or tokenizer_dir)


def tokenizer_contract(tokenizer, generation_config_dir: Path) -> Contract:
    """The contract of a loaded tokenizer (whichever transformers loaded it) and the generation_config.json
    in generation_config_dir, if any: tests/unit/test_serving_compat.py runs it under the serving images' 4.x."""
    encoded = [prompt_ids(tokenizer, conversation) for conversation in PROBES]
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    generation = generation_config_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        stops |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    template = (
        tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else json.dumps(tokenizer.chat_template)
    )
    return Contract(
        prompt_ids_sha256=hashlib.sha256(json.dumps(encoded).encode()).hexdigest(),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        special_token_ids={token: tokenizer.convert_tokens_to_ids(token) for token in tokenizer.all_special_tokens},
        stop_token_ids=sorted(stops),
        chat_template_sha256=hashlib.sha256((template or "").encode()).hexdigest(),
    )


def load_contract(folder: Path) -> Contract:
    return Contract(**json.loads((folder / CONTRACT_FILE).read_text()))


def write_contract(contract: Contract, folder: Path) -> None:
    (folder / CONTRACT_FILE).write_text(json.dumps(contract.as_dict(), indent=1, ensure_ascii=False))


def differences(expected: Contract, actual: Contract) -> list[str]:
    found = []
    if expected.prompt_ids_sha256 != actual.prompt_ids_sha256:
        found.append("chat template (the probe prompts encode to other token ids)")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "stop_token_ids"):
        if getattr(expected, name) != getattr(actual, name):
            found.append(f"{name} {getattr(actual, name)} (trained with {getattr(expected, name)})")
    if expected.special_token_ids != actual.special_token_ids:
        changed = sorted(set(expected.special_token_ids.items()) ^ set(actual.special_token_ids.items()))
        found.append(f"special tokens {dict(changed)}")
    return found


def require_same(expected: Contract, actual: Contract, where: str) -> None:
    """Fail (exit 3) naming what differs between the training contract and `where`."""
    found = differences(expected, actual)
    if found:
        raise CheckFailed(f"train/serve contract: {where} differs from training: {'; '.join(found)}")


def require_kept(trained_dir: Path, tokenizer_dir: Path, where: str, generation_config_dir: Path | None = None) -> None:
    """The contract training recorded next to `trained_dir`, kept by the tokenizer in `tokenizer_dir` (`where` it
    serves); nothing to check for a model registered before contracts were recorded."""
    if (trained_dir / CONTRACT_FILE).is_file():
        require_same(load_contract(trained_dir), read_contract(tokenizer_dir, generation_config_dir), where)
