# quantize
python /app/tensorrt_llm/examples/quantization/quantize.py --model_dir /work/merged --dtype float16 --qformat int8_wo --output_dir /work/checkpoint --tp_size 1 --pp_size 1
# build_engine
trtllm-build --checkpoint_dir /work/checkpoint --output_dir /work/engine --max_batch_size 64 --max_input_len 1536 --max_seq_len 2048 --max_num_tokens 8192 --max_beam_width 1 --gemm_plugin float16 --gpt_attention_plugin float16 --kv_cache_type paged --remove_input_padding enable --context_fmha enable --use_paged_context_fmha enable --use_fp8_context_fmha disable --multiple_profiles enable --workers 1
# engine eval
python -m tasks.runners.tensorrt_llm_eval --engine_dir /work/engine --tokenizer_dir /work/tokenizer --questions /work/q.jsonl --answers /work/a.jsonl --max_new_tokens 64
