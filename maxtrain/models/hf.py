"""HuggingFace config.json <-> maxtrain model keys for the registered families: what they share (shapes,
RoPE types and their parameters, transformers' defaults for keys a file leaves out, the variants a family
may carry) and the entry points maxtrain.convert calls, which ask the model's family (maxtrain.models.registry)
for the rest. The tensors: maxtrain.models.hf_tensors; the files: maxtrain.checkpoint.hf_format.

RoPE types: default, llama3 (Llama 3.1's frequency scaling), linear (Gemma 3's global layers) and yarn (gpt-oss,
DeepSeek): rope_type and the rope_* keys. A family's own settings (windows, sinks, norms, activations, latent
attention) go through its HFMapping hooks.
"""

from __future__ import annotations

import math
from typing import Any

from maxtrain.runtime import base_yml
from maxtrain.runtime.errors import ConvertError
from maxtrain.models import registry
from maxtrain.models.registry import Keys

# Families HF has and maxtrain does not: why not.
UNSUPPORTED = {"qwen2_moe": "its shared expert has a sigmoid gate, which maxtrain lacks"}

# What transformers (5.x) assumes for each key a config.json leaves out, shared by the families' tables
# (each family's HFType.defaults: the defaults of its <Family>Config; rope_theta: the class's
# default_theta). None as transformers has it: "derived" (num_key_value_heads = num_attention_heads,
# head_dim = hidden_size // num_attention_heads) or "none". tests/test_convert_defaults.py holds each
# family's table to transformers' own.
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads")
COMMON = {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0, "rms_norm_eps": 1e-6}


def supported() -> tuple[str, ...]:
    return tuple(registry.hf_types())


def hf_defaults() -> dict[str, dict[str, Any]]:
    """Each supported model_type's table of transformers' defaults."""
    return {kind: t.defaults for kind, t in registry.hf_types().items()}


def with_defaults(hf: dict[str, Any]) -> dict[str, Any]:
    """An HF config.json with transformers' defaults for the keys it leaves out (a supported family's)."""
    kind = registry.hf_types().get(hf.get("model_type")) if isinstance(hf.get("model_type"), str) else None
    return {**(kind.defaults if kind else {}), **hf}


def number(hf: dict[str, Any], key: str, default: float) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConvertError(f"config.json: {key}={value!r} is not a number")
    return float(value)


def whole(x: float) -> int | float:
    """A whole number as an int: some transformers configs type a float key as int (Gemma's
    query_pre_attn_scalar, Llama 4's floor_scale)."""
    return int(x) if float(x).is_integer() else x


