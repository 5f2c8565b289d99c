"""DeepSeek-V3-style mixtures of experts on maxtrain's attention (the deepseek-v3-gqa preset): shared
experts, leading dense layers, sigmoid routing, the balancing bias, a routed scaling factor; and any
other MoE that neither Mixtral nor Qwen3-MoE expresses. No HF class has this model: export refuses it,
naming the first key that differs from what those two need."""

from __future__ import annotations

from maxtrain.runtime.errors import ConvertError
from maxtrain.models import decoder_spec
from maxtrain.models.registry import Keys, ModelSpec, register

# Keys of an MoE that Mixtral and Qwen3-MoE have only at these values.
PLAIN = (("shared_experts", 0), ("first_num_dense_layers", 0), ("routed_score_func", "softmax"),
         ("routed_bias", False), ("routed_scaling_factor", 1.0), ("qkv_bias", False))


def _unplain(m: Keys) -> list[str]:
    return [key for key, plain in PLAIN if m[key] != plain]


def _hf_kind(m: Keys) -> str:
    key = _unplain(m)[0]
    plain = dict(PLAIN)[key]
    raise ConvertError(f"{key}={m[key]!r}: neither Mixtral nor Qwen3-MoE has this (HF export needs {plain!r})")


SPEC = register(ModelSpec(name="deepseek", matches=lambda m: m["num_experts"] > 1 and bool(_unplain(m)),
                          hf_kind=_hf_kind, priority=1, **decoder_spec.spec_parts()))
