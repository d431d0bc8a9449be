"""Run by tests/unit/test_serving_compat.py inside .venv-compat (the serving images' transformers 4.x, no
torch): loads a model folder's config and tokenizer as the serving runtime does and prints, as JSON, what
the test compares with transformers 5.6's reading of the same folder.

    .venv-compat/bin/python tests/serving_compat_probe.py MODEL_DIR     (with the repository on PYTHONPATH)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import transformers
from transformers import AutoConfig, AutoTokenizer

from tasks.quality.contract import tokenizer_contract


def main(folder: Path) -> dict:
    config = AutoConfig.from_pretrained(folder)
    found = {
        "transformers": transformers.__version__,
        "rope_theta": getattr(config, "rope_theta", None),
        "rope_scaling": getattr(config, "rope_scaling", None),
    }
    if (folder / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        found |= {
            "tokenizer_class": type(tokenizer).__name__,
            "is_fast": tokenizer.is_fast,
            "chat_template": tokenizer.chat_template,
            "contract": tokenizer_contract(tokenizer, folder).as_dict(),
        }
    return found


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
