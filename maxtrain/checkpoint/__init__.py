"""Orbax checkpoints (save, verify, trust, retention) and HuggingFace safetensors io."""
