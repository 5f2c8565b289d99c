"""DeepSeek-V3 and -V2: multi-head latent attention (maxtrain.models.mla), leading dense layers, then
mixtures of experts with shared experts, a routed scaling factor and group-limited routing: V3 scores
by sigmoid, picks by scores plus the aux-loss-free balancing bias and renormalises; V2 scores by softmax
and does not renormalise. DeepSeek-V3's multi-token prediction depths (maxtrain.models.mtp) are layers
after the model's in its checkpoints (model.layers.<L + k - 1>: enorm, hnorm, eh_proj, shared_head.norm,
a decoder layer, and copies of the embedding and the output layer); transformers ignores them, vLLM and
SGLang read them, import keeps them where the files hold them and export writes them.

Also every other MoE that Mixtral, Qwen3-MoE and gpt-oss do not express (on GQA: the deepseek-v3-gqa
preset); export refuses those, naming the first key that differs.

HF layout beyond the shared decoder's: self_attn.q_a_proj [Q, D], q_a_layernorm [Q], q_b_proj [H*(P+R), Q]
(or q_proj [H*(P+R), D]), kv_a_proj_with_mqa [C+R, D], kv_a_layernorm [C], kv_b_proj [H*(P+J), C] (each
head's rows: P key rows without RoPE, then J value rows), o_proj [D, H*J]; mlp.gate.weight [E, D] and
(V3) e_score_correction_bias [E]; mlp.experts.<e>.gate_proj / up_proj / down_proj; mlp.shared_experts.*.
DeepSeek rotates the rotary part of q and k in interleaved pairs (V3's rope_interleave, V2 always);
maxtrain's RoPE rotates halves, so import moves those rows to halves and export back (the scores are the
same: q and k move alike).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from maxtrain.models.parts import MoE, moe_width
from maxtrain.models.hf_layout import Tensor, same, transposed
from maxtrain.models import decoder_spec, hf
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register
from maxtrain.runtime import base_yml
from maxtrain.runtime.errors import ConvertError

# Keys of an MoE that Mixtral and Qwen3-MoE have only at base.yml's values.
DEEPSEEK_KEYS = ("shared_experts", "first_num_dense_layers", "routed_score_func", "routed_bias",
                 "routed_scaling_factor", "qkv_bias", "n_routing_groups")


def _unplain(m: Keys) -> list[str]:
    return base_yml.changed(m, DEEPSEEK_KEYS)


def _hf_kind(m: Keys) -> str:
    if m["attention_type"] != "mla":
        key = _unplain(m)[0]
        raise ConvertError(f"{key}={m[key]!r}: neither Mixtral nor Qwen3-MoE has this (HF export needs "
                           f"{base_yml.default(key)!r}), and DeepSeek's HF models have latent attention "
                           f"(attention_type=mla)")
    if m["num_experts"] == 1:
        raise ConvertError("num_experts=1: DeepSeek's HF models are mixtures of experts (a dense model with "
                           "attention_type=mla has no HF class)")
    if m["routed_score_func"] == "sigmoid":
        if not m["routed_bias"]:
            raise ConvertError("routed_bias=False: HF's DeepSeek-V3 (sigmoid scores) has the balancing bias")
        return "deepseek_v3"
    if m["routed_bias"] or m["norm_topk_prob"]:
        key = "routed_bias" if m["routed_bias"] else "norm_topk_prob"
        raise ConvertError(f"{key}=True: HF's DeepSeek-V2 (softmax scores) has neither the balancing bias nor "
                           f"renormalised weights")
    return "deepseek_v2"


def _int(config: dict, key: str, least: int = 0) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConvertError(f"config.json: {key}={value!r} is not an integer >= {least}")
    return value


def _groups(config: dict, kind: str, experts: int) -> dict[str, int]:
    """n_routing_groups and topk_routing_group for config.json's routing (-1: not limited)."""
    if kind == "deepseek_v2":
        method = config.get("topk_method")
        if method == "greedy":
            return {"n_routing_groups": -1, "topk_routing_group": -1}
        if method != "group_limited_greedy":
            raise ConvertError(f"config.json: topk_method={method!r} is not supported (DeepSeek-V2: greedy or "
                               f"group_limited_greedy)")
    groups, top = _int(config, "n_group", 1), _int(config, "topk_group", 1)
    if experts % groups or top > groups:
        raise ConvertError(f"config.json: n_group={groups}, topk_group={top} do not split {experts} experts")
    return {"n_routing_groups": groups, "topk_routing_group": top}


