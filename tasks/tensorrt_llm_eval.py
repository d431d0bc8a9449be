"""Answer eval questions with a built TensorRT-LLM engine (GPU only; started by tasks/engine.py).

    python -m tasks.tensorrt_llm_eval --engine_dir E --tokenizer_dir T --questions q.jsonl \
        --answers out.jsonl --max_new_tokens 64        (under mpirun -n TP for a tensor-parallel engine)

Uses TensorRT-LLM's documented Python runtime, `tensorrt_llm.runtime.ModelRunner`.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("--engine_dir", "--tokenizer_dir", "--questions", "--answers"):
        parser.add_argument(name, required=True)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=16)
    args = parser.parse_args()

    import tensorrt_llm
    import torch
    from tensorrt_llm.runtime import ModelRunner
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runner = ModelRunner.from_dir(engine_dir=args.engine_dir, rank=tensorrt_llm.mpi_rank())
    with open(args.questions) as questions:
        prompts = [json.loads(line)["input_ids"] for line in questions]  # chat-templated by the caller
    answers = []
    for start in range(0, len(prompts), args.batch_size):
        batch = [torch.tensor(ids, dtype=torch.int32) for ids in prompts[start : start + args.batch_size]]
        with torch.no_grad():
            outputs = runner.generate(
                batch,
                max_new_tokens=args.max_new_tokens,
                end_id=tokenizer.eos_token_id,
                pad_id=pad_id,
                temperature=1.0,
                top_k=1,
                return_dict=True,
            )
        torch.cuda.synchronize()
        for i, ids in enumerate(batch):
            length = int(outputs["sequence_lengths"][i][0])
            new_tokens = outputs["output_ids"][i][0][len(ids) : length].tolist()
            answers.append(str(tokenizer.decode(new_tokens, skip_special_tokens=True)).strip())
    if tensorrt_llm.mpi_rank() == 0:
        with open(args.answers, "w") as sink:
            for answer in answers:
                sink.write(json.dumps({"answer": answer}) + "\n")


if __name__ == "__main__":
    main()
