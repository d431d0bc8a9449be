"""The load tools the benchmark and tune_serving stages drive: genai-perf and AIPerf runs against a served version,
and the load levels they step through."""
