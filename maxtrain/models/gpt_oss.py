"""gpt-oss: attention with sinks, q/k/v and output biases, alternating sliding (128) and full layers, yarn
RoPE; every layer a mixture of experts whose router has a bias and whose experts have biases and a
clamped SwiGLU ((up + 1) x gate x sigmoid(1.702 gate)), routed by a softmax over the top-k logits (softmax,
top-k, renormalised). HF: mlp.router.weight [E, D] and bias [E]; mlp.experts.gate_up_proj [E, D, 2F]
(gate the even columns, up the odd) with gate_up_proj_bias [E, 2F] alike, down_proj [E, F, D] and
down_proj_bias [E, D], each one tensor for all experts; self_attn.sinks [H]."""

from __future__ import annotations

from typing import Any

import numpy as np

from maxtrain.models.parts import moe_width
from maxtrain.models.hf_layout import Tensor
from maxtrain.models import decoder_spec, hf
from maxtrain.models.layers import SWIGLU_ALPHA
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register
from maxtrain.runtime import base_yml
from maxtrain.runtime.errors import ConvertError

SLIDING, FULL = "sliding_attention", "full_attention"

# What HF's GptOssForCausalLM is, beyond its shape: its own settings, and keys it has only at base.yml's
# values; export refuses model keys with another value.
TRAITS = {"attention_sinks": True, "mlp_bias": True, "router_logit_bias": True, "mlp_activation": "clamped_swiglu",
          "norm_topk_prob": True}
PLAIN = ("use_qk_norm", "shared_experts", "first_num_dense_layers", "routed_score_func", "routed_bias",
         "routed_scaling_factor", "query_pre_attn_scalar", "local_rope_theta", "attn_logit_softcapping",
         "final_logit_softcapping", "scale_embedding", "rms_norm_plus_one", "use_post_attn_norm", "use_post_ffw_norm")


def _hf_kind(m: Keys) -> str:
    for key, value in {**TRAITS, **base_yml.defaults_of(PLAIN)}.items():
        if m[key] != value:
            raise ConvertError(f"{key}={m[key]!r}: HF's gpt-oss has {value!r}")
    if m["qkv_bias"] != m["attention_out_bias"]:
        raise ConvertError(f"qkv_bias={m['qkv_bias']!r} with attention_out_bias={m['attention_out_bias']!r}: "
                           "HF's gpt-oss has both or neither (attention_bias)")
    if m["sliding_window_size"] > 0 and m["global_layer_interval"] not in (0, 2):
        raise ConvertError(f"global_layer_interval={m['global_layer_interval']}: HF's gpt-oss alternates sliding "
                           "and full layers (2), or slides in all (0)")
    if m["rope_scaling_factor"] != 1.0 and m["rope_type"] != "yarn":
        raise ConvertError(f"rope_type={m['rope_type']!r}: HF's gpt-oss scales RoPE by yarn")
    return "gpt_oss"


def _layer_pattern(config: dict) -> dict[str, Any]:
    """sliding_window_size and global_layer_interval for config.json's sliding_window and layer_types."""
    window, layers = config.get("sliding_window"), config["num_hidden_layers"]
    types = config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    if window is None or SLIDING not in types:
        if any(t not in (SLIDING, FULL) for t in types):
            raise ConvertError(f"config.json: layer_types {types} is not supported")
        return {"sliding_window_size": 0, "global_layer_interval": 0}
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ConvertError(f"config.json: sliding_window={window!r} is not a positive integer")
    if list(types) == [SLIDING] * layers:
        return {"sliding_window_size": window, "global_layer_interval": 0}
    if list(types) != [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]:
        raise ConvertError(f"config.json: layer_types {types} is not supported (maxtrain's gpt-oss alternates "
                           "sliding_attention and full_attention, starting with sliding_attention)")
    return {"sliding_window_size": window, "global_layer_interval": 2}


# transformers' GptOssConfig where config.json has neither rope_parameters nor rope_scaling
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


def _rope(config: dict) -> dict[str, Any]:
    """The rope parameters transformers reads: its yarn defaults where config.json says nothing."""
    return hf.flat_rope(config) or dict(DEFAULT_ROPE)


