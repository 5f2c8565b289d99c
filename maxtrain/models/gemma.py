"""Gemma 3 (text) and Gemma 2: maxtrain's decoder with embeddings scaled by sqrt(width), RMSNorms that
multiply by (1 + scale), sandwich norms (each block's output normalized before the residual add), a GeGLU
MLP (gelu, tanh approximation), scores scaled by query_pre_attn_scalar ** -0.5, and sliding layers
(window sliding_window) with every Nth layer global. Gemma 3 adds q/k norms and its own RoPE base for the
sliding layers (the global ones may scale theirs linearly); Gemma 2 soft-caps the attention scores and
the logits instead. HF: Gemma3ForCausalLM (model_type gemma3_text) and Gemma2ForCausalLM, tensors named as
Llama's but for the norms: post_attention_layernorm is the attention's output norm, pre_feedforward_layernorm
the MLP's input norm, post_feedforward_layernorm its output norm.
"""

from __future__ import annotations

from typing import Any

from maxtrain.models import decoder_spec, hf
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register
from maxtrain.runtime import base_yml
from maxtrain.runtime.errors import ConvertError

# What every Gemma has, whichever the HF type: its own settings, and keys it has only at base.yml's values
# (model keys at these values, or export refuses).
TRAITS = {"scale_embedding": True, "rms_norm_plus_one": True, "use_post_attn_norm": True, "use_post_ffw_norm": True,
          "mlp_activation": "gelu_tanh"}
PLAIN = ("qkv_bias", "attention_sinks", "attention_out_bias", "mlp_bias")
ACTIVATION = "gelu_pytorch_tanh"


def _hf_kind(m: Keys) -> str:
    for key, value in {**TRAITS, **base_yml.defaults_of(PLAIN)}.items():
        if m[key] != value:
            raise ConvertError(f"{key}={m[key]!r}: every Gemma has {value!r} (HF export needs it)")
    if m["use_qk_norm"]:
        return "gemma3_text"
    if m["local_rope_theta"] != -1:
        raise ConvertError("local_rope_theta: Gemma 2 (no q/k norms) has one RoPE base for every layer (HF export "
                           "needs -1, or use_qk_norm=true for Gemma 3)")
    return "gemma2"


def _checks(config: dict) -> None:
    activation = config.get("hidden_activation") or config.get("hidden_act")
    if activation != ACTIVATION:
        raise ConvertError(f"config.json: hidden_activation {activation!r} is not supported (Gemma's GeGLU uses "
                           f"{ACTIVATION})")
    if config.get("attention_bias"):
        raise ConvertError("config.json: attention_bias=true is not supported (Gemma has no biases)")
    if config.get("use_bidirectional_attention"):
        raise ConvertError("config.json: use_bidirectional_attention=true is not supported (maxtrain's decoder "
                           "is causal)")


def _layer_types(config: dict) -> list[str]:
    """Each layer's attention, as transformers reads config.json (the pattern Gemma 3's and Gemma 2's
    classes assume where it names none)."""
    layers = config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is None:
        every = config.get("sliding_window_pattern", 6 if config.get("model_type") == "gemma3_text" else 2)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ConvertError(f"config.json: layer_types {types!r} is not one entry per layer of sliding_attention "
                           f"or full_attention")
    return types


def global_interval(types: list[str]) -> int:
    """global_layer_interval for a list of layer types, or a ConvertError if no interval gives them."""
    if "full_attention" not in types:
        return 0
    every = types.index("full_attention") + 1
    if types != pattern(len(types), every):
        raise ConvertError(f"config.json: layer_types {types!r} is not supported (maxtrain's layers slide except "
                           f"every Nth, which is global)")
    return every


def pattern(layers: int, every: int) -> list[str]:
    return ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]


def _sliding_window(config: dict) -> int | None:
    return config.get("sliding_window") if "sliding_attention" in _layer_types(config) else None


def _global_rope(config: dict) -> dict:
    """Gemma 3: the global layers' rope parameters (per layer type in transformers >= 5; older files:
    rope_theta and rope_scaling for them, rope_local_base_freq for the sliding ones)."""
    params = config.get("rope_parameters") or {}
    return dict(params["full_attention"]) if "full_attention" in params else hf.flat_rope(config)


