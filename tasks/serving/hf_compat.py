"""Make a Hugging Face model folder saved by transformers 5 load the same under the serving images' transformers 4.

We train and merge with transformers 5.6; the TensorRT-LLM image reads the folder with 4.x (TensorRT-LLM 1.2.1 in
nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3 requires transformers==4.57.3: its release's Requires-Dist,
infra/images/upstream/tensorrt_llm-1.2.1.requires.txt). The vLLM image reads it with transformers 5 (vLLM 0.27.1's
requirements/common.txt: `transformers >= 5.5.3`), which needs none of this and is not hurt by it.
What 5.x writes and 4.x misreads, and the 4.x spelling written next to it:

- config.json: 5.x keeps the RoPE base only in `rope_parameters` (transformers 5.6
  modeling_rope_utils.py, RotaryEmbeddingConfigMixin.standardize_rope_params); 4.57 reads the top-level
  `rope_theta` and `rope_scaling` (models/qwen2/configuration_qwen2.py and models/llama/
  configuration_llama.py, `__init__(rope_theta=10000.0, rope_scaling=None, ...)`), so without them it
  silently runs RoPE with base 10000. 5.x still reads both (RotaryEmbeddingConfigMixin.
  convert_rope_params_to_dict: `rope_scaling` first, then `rope_theta` from the config's keys).
- tokenizer_config.json: 5.x names its generic fast tokenizer `TokenizersBackend` (aliased as
  PreTrainedTokenizerFast, tokenization_utils_tokenizers.py), a class 4.x does not have; and it writes
  the extra special tokens as a list under `extra_special_tokens`, which 4.57 takes for a name -> token
  dict (tokenization_utils_base.py, `_set_model_specific_special_tokens` calls `.keys()`). 4.x's
  spelling is `additional_special_tokens`; 5.x converts it back on load (tokenization_utils_base.py,
  "V5: Convert deprecated additional_special_tokens to extra_special_tokens").
- special_tokens_map.json: 5.x no longer writes it; 4.x tokenizers (and older serving code) read it.

Only the JSON files change: the weights, tokenizer.json and chat_template.jinja are read alike by both.
"""

from __future__ import annotations

import json
from pathlib import Path

from tasks.platform.errors import BadInput

# transformers 5 generic classes -> their transformers 4 names (5.x aliases them to these names itself).
GENERIC_TOKENIZER_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast", "PythonBackend": "PreTrainedTokenizer"}
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# RoPE keys 4.x reads at the top level of config.json, not inside rope_scaling.
TOP_LEVEL_ROPE_KEYS = ("rope_theta", "partial_rotary_factor")


def config_for_transformers4(config: dict, where: str = "config.json") -> dict:
    """config.json with `rope_theta` (and `rope_scaling`, `partial_rotary_factor`) where 4.x reads them."""
    rope = config.get("rope_parameters")
    if not rope:
        return dict(config)
    layer_types = set(config.get("layer_types") or [])
    if layer_types and set(rope) <= layer_types:
        raise BadInput(f"{where}: per-layer rope_parameters ({sorted(rope)}) have no transformers 4.x spelling")
    compat = dict(config)
    for key in TOP_LEVEL_ROPE_KEYS:
        if key in rope:
            compat[key] = rope[key]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = {k: v for k, v in rope.items() if k not in TOP_LEVEL_ROPE_KEYS and k != "type"}
    compat["rope_scaling"] = None if rope_type == "default" else {**scaling, "rope_type": rope_type}
    return compat


def tokenizer_config_for_transformers4(tokenizer_config: dict, where: str = "tokenizer_config.json") -> dict:
    """tokenizer_config.json with a tokenizer class 4.x has and its `additional_special_tokens` list."""
    compat = dict(tokenizer_config)
    name = compat.get("tokenizer_class")
    if name in GENERIC_TOKENIZER_CLASSES:
        compat["tokenizer_class"] = GENERIC_TOKENIZER_CLASSES[name]
    elif isinstance(name, str) and name.endswith("Backend"):
        raise BadInput(f"{where}: tokenizer_class {name} has no transformers 4.x counterpart")
    extra = compat.get("extra_special_tokens")
    if isinstance(extra, list):
        del compat["extra_special_tokens"]
        compat["additional_special_tokens"] = extra
    return compat


def special_tokens_map(tokenizer_config: dict) -> dict:
    """special_tokens_map.json as 4.x wrote it, from a (4.x-spelled) tokenizer_config.json."""
    found = {key: tokenizer_config[key] for key in SPECIAL_TOKEN_KEYS if tokenizer_config.get(key) is not None}
    if tokenizer_config.get("additional_special_tokens"):
        found["additional_special_tokens"] = tokenizer_config["additional_special_tokens"]
    return found


def make_loadable_by_transformers4(folder: Path) -> list[str]:
    """Rewrite a saved model/tokenizer folder in place so transformers 4.x loads what 5.x does; return
    the files changed. Idempotent: a folder already in the 4.x spelling is left as it is."""
    changed = []
    config_path, tokenizer_path = folder / "config.json", folder / "tokenizer_config.json"
    if config_path.is_file():
        changed += _rewrite(config_path, config_for_transformers4(_read(config_path), str(config_path)))
    if tokenizer_path.is_file():
        tokenizer_config = tokenizer_config_for_transformers4(_read(tokenizer_path), str(tokenizer_path))
        changed += _rewrite(tokenizer_path, tokenizer_config)
        changed += _rewrite(folder / SPECIAL_TOKENS_MAP_FILE, special_tokens_map(tokenizer_config))
    return changed


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{path}: not readable JSON ({exc})") from None


def _rewrite(path: Path, content: dict) -> list[str]:
    text = json.dumps(content, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return []
    path.write_text(text, encoding="utf-8")
    return [path.name]
