# quantize
python /app/tensorrt_llm/examples/quantization/quantize.py --model_dir /work/merged --dtype bfloat16 --qformat int4_awq --output_dir /work/checkpoint --tp_size 2 --pp_size 1 --calib_dataset /work/calibration --calib_size 512 --calib_max_seq_length 512 --awq_block_size 128
# build_engine
trtllm-build --checkpoint_dir /work/checkpoint --output_dir /work/engine --max_batch_size 128 --max_input_len 1536 --max_seq_len 2048 --max_num_tokens 8192 --max_beam_width 1 --gemm_plugin auto --gpt_attention_plugin auto --kv_cache_type paged --remove_input_padding enable --context_fmha enable --use_paged_context_fmha enable --use_fp8_context_fmha disable --multiple_profiles enable --workers 2
# engine eval
mpirun -n 2 --allow-run-as-root python -m tasks.runners.tensorrt_llm_eval --engine_dir /work/engine --tokenizer_dir /work/tokenizer --questions /work/q.jsonl --answers /work/a.jsonl --max_new_tokens 64