def _local_theta(config: dict) -> float:
    local = (config.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ConvertError(f"config.json: the sliding layers' rope type {local['rope_type']!r} is not supported "
                           f"(Gemma 3's are unscaled)")
    return hf.number(local, "rope_theta", hf.number(config, "rope_local_base_freq", 10000.0))


def _keys(config: dict, kind: str) -> dict[str, Any]:
    keys = {**TRAITS, **base_yml.defaults_of(PLAIN), "num_experts": 1, "use_qk_norm": kind == "gemma3_text",
            "query_pre_attn_scalar": hf.number(config, "query_pre_attn_scalar", 0.0),
            "attn_logit_softcapping": hf.number(config, "attn_logit_softcapping", 0.0),
            "final_logit_softcapping": hf.number(config, "final_logit_softcapping", 0.0),
            "global_layer_interval": 0, "local_rope_theta": -1.0}
    types = _layer_types(config)
    if "sliding_attention" in types:
        keys["global_layer_interval"] = global_interval(types)
    if kind == "gemma3_text" and "sliding_attention" in types:
        keys["local_rope_theta"] = _local_theta(config)
    return keys


def _config(m: Keys, kind: str, config: dict) -> dict[str, Any]:
    window = m["sliding_window_size"]
    out = {"hidden_activation": ACTIVATION, "hidden_act": ACTIVATION,
           "query_pre_attn_scalar": hf.whole(m["query_pre_attn_scalar"] or m["head_dim"]),
           "attn_logit_softcapping": m["attn_logit_softcapping"] or None,
           "final_logit_softcapping": m["final_logit_softcapping"] or None, "use_bidirectional_attention": False,
           "sliding_window": window or config.get("sliding_window") or 4096,
           "layer_types": pattern(m["base_num_decoder_layers"], m["global_layer_interval"]) if window
           else ["full_attention"] * m["base_num_decoder_layers"], "attention_bias": False}
    if kind == "gemma3_text":  # one set of rope parameters per layer type
        local = m["rope_theta"] if m["local_rope_theta"] == -1 else m["local_rope_theta"]
        local_rope = hf.rope_parameters(m) if m["local_rope_theta"] == -1 else hf.rope_parameters(m, local)
        out |= {"rope_parameters": {"full_attention": hf.rope_parameters(m), "sliding_attention": local_rope},
                "rope_scaling": None, "rope_local_base_freq": local}
    return out


_SHARED = {"hidden_activation": ACTIVATION, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
           "attention_bias": False, "query_pre_attn_scalar": 256, "layer_types": None, "head_dim": 256,
           "use_bidirectional_attention": None, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
HF = HFMapping(
    types={
        "gemma3_text": HFType("Gemma3ForCausalLM", "Gemma3TextConfig", {"max_position_embeddings": 131072} | dict(zip(hf.SHAPE, (
            262_208, 2304, 9216, 26, 8, 4))) | _SHARED | {
            "rope_theta": 1_000_000.0, "sliding_window": 4096, "final_logit_softcapping": None,
            "attn_logit_softcapping": None, "use_bidirectional_attention": False}),
        "gemma2": HFType("Gemma2ForCausalLM", "Gemma2Config", {"max_position_embeddings": 8192} | dict(zip(hf.SHAPE, (
            256_000, 2304, 9216, 26, 8, 4))) | _SHARED | {
            "rope_theta": 10000.0, "sliding_window": 4096, "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0}),
    },
    keys=_keys,
    config=_config,
    sliding_window=_sliding_window,
    windowed=True,
    checks=_checks,
    rope=_global_rope,
    expresses=("sliding_window_size", "global_layer_interval", "local_rope_theta", "attn_logit_softcapping",
               "final_logit_softcapping", "query_pre_attn_scalar", "scale_embedding", "rms_norm_plus_one",
               "use_post_attn_norm", "use_post_ffw_norm", "mlp_activation"),
)

SPEC = register(ModelSpec(name="gemma", matches=lambda m: m["num_experts"] == 1 and m["rms_norm_plus_one"],
                          hf_kind=_hf_kind, hf=HF, priority=2, **decoder_spec.spec_parts()))
