"""Load a checkpoint on the runtime that will serve it and answer the eval questions (GPU only; started
by tasks/build_engine.py inside the TensorRT-LLM image).

    python -m tasks.runners.tensorrt_llm_check --model_dir M --llm_args args.json --questions q.jsonl \
        --max_new_tokens 64 --report report.json

`LLM(model=M, **llm_args)` with the arguments Triton's llmapi model.yaml carries (tasks/serving/llm_api.py),
then one `LLM.generate` over every question: a list of TokensPrompt dicts ({"prompt_token_ids": [...]},
tensorrt_llm/inputs/data.py; the caller encoded them with the chat template, as evaluate did) returns one
RequestOutput per prompt, whose `outputs[0].text` is the answer alone (SamplingParams.exclude_input_from_output
defaults to True) without special tokens (skip_special_tokens=True). The LLM API starts its own MPI workers
for tensor parallelism, so this runs as one plain process (hence the __main__ guard). `LLM.generate` with a
list returns a list in the same order, and `LLM.shutdown()` stops the executor and MPI session
(tensorrt_llm/llmapi/llm.py `generate`, `shutdown`).

The report carries what was really loaded: `tensorrt_llm.__version__` as imported (not the version a
profile or a package's metadata declares) and the GPU's compute capability. This module imports nothing
of the orchestrator.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("--model_dir", "--llm_args", "--questions", "--report"):
        parser.add_argument(name, required=True)
    parser.add_argument("--max_new_tokens", type=int, required=True)
    return parser.parse_args(argv)


def sampling_kwargs(max_new_tokens: int) -> dict:
    """Greedy decoding: SamplingParams(top_k=1) (tensorrt_llm/sampling_params.py `_greedy_decoding`: no beam
    search, top_k None or 1, top_p None or 0); max_tokens counts generated tokens only (default 32)."""
    return {"max_tokens": max_new_tokens, "top_k": 1}


def prompts(questions: Path) -> list[dict]:
    return [{"prompt_token_ids": json.loads(line)["input_ids"]} for line in questions.read_text().splitlines()]


def answers(outputs) -> list[str]:
    """RequestOutput.outputs[0].text of each prompt, in the order given."""
    return [str(output.outputs[0].text).strip() for output in outputs]


def gpu_arch(torch) -> str:
    """e.g. 'sm90 NVIDIA H100 80GB HBM3': kernels and quantized formats depend on the architecture."""
    major, minor = torch.cuda.get_device_capability(0)
    return f"sm{major}{minor} {torch.cuda.get_device_name(0)}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import tensorrt_llm
    import torch
    from tensorrt_llm import LLM, SamplingParams

    llm_args = json.loads(Path(args.llm_args).read_text())
    started = time.monotonic()
    llm = LLM(model=args.model_dir, **llm_args)
    load_s = time.monotonic() - started
    try:
        outputs = llm.generate(prompts(Path(args.questions)), SamplingParams(**sampling_kwargs(args.max_new_tokens)))
    finally:
        llm.shutdown()
    report = {
        "tensorrt_llm": tensorrt_llm.__version__,
        "gpu_arch": gpu_arch(torch),
        "load_s": load_s,
        "answers": answers(outputs),
    }
    Path(args.report).write_text(json.dumps(report, ensure_ascii=False, indent=2))


if __name__ == "__main__":
    main()
