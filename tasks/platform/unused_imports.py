"""Libraries that transformers, peft and accelerate import whenever they are installed, left out of a runner that
never calls them.

A None entry in sys.modules makes importlib.util.find_spec, and so each library's availability check, find the
library absent, and an import of it fail. What each costs and who imports it, at the pins of pyproject.toml:

- scikit-learn: transformers, for assisted generation's confidence threshold (generation/candidate_generator.py:27-28
  at 5.6), with pandas, scipy and narwhals: 1.45 s of the 10.4 s of imports before LlamaFactory's first line.
- accelerate's boto3: accelerate imports boto3 for its SageMaker config command (commands/config/sagemaker.py:34 at
  1.11.0, through accelerate.hooks, which transformers' auto classes import): 1.55 s of a training's imports.
- accelerate itself, where nothing loads a model with a device_map (its big-model hooks are all transformers takes
  from it then).

`llmops` and the flows a worker runs leave scikit-learn out too (PIPELINE): their stages import transformers (the base
model's tokenizer, evaluate, merge, quantize, the gateway's tokenizer) and nothing of theirs calls scikit-learn; scipy
they keep (the quality gate's statistics), and accelerate (peft's merge) and boto3 (the S3 store).
"""

import sys

SCIKIT_LEARN = "sklearn"
BOTO3 = "boto3"
ACCELERATE = "accelerate"
PIPELINE = [SCIKIT_LEARN]  # what the `llmops` command and the release flow leave out


def leave_out(libraries: list[str]) -> None:
    """Make `libraries` absent for this process; a child interpreter (torchrun's workers) imports them as before."""
    for name in libraries:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]  # None: absent, by the import system's rules