def _keys(config: dict, kind: str) -> dict:
    alpha = hf.number(config, "swiglu_alpha", SWIGLU_ALPHA)
    if alpha != SWIGLU_ALPHA:
        raise ConvertError(f"config.json: swiglu_alpha={alpha} is not supported (maxtrain's clamped SwiGLU has "
                           f"{SWIGLU_ALPHA})")
    act = config.get("hidden_act")
    if act not in ("silu", "swish"):  # transformers' gpt-oss ignores it; another value says another model
        raise ConvertError(f"config.json: hidden_act {act!r} is not supported (gpt-oss: silu)")
    if config.get("attention_bias") not in (True, False):
        raise ConvertError(f"config.json: attention_bias={config.get('attention_bias')!r} is not true or false")
    limit = hf.number(config, "swiglu_limit", 7.0)
    if limit <= 0:
        raise ConvertError(f"config.json: swiglu_limit={limit} is not positive")
    return hf.moe_keys(config, kind, "num_local_experts") | _layer_pattern(config) | {
        "base_moe_mlp_dim": -1, "norm_topk_prob": True, "use_qk_norm": False, "attention_sinks": True,
        "qkv_bias": config["attention_bias"], "attention_out_bias": config["attention_bias"], "mlp_bias": True,
        "router_logit_bias": True, "mlp_activation": "clamped_swiglu", "mlp_activation_limit": limit}


def _config(m: Keys, kind: str, config: dict) -> dict:
    layers, window = m["base_num_decoder_layers"], m["sliding_window_size"]
    every = [FULL if window == 0 or (m["global_layer_interval"] and (i + 1) % m["global_layer_interval"] == 0)
             else SLIDING for i in range(layers)]
    return {"num_local_experts": m["num_experts"], "num_experts_per_tok": m["num_experts_per_tok"],
            "router_aux_loss_coef": m["load_balance_loss_weight"], "intermediate_size": moe_width(m),
            "attention_bias": m["qkv_bias"], "sliding_window": window or None, "layer_types": every,
            "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": m["mlp_activation_limit"]}


def _mlp_tensors(m: Keys, fused: bool) -> list[Tensor]:
    """One tensor per kind for all experts, as transformers stores them; gate and up interleaved by column."""
    d, e, f = m["base_emb_dim"], m["num_experts"], moe_width(m)
    same = lambda x: x  # noqa: E731
    T = lambda x: x.T  # noqa: E731

    def interleave(gate, up):  # [..., F] twice -> [..., 2F]: gate in the even columns, up in the odd
        return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
    return [Tensor(("mlp", "router"), "mlp.router.weight", (e, d), T, T),
            Tensor(("mlp", "router_logit_bias"), "mlp.router.bias", (e,), same, same),
            Tensor(("mlp", "wi_gate"), "mlp.experts.gate_up_proj", (e, d, 2 * f), lambda x: x[..., ::2], interleave,
                   joins=(("mlp", "wi_up"),)),
            Tensor(("mlp", "wi_up"), "mlp.experts.gate_up_proj", (e, d, 2 * f), lambda x: x[..., 1::2], None),
            Tensor(("mlp", "bi_gate"), "mlp.experts.gate_up_proj_bias", (e, 2 * f), lambda x: x[..., ::2],
                   interleave, joins=(("mlp", "bi_up"),)),
            Tensor(("mlp", "bi_up"), "mlp.experts.gate_up_proj_bias", (e, 2 * f), lambda x: x[..., 1::2], None),
            Tensor(("mlp", "wo"), "mlp.experts.down_proj", (e, f, d), same, same),
            Tensor(("mlp", "bo"), "mlp.experts.down_proj_bias", (e, d), same, same)]


HF = HFMapping(
    types={"gpt_oss": HFType("GptOssForCausalLM", "GptOssConfig", {"max_position_embeddings": 131072} | hf.COMMON | dict(
        zip(hf.SHAPE, (201088, 2880, 2880, 36, 64, 8))) | {
        "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "head_dim": 64, "sliding_window": 128, "layer_types": None,
        "num_local_experts": 128, "num_experts_per_tok": 4, "router_aux_loss_coef": 0.001, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "attention_bias": True, "rope_parameters": None, "bos_token_id": None,
        "eos_token_id": None})},
    keys=_keys,
    config=_config,
    mlp_tensors=_mlp_tensors,
    checks=lambda config: None,  # _keys checks what gpt-oss's config.json says
    sliding_window=lambda config: None,  # _layer_pattern reads the window with the layer types
    rope=_rope,
    expresses=("sliding_window_size", "global_layer_interval", "attention_sinks", "attention_out_bias",
               "mlp_activation", "mlp_bias", "router_logit_bias"),
)

NOT_DECAYED = (*decoder_spec.NOT_DECAYED, "sinks", "bo", "bi_gate", "bi_up", "router_logit_bias")

SPEC = register(ModelSpec(name="gpt_oss", matches=lambda m: m["num_experts"] > 1 and m["attention_sinks"],
                          hf_kind=_hf_kind, hf=HF, priority=2,
                          **decoder_spec.spec_parts(not_decayed=NOT_DECAYED)))
