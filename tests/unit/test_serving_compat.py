"""A merged model folder, saved by our transformers 5.6, reads the same under the serving images'
transformers 4.x (.venv-compat, `make setup-compat`): RoPE base, tokenizer class, special tokens, stop ids
and chat template, compared with the train/serve contract computed under 5.6."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from tasks.base_model import build_tiny_qwen2
from tasks.merge import merge_adapter
from tasks.platform.config import TinyModel
from tasks.quality.contract import differences, read_contract
from tasks.quality.models import load_model, load_tokenizer
from tasks.serving.hf_compat import config_for_transformers4

ROOT = Path(__file__).resolve().parents[2]
COMPAT_PYTHON = ROOT / ".venv-compat" / "bin" / "python"
PINNED = next(
    line.split("==")[1].strip()
    for line in (ROOT / "infra/constraints-compat.txt").read_text().splitlines()
    if line.startswith("transformers==")
)
QWEN2_ROPE_THETA = 1_000_000.0  # Qwen2's bases: not the 10000 that transformers 4.x falls back to
CONVERSATIONS = [
    [{"role": "user", "content": f"opposite of {a}?"}, {"role": "assistant", "content": b}]
    for a, b in [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow")]
]


def read_with_transformers4(folder: Path) -> dict:
    if not COMPAT_PYTHON.is_file():
        pytest.skip(f"{COMPAT_PYTHON.parent.parent.name} missing: run `make setup-compat`")
    done = subprocess.run(
        [str(COMPAT_PYTHON), str(ROOT / "tests/serving_compat_probe.py"), str(folder)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, f"transformers {PINNED} could not load {folder}:\n{done.stderr[-3000:]}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["transformers"] == PINNED
    return found


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """A merged folder made as the merge stage makes it, from a base with Qwen2's RoPE base."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("compat")
    texts = [" ".join(m["content"] for m in c) for c in CONVERSATIONS] * 8
    build_tiny_qwen2(texts, TinyModel(vocab_size=300, pretrain_steps=5), root / "base")
    config_path = root / "base" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"]["rope_theta"] = QWEN2_ROPE_THETA
    config_path.write_text(json.dumps({k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}))
    torch.manual_seed(0)
    adapter = get_peft_model(load_model(root / "base"), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    adapter.save_pretrained(root / "adapter")
    assert merge_adapter(root / "base", root / "adapter", root / "merged", CONVERSATIONS) < 1e-4
    return root / "merged"


def test_the_serving_images_transformers_reads_the_merged_folder_as_we_do(merged):
    from transformers import AutoConfig

    served = read_with_transformers4(merged)
    ours = AutoConfig.from_pretrained(merged).rope_parameters
    assert ours["rope_theta"] == QWEN2_ROPE_THETA
    assert (served["rope_theta"], served["rope_scaling"]) == (ours["rope_theta"], None)
    # transformers 5's TokenizersBackend is 4.x's PreTrainedTokenizerFast: tokenizer.json, no family defaults
    assert (served["tokenizer_class"], served["is_fast"]) == ("PreTrainedTokenizerFast", True)
    assert served["chat_template"] == load_tokenizer(merged).chat_template
    contract = read_contract(merged)
    assert differences(contract, type(contract)(**served["contract"])) == []
    assert served["contract"] == contract.as_dict()  # bos/eos/pad, special tokens, stop ids, prompt ids
    assert json.loads((merged / "special_tokens_map.json").read_text()) == {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>"],
    }


def test_a_scaled_rope_reads_the_same_under_both(tmp_path):
    """Llama 3's RoPE (the llama3-8b profile): 5.6 keeps it all in rope_parameters; 4.x reads rope_theta
    and the scaling keys in rope_scaling. Both must see the same numbers."""
    from transformers import AutoConfig, LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    saved = LlamaConfig(hidden_size=64, num_attention_heads=2, rope_parameters=dict(rope)).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config_for_transformers4(saved)))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == LlamaConfig(**saved).rope_parameters
    served = read_with_transformers4(tmp_path)
    assert served["rope_theta"] == 500000.0
    assert served["rope_scaling"] == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_the_rewrite_is_idempotent_and_keeps_what_5x_reads(merged):
    from tasks.serving.hf_compat import make_loadable_by_transformers4

    before = {p.name: p.read_bytes() for p in merged.iterdir() if p.suffix == ".json"}
    assert make_loadable_by_transformers4(merged) == []
    assert {p.name: p.read_bytes() for p in merged.iterdir() if p.suffix == ".json"} == before
    saved = json.loads((merged / "config.json").read_text())
    assert saved["rope_parameters"] == {"rope_theta": QWEN2_ROPE_THETA, "rope_type": "default"}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "config.json",
            {"layer_types": ["full_attention", "sliding_attention"], "rope_parameters": {"full_attention": {}}},
            "config.json: per-layer rope_parameters",
        ),
        ("tokenizer_config.json", {"tokenizer_class": "SentencePieceBackend"}, "tokenizer_class SentencePieceBackend"),
        ("tokenizer_config.json", "{not json", "tokenizer_config.json: not readable JSON"),
    ],
)
def test_what_transformers4_cannot_read_is_named(tmp_path, name, content, message):
    from tasks.platform.errors import BadInput
    from tasks.serving.hf_compat import make_loadable_by_transformers4

    (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(BadInput, match=message):
        make_loadable_by_transformers4(tmp_path)