def positive_int(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConvertError(f"config.json: {key} missing or not a positive integer")
    return value


def layered_sliding_window(hf: dict[str, Any]) -> int | None:
    """Qwen2's and Qwen3's rule: the window only where use_sliding_window is set and a layer (from
    max_window_layers on, or per layer_types) actually uses it."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf["max_window_layers"]
                                      else "full_attention" for i in range(hf["num_hidden_layers"])]
    return hf.get("sliding_window") if "sliding_attention" in types else None


# ---------------------------------------------------------------------------------------------
# config.json <-> maxtrain model keys


# Model keys of the attention and block variants, at the values that leave the plain decoder. A family
# whose HF model has a variant sets its key in `HFMapping.keys`; export refuses a model whose family's
# HF types cannot carry a variant it has (HFMapping.expresses).
VARIANT_KEYS = ("sliding_window_size", "global_layer_interval", "local_rope_theta", "attention_sinks",
                "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "attention_out_bias",
                "scale_embedding", "rms_norm_plus_one", "use_post_attn_norm", "use_post_ffw_norm", "mlp_activation",
                "mlp_bias", "router_logit_bias", "interleave_moe_layer_step", "nope_layer_interval", "chunk_attn_window_size", "use_qk_l2_norm",
                "temperature_tuning")


def plain_checks(hf: dict[str, Any]) -> None:
    """What the Llama-like families' config.json must say (a family with its own checks replaces these)."""
    if hf.get("hidden_act") not in ("silu", "swish"):
        raise ConvertError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU uses silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConvertError(f"config.json: {key}=true is not supported (maxtrain has q/k/v biases only, "
                               f"as Qwen2)")


def rope_keys(rope: dict[str, Any], theta: float) -> dict[str, Any]:
    """maxtrain's RoPE keys for HF rope parameters `rope` (rope_type and its settings), base `theta`."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear", "yarn"):
        raise ConvertError(f"config.json: rope type {rope_type!r} is not supported (supported: default, llama3, "
                           f"linear, yarn)")
    if number(rope, "partial_rotary_factor", 1.0) != 1.0:
        raise ConvertError("config.json: partial_rotary_factor is not supported (maxtrain rotates whole heads)")
    keys: dict[str, Any] = {"rope_theta": theta, "rope_scaling_factor": 1.0, "rope_type": "llama3"}
    if rope_type == "default":  # the other keys matter only with a factor
        return keys
    factor = number(rope, "factor", math.nan)
    if math.isnan(factor) or factor < 1:
        raise ConvertError(f"config.json: {rope_type} rope parameters need a factor >= 1: {rope}")
    keys |= {"rope_type": rope_type, "rope_scaling_factor": factor}
    if rope_type == "linear":
        return keys
    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ConvertError(f"config.json: {rope_type} rope parameters need original_max_position_embeddings: {rope}")
    keys["rope_original_max_position_embeddings"] = original
    if rope_type == "yarn":
        if rope.get("attention_factor") is not None:
            raise ConvertError(f"config.json: yarn attention_factor={rope['attention_factor']!r} is not supported (cos "
                               f"and sin scale by 0.1 ln(factor) + 1, or as mscale and mscale_all_dim say)")
        return keys | {"rope_yarn_beta_fast": number(rope, "beta_fast", 32.0) or 32.0,
                       "rope_yarn_beta_slow": number(rope, "beta_slow", 1.0) or 1.0,
                       "rope_yarn_truncate": bool(rope.get("truncate", True)),
                       "rope_yarn_mscale": number(rope, "mscale", 0.0),
                       "rope_yarn_mscale_all_dim": number(rope, "mscale_all_dim", 0.0)}
    names = {"rope_low_freq_factor": "low_freq_factor", "rope_high_freq_factor": "high_freq_factor"}
    scaling = {ours: number(rope, theirs, math.nan) for ours, theirs in names.items()}
    if any(math.isnan(v) for v in scaling.values()):
        raise ConvertError(f"config.json: llama3 rope parameters incomplete: {rope}")
    return keys | scaling


def flat_rope(hf: dict[str, Any]) -> dict[str, Any]:
    """The one set of rope parameters of a config.json: transformers >= 5 writes rope_parameters, older
    files rope_theta and rope_scaling."""
    return {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}


# ---------------------------------------------------------------------------------------------
# config.json <-> maxtrain model keys


def model_keys_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """maxtrain model keys for an HF config.json (keys it leaves out have transformers' defaults), or a
    ConvertError naming what is unsupported."""
    kind = hf.get("model_type")
    if isinstance(kind, str) and kind in UNSUPPORTED:
        raise ConvertError(f"config.json: model_type {kind!r} is not supported ({UNSUPPORTED[kind]}; "
                           f"supported: {', '.join(supported())})")
    spec = registry.by_hf_type(kind)
    if spec is None:
        raise ConvertError(f"config.json: model_type {kind!r} is not supported (supported: {', '.join(supported())})")
    hf, defaults = with_defaults(hf), spec.hf.types[kind].defaults
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        positive_int(hf, key)
    (spec.hf.checks or plain_checks)(hf)
    window = spec.hf.sliding_window(hf)
    if window is not None and not spec.hf.windowed:
        raise ConvertError(f"config.json: sliding_window={window} is not supported (maxtrain's {kind} attends over "
                           f"the full context: a window on some layers only is not expressed)")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise ConvertError(f"config.json: sliding_window={window!r} is not a positive integer")
    rope = (spec.hf.rope or flat_rope)(hf)
    heads = hf["num_attention_heads"]
    keys = {
        "model_family": spec.name,
        "vocab_size": hf["vocab_size"],
        "base_emb_dim": hf["hidden_size"],
        "base_num_query_heads": heads,
        "base_num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "base_mlp_dim": hf["intermediate_size"],
        "base_num_decoder_layers": hf["num_hidden_layers"],
        "normalization_layer_epsilon": number(hf, "rms_norm_eps", defaults["rms_norm_eps"]),
        "logits_via_embedding": bool(hf.get("tie_word_embeddings")),
        "max_position_embeddings": max(int(number(hf, "max_position_embeddings", 0)), 0),
        "qkv_bias": False,
        **base_yml.defaults_of(VARIANT_KEYS),
        "sliding_window_size": window or 0,
        **rope_keys(rope, number(rope, "rope_theta", number(hf, "rope_theta", defaults["rope_theta"]))),
    }
    return keys | spec.hf.keys(hf, kind)


def unexpressed(m: Keys, spec) -> str | None:
    """The first variant key of model keys `m` that the family's HF types cannot carry, if any."""
    return next((k for k in base_yml.changed(m, VARIANT_KEYS) if k not in spec.hf.expresses), None)


def hf_kind(m: Keys) -> str:
    """The HF model_type that export writes for maxtrain model keys `m`, or a ConvertError naming the key
    that none of them can express."""
    spec = registry.spec_for(m)
    key = unexpressed(m, spec) if spec.hf else None
    if key:
        raise ConvertError(f"{key}={m[key]!r}: no HF model of this family ({', '.join(spec.hf.types)}) has it (HF "
                           f"export needs {base_yml.default(key)!r})")
    return spec.hf_kind(m)


def hf_config_for(m: Keys, dtype: str, source: dict[str, Any] | None, max_positions: int | None):
    """config.json for transformers. With the HF config the model was imported from (`source`), its other
    settings (model_type, token ids, context length) carry over; without one, the model_type hf_kind
    picks, with no special token ids and a 4096 context."""
    spec = registry.spec_for(m)
    kind = spec.hf_kind(m)
    if source:
        hf = dict(source)
    else:
        hf = {"architectures": [spec.hf.types[kind].architecture], "model_type": kind, "hidden_act": "silu",
              "max_position_embeddings": 4096, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
        hf |= spec.hf.types[kind].fresh
    hf |= {"vocab_size": m["vocab_size"], "hidden_size": m["base_emb_dim"], "intermediate_size": m["base_mlp_dim"],
           "num_hidden_layers": m["base_num_decoder_layers"], "num_attention_heads": m["base_num_query_heads"],
           "num_key_value_heads": m["base_num_kv_heads"], "head_dim": m["head_dim"],
           "rms_norm_eps": m["normalization_layer_epsilon"], "tie_word_embeddings": m["logits_via_embedding"],
           "dtype": dtype, "torch_dtype": dtype}
    max_positions = max_positions or m.get("max_position_embeddings")  # (0: the source's, else 4096)
    if max_positions:
        hf["max_position_embeddings"] = max_positions
    rope = rope_parameters(m)
    # Both spellings: transformers >= 5 reads rope_parameters, older releases rope_theta + rope_scaling.
    hf |= {"rope_parameters": rope, "rope_theta": m["rope_theta"],
           "rope_scaling": rope if rope["rope_type"] != "default" else None}
    if m["sliding_window_size"]:
        hf["sliding_window"] = m["sliding_window_size"]
    return hf | spec.hf.config(m, kind, hf)


def rope_parameters(m: Keys, theta: float | None = None) -> dict[str, Any]:
    """HF rope parameters for maxtrain model keys `m` (with `theta`: that base, unscaled)."""
    if theta is not None or m["rope_scaling_factor"] == 1.0:
        return {"rope_type": "default", "rope_theta": m["rope_theta"] if theta is None else theta}
    rope = {"rope_type": m["rope_type"], "rope_theta": m["rope_theta"], "factor": m["rope_scaling_factor"]}
    if m["rope_type"] == "llama3":
        rope |= {"low_freq_factor": m["rope_low_freq_factor"], "high_freq_factor": m["rope_high_freq_factor"]}
    if m["rope_type"] == "yarn":
        rope |= {"beta_fast": m["rope_yarn_beta_fast"], "beta_slow": m["rope_yarn_beta_slow"],
                 "truncate": m["rope_yarn_truncate"]}
        rope |= {name: m[f"rope_yarn_{name}"] for name in ("mscale", "mscale_all_dim") if m[f"rope_yarn_{name}"]}
    if m["rope_type"] != "linear":
        rope["original_max_position_embeddings"] = m["rope_original_max_position_embeddings"]
    return rope


def moe_keys(hf: dict[str, Any], kind: str, experts_key: str) -> dict[str, Any]:
    """The mixture-of-experts keys Mixtral and Qwen3-MoE share (router_jitter_noise and
    output_router_logits concern HF's training and outputs only, and are ignored)."""
    experts, top_k = positive_int(hf, experts_key), positive_int(hf, "num_experts_per_tok")
    if experts < 2:
        raise ConvertError(f"config.json: {experts_key}={experts} is not supported (a mixture needs 2 experts or more)")
    if top_k > experts:
        raise ConvertError(f"config.json: num_experts_per_tok={top_k} exceeds {experts_key}={experts}")
    defaults = registry.hf_types()[kind].defaults
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            **base_yml.defaults_of(("shared_experts", "first_num_dense_layers", "routed_score_func", "routed_bias",
                                    "routed_scaling_factor")),  # DeepSeek's (deepseek.DEEPSEEK_KEYS)
            "load_balance_loss_weight": number(hf, "router_aux_loss_coef", defaults["router_aux_loss_coef"])}
