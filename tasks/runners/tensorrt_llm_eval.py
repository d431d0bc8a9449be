"""Answer eval questions with a built TensorRT-LLM engine (GPU only; started by tasks/build_engine.py).

    python -m tasks.runners.tensorrt_llm_eval --engine_dir E --tokenizer_dir T --questions q.jsonl \
        --answers out.jsonl --max_new_tokens 64        (under mpirun -n TP for a tensor-parallel engine)

Runs as upstream's examples/run.py does: `ModelRunnerCpp` (the C++ executor the tensorrtllm backend
serves with; the Python `ModelRunner` is legacy) where the wheel has it, `ModelRunner` otherwise, and
`generate(..., output_sequence_lengths=True, return_dict=True)`. Upstream facts this relies on
(tensorrt_llm/runtime/model_runner_cpp.py, `generate` and `_fill_output`; model_runner.py `generate`
passes the same keywords through `sampling_config.update(**kwargs)`):
- `sequence_lengths` is in the returned dict only when `output_sequence_lengths=True` (without it the
  first batch raised KeyError), and counts the prompt plus the generated tokens;
- `output_ids` is (batch, beams, max_seq_len), starting with the prompt, padded with end_id;
- ranks other than 0 get `[]` back from ModelRunnerCpp: only rank 0 reads outputs and writes answers.
This module imports nothing of the orchestrator (Prefect, MLflow, LlamaFactory): it runs inside the
TensorRT-LLM image (tests/unit/test_stage_environments.py).
"""

from __future__ import annotations

import argparse
import json


def generate_kwargs(max_new_tokens: int, end_id: int, pad_id: int) -> dict:
    """Greedy decoding, as examples/run.py calls `runner.generate` (top_k=1, one beam)."""
    return {
        "max_new_tokens": max_new_tokens,
        "end_id": end_id,
        "pad_id": pad_id,
        "temperature": 1.0,
        "top_k": 1,
        "num_beams": 1,
        "output_sequence_lengths": True,
        "return_dict": True,
    }


def new_tokens(outputs: dict, index: int, prompt_length: int) -> list[int]:
    """The generated tokens of one request: after its prompt, up to its sequence length."""
    length = int(outputs["sequence_lengths"][index][0])
    return outputs["output_ids"][index][0][prompt_length:length].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("--engine_dir", "--tokenizer_dir", "--questions", "--answers"):
        parser.add_argument(name, required=True)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    args = parser.parse_args()

    import tensorrt_llm
    import torch
    from tensorrt_llm import runtime
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"tokenizer {args.tokenizer_dir}: no EOS token; answers could not stop")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with open(args.questions) as questions:
        prompts = [json.loads(line)["input_ids"] for line in questions]  # chat-templated by the caller
    rank = tensorrt_llm.mpi_rank()
    if hasattr(runtime, "ModelRunnerCpp"):
        runner = runtime.ModelRunnerCpp.from_dir(
            engine_dir=args.engine_dir,
            rank=rank,
            max_batch_size=args.batch_size,
            max_input_len=max(len(ids) for ids in prompts),
            max_output_len=args.max_new_tokens,
            max_beam_width=1,
        )
    else:
        runner = runtime.ModelRunner.from_dir(engine_dir=args.engine_dir, rank=rank)
    answers = []
    for start in range(0, len(prompts), args.batch_size):
        batch = [torch.tensor(ids, dtype=torch.int32) for ids in prompts[start : start + args.batch_size]]
        with torch.no_grad():
            outputs = runner.generate(batch, **generate_kwargs(args.max_new_tokens, tokenizer.eos_token_id, pad_id))
        torch.cuda.synchronize()
        if rank != 0:
            continue
        for i, ids in enumerate(batch):
            tokens = new_tokens(outputs, i, len(ids))
            answers.append(str(tokenizer.decode(tokens, skip_special_tokens=True)).strip())
    if rank == 0:
        with open(args.answers, "w") as sink:
            for answer in answers:
                sink.write(json.dumps({"answer": answer}) + "\n")


if __name__ == "__main__":
    main()
