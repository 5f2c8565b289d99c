"""Text from a model: decoding with a KV cache (decode.py: prefill, then one position per step, batched),
the cache (kv_cache.py), sampling (sampling.py), and the full-rerun decoder kept as the tests' and the
benchmark's reference (reference.py). `python -m maxtrain.generate` and training's samples run decode.py."""
