# quantize
python -m tasks.runners.modelopt_quantize --model_dir /work/merged --calibration /work/calibration.jsonl --output_dir /work/checkpoint --qformat int4_awq --dtype bfloat16 --awq_block_size 128
# build_engine
python -m tasks.runners.tensorrt_llm_check --model_dir /work/checkpoint --llm_args /work/llm_args.json --questions /work/q.jsonl --report /work/report.json --max_new_tokens 64
