"""The dense decoder: Llama, Mistral (with its sliding window, if any) and Qwen2 (q/k/v biases) in HF. Every
dense config is this family's unless a narrower one claims it (Qwen3: q/k norms)."""

from __future__ import annotations

from maxtrain.models import decoder_spec, hf
from maxtrain.runtime.errors import ConvertError
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register

_DEFAULTS = dict(zip(hf.SHAPE, (32000, 4096, 11008, 32, 32, None)))


def _hf_kind(m: Keys) -> str:  # q/k norms: models/qwen3.py claims those configs
    if m["sliding_window_size"]:
        if m["qkv_bias"]:
            raise ConvertError("qkv_bias=true with sliding_window_size: Mistral, the HF model with a window on "
                               "every layer, has no q/k/v biases (HF export needs qkv_bias=false)")
        return "mistral"
    return "qwen2" if m["qkv_bias"] else "llama"


def _sliding_window(config: dict) -> int | None:
    if config.get("model_type") == "qwen2":  # a window on some layers only: not expressed
        window = hf.layered_sliding_window(config)
        if window is not None:
            raise ConvertError(f"config.json: sliding_window={window} is not supported (Qwen2 slides on some layers "
                               f"only, from max_window_layers on)")
        return None
    return config.get("sliding_window")


HF = HFMapping(
    types={
        "llama": HFType("LlamaForCausalLM", "LlamaConfig", {"max_position_embeddings": 2048} | hf.COMMON | _DEFAULTS | {
            "head_dim": None, "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2},
            fresh={"attention_bias": False, "mlp_bias": False}),
        "mistral": HFType("MistralForCausalLM", "MistralConfig", {"max_position_embeddings": 131072} | hf.COMMON | dict(
            zip(hf.SHAPE, (32000, 4096, 14336, 32, 32, 8))) | {
            "head_dim": None, "sliding_window": 4096, "bos_token_id": 1, "eos_token_id": 2}),
        "qwen2": HFType("Qwen2ForCausalLM", "Qwen2Config", {"max_position_embeddings": 32768} | hf.COMMON | dict(
            zip(hf.SHAPE, (151936, 4096, 22016, 32, 32, 32))) | {
            "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
            "bos_token_id": None, "eos_token_id": None},
            fresh={"use_sliding_window": False, "sliding_window": None}),
    },
    keys=lambda config, kind: {"qkv_bias": kind == "qwen2", "use_qk_norm": False, "num_experts": 1},
    config=lambda m, kind, config: {},
    sliding_window=_sliding_window,
    windowed=True,  # Mistral's, on every layer
    expresses=("sliding_window_size",),
)

SPEC = register(ModelSpec(name="llama", matches=lambda m: m["num_experts"] == 1, hf_kind=_hf_kind, hf=HF,
                          **decoder_spec.spec_parts()))