def _checks(config: dict) -> None:
    if config.get("hidden_act") not in ("silu", "swish"):
        raise ConvertError(f"config.json: hidden_act {config.get('hidden_act')!r} is not supported (DeepSeek: silu)")


def _keys(config: dict, kind: str) -> dict[str, Any]:
    v3 = kind == "deepseek_v3"
    if config.get("attention_bias"):
        raise ConvertError("config.json: attention_bias=true is not supported (maxtrain's latent attention has "
                           "no projection biases)")
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    experts, top_k = _int(config, "n_routed_experts", 2), _int(config, "num_experts_per_tok", 1)
    first = _int(config, "first_k_dense_replace")
    if first >= layers:
        raise ConvertError(f"config.json: first_k_dense_replace={first} leaves no MoE layer of {layers}")
    if top_k > experts:
        raise ConvertError(f"config.json: num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    if not v3 and config.get("norm_topk_prob"):
        raise ConvertError("config.json: norm_topk_prob=true is not supported (transformers' DeepSeek-V2 does not "
                           "renormalise)")
    q_lora = config.get("q_lora_rank")
    mla = {key: _int(config, key, 1) for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    return {
        "attention_type": "mla", "q_lora_rank": 0 if q_lora is None else _int(config, "q_lora_rank", 1), **mla,
        "base_num_kv_heads": heads, "head_dim": mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
        "use_qk_norm": False, "num_experts": experts, "num_experts_per_tok": top_k,
        "base_moe_mlp_dim": _int(config, "moe_intermediate_size", 1), "shared_experts": _int(config, "n_shared_experts"),
        "first_num_dense_layers": first, "routed_score_func": "sigmoid" if v3 else "softmax", "routed_bias": v3,
        "routed_scaling_factor": hf.number(config, "routed_scaling_factor", 1.0),
        "norm_topk_prob": bool(config.get("norm_topk_prob")) if v3 else False,
        # V3 balances by its bias (aux-loss-free); V2 by DeepSeek's expert-level loss
        "load_balance_loss_weight": 0.0 if v3 else hf.number(config, "aux_loss_alpha", 0.001),
        **_groups(config, kind, experts)}


def _config(m: Keys, kind: str, config: dict) -> dict[str, Any]:
    grouped = m["n_routing_groups"] != -1
    out = {"q_lora_rank": m["q_lora_rank"] or None, "kv_lora_rank": m["kv_lora_rank"],
           "qk_nope_head_dim": m["qk_nope_head_dim"], "qk_rope_head_dim": m["qk_rope_head_dim"],
           "v_head_dim": m["v_head_dim"], "head_dim": m["qk_rope_head_dim"], "num_key_value_heads":
           m["base_num_query_heads"], "n_routed_experts": m["num_experts"], "num_experts_per_tok":
           m["num_experts_per_tok"], "moe_intermediate_size": moe_width(m), "n_shared_experts": m["shared_experts"],
           "first_k_dense_replace": m["first_num_dense_layers"], "routed_scaling_factor": m["routed_scaling_factor"],
           "norm_topk_prob": m["norm_topk_prob"], "attention_bias": False,
           "n_group": m["n_routing_groups"] if grouped else 1, "topk_group": m["topk_routing_group"] if grouped else 1}
    if kind == "deepseek_v3":
        return out | {"rope_interleave": True, "num_nextn_predict_layers": m["mtp_num_layers"]}
    return out | {"topk_method": "group_limited_greedy" if grouped else "greedy",
                  "aux_loss_alpha": m["load_balance_loss_weight"]}


def _interleaved(hf_config: dict | None) -> bool:
    """Whether the checkpoint's rotary rows come in DeepSeek's interleaved pairs (export: always)."""
    return hf_config is None or hf_config.get("model_type") == "deepseek_v2" or hf_config.get("rope_interleave", True)


def _attention_tensors(m: Keys, hf_config: dict | None) -> list[Tensor]:
    d, h, q, c = m["base_emb_dim"], m["base_num_query_heads"], m["q_lora_rank"], m["kv_lora_rank"]
    p, r, j = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    # interleaved pairs (0, 1), (2, 3) ... -> halves (0, 2, ...), (1, 3, ...): the last r of each row block
    order = np.concatenate([np.arange(0, r, 2), np.arange(1, r, 2)]) if _interleaved(hf_config) else np.arange(r)
    back = np.argsort(order)

    def rope_last(x, index):  # x[..., -r:] reordered
        return np.concatenate([x[..., :-r], x[..., -r:][..., index]], axis=-1)

    def queries(fan_in: int):  # [H*(P+R), in] <-> [in, H, P+R]
        return (lambda x: rope_last(x.T.reshape(fan_in, h, p + r), order),
                lambda w: rope_last(w, back).reshape(fan_in, h * (p + r)).T)

    if q:
        tensors = [Tensor(("attention", "wq_a"), "self_attn.q_a_proj.weight", (q, d), lambda x: x.T, lambda w: w.T),
                   Tensor(("attention", "q_norm", "scale"), "self_attn.q_a_layernorm.weight", (q,), same, same),
                   Tensor(("attention", "wq_b"), "self_attn.q_b_proj.weight", (h * (p + r), q), *queries(q))]
    else:
        tensors = [Tensor(("attention", "wq"), "self_attn.q_proj.weight", (h * (p + r), d), *queries(d))]
    return tensors + [
        Tensor(("attention", "wkv_a"), "self_attn.kv_a_proj_with_mqa.weight", (c + r, d),
               lambda x: rope_last(x.T, order), lambda w: rope_last(w, back).T),
        Tensor(("attention", "kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", (c,), same, same),
        Tensor(("attention", "wkv_b"), "self_attn.kv_b_proj.weight", (h * (p + j), c),
               lambda x: x.T.reshape(c, h, p + j), lambda w: w.reshape(c, h * (p + j)).T),
        Tensor(("attention", "wo"), "self_attn.o_proj.weight", (d, h * j),
               lambda x: x.T.reshape(h, j, d), lambda w: w.reshape(h * j, d).T)]


def _mlp_tensors(m: Keys, fused: bool) -> list[Tensor]:
    """An MoE layer's router, its balancing bias (V3), routed and shared experts."""
    d, moe = m["base_emb_dim"], MoE.from_config(m)
    tensors = moe.hf_tensors(d, fused, "mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                             "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
    if moe.routed_bias:
        tensors.append(Tensor(("mlp", "router_bias"), "mlp.gate.e_score_correction_bias", (moe.num_experts,),
                              same, same))
    if moe.shared_experts:
        tensors += moe.shared.hf_tensors(d, ("mlp", "shared"), "mlp.shared_experts")
    return tensors


def _mtp_tensors(m: Keys) -> list[Tensor]:
    """A multi-token prediction depth's own tensors in DeepSeek-V3's checkpoints (beside its layer's)."""
    d, T = m["base_emb_dim"], transposed
    return [Tensor(("embedding_norm", "scale"), "enorm.weight", (d,), same, same),
            Tensor(("hidden_norm", "scale"), "hnorm.weight", (d,), same, same),
            Tensor(("projection",), "eh_proj.weight", (d, 2 * d), T, T),  # input: [embedding; hidden]
            Tensor(("output_norm", "scale"), "shared_head.norm.weight", (d,), same, same)]


_COMMON = hf.COMMON | {"rms_norm_eps": 1e-6, "attention_bias": False}
HF = HFMapping(
    types={
        "deepseek_v3": HFType("DeepseekV3ForCausalLM", "DeepseekV3Config", {"max_position_embeddings": 4096} | _COMMON | dict(
            zip(hf.SHAPE, (129280, 7168, 18432, 61, 128, 128))) | {
            "moe_intermediate_size": 2048, "n_shared_experts": 1, "n_routed_experts": 256,
            "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
            "first_k_dense_replace": 3, "norm_topk_prob": True, "rope_interleave": True, "rope_parameters": None,
            "bos_token_id": 0, "eos_token_id": 1}),
        "deepseek_v2": HFType("DeepseekV2ForCausalLM", "DeepseekV2Config", {"max_position_embeddings": 2048} | _COMMON | dict(
            zip(hf.SHAPE, (102400, 4096, 11008, 32, 32, None))) | {
            "head_dim": None, "mlp_bias": False, "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536,
            "n_group": None, "n_routed_experts": 64, "n_shared_experts": 2, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None, "topk_method": "greedy",
            "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
            "rope_parameters": None, "bos_token_id": 1, "eos_token_id": 2}),
    },
    keys=_keys,
    config=_config,
    checks=_checks,
    mlp_tensors=_mlp_tensors,
    attention_tensors=_attention_tensors,
    mtp_tensors=_mtp_tensors,
    mtp_key="num_nextn_predict_layers",
    mtp_copies={"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"},
)

SPEC = register(ModelSpec(name="deepseek", matches=lambda m: m["attention_type"] == "mla" or (
    m["num_experts"] > 1 and bool(_unplain(m))), hf_kind=_hf_kind, hf=HF, priority=1,
    **decoder_spec.spec_parts()))
