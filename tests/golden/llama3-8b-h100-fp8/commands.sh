# quantize
python /app/tensorrt_llm/examples/quantization/quantize.py --model_dir /work/merged --dtype bfloat16 --qformat fp8 --output_dir /work/checkpoint --tp_size 1 --pp_size 1 --kv_cache_dtype fp8 --calib_dataset /work/calibration --calib_size 512 --calib_max_seq_length 1024
# build_engine
trtllm-build --checkpoint_dir /work/checkpoint --output_dir /work/engine --max_batch_size 256 --max_input_len 3072 --max_seq_len 4096 --max_num_tokens 16384 --max_beam_width 1 --gemm_plugin auto --gpt_attention_plugin auto --kv_cache_type paged --remove_input_padding enable --context_fmha enable --use_paged_context_fmha enable --use_fp8_context_fmha enable --multiple_profiles enable --workers 1
# engine eval
python -m tasks.runners.tensorrt_llm_eval --engine_dir /work/engine --tokenizer_dir /work/tokenizer --questions /work/q.jsonl --answers /work/a.jsonl --max_new_tokens 64
