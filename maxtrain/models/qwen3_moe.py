"""Qwen3-MoE: q/k norms, every layer a mixture of experts (softmax, top-k, renormalised per
norm_topk_prob) of moe_intermediate_size. HF: mlp.gate [E, D] and mlp.experts.<e>.gate_proj / up_proj /
down_proj."""

from __future__ import annotations

from maxtrain.runtime.errors import ConvertError
from maxtrain.models.parts import MoE, moe_width
from maxtrain.models import decoder_spec, hf
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register


def _sliding_window(config: dict) -> int | None:
    # transformers 5 applies it to every layer, older ones to some
    return config.get("sliding_window") if config.get("use_sliding_window") else None


def _keys(config: dict, kind: str) -> dict:
    # transformers 5 writes num_local_experts; Qwen3-MoE files from the Hub say num_experts.
    keys = hf.moe_keys(config, kind, "num_local_experts" if "num_local_experts" in config else "num_experts")
    step = config.get("decoder_sparse_step")
    if step != 1:
        raise ConvertError(f"config.json: decoder_sparse_step={step!r} is not supported (maxtrain's Qwen3-MoE "
                           f"layers are all sparse: 1)")
    if config.get("mlp_only_layers"):
        raise ConvertError(f"config.json: mlp_only_layers={config['mlp_only_layers']!r} is not supported "
                           f"(maxtrain's Qwen3-MoE layers are all sparse: [])")
    norm_topk = config.get("norm_topk_prob")
    if not isinstance(norm_topk, bool):
        raise ConvertError(f"config.json: norm_topk_prob={norm_topk!r} is not true or false")
    return keys | {"use_qk_norm": True, "base_moe_mlp_dim": hf.positive_int(config, "moe_intermediate_size"),
                   "norm_topk_prob": norm_topk}


def _config(m: Keys, kind: str, config: dict) -> dict:
    # transformers 5 reads either name (and writes the second); older ones the first
    names = [name for name in ("num_experts", "num_local_experts") if name == "num_experts" or name in config]
    return {name: m["num_experts"] for name in names} | {
        "moe_intermediate_size": moe_width(m), "norm_topk_prob": m["norm_topk_prob"],
        "num_experts_per_tok": m["num_experts_per_tok"], "router_aux_loss_coef": m["load_balance_loss_weight"]}


HF = HFMapping(
    types={"qwen3_moe": HFType("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"max_position_embeddings": 32768} | hf.COMMON | dict(
        zip(hf.SHAPE, (151936, 2048, 6144, 24, 32, 4))) | {
        "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096, "decoder_sparse_step": 1,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": False,
        "router_aux_loss_coef": 0.001, "mlp_only_layers": None, "bos_token_id": None, "eos_token_id": None},
        fresh={"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
               "decoder_sparse_step": 1, "mlp_only_layers": []})},
    keys=_keys,
    config=_config,
    mlp_tensors=lambda m, fused: MoE.from_config(m).hf_tensors(
        m["base_emb_dim"], fused, "mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight"),
    sliding_window=_sliding_window,
)

SPEC = register(ModelSpec(name="qwen3_moe", matches=lambda m: m["num_experts"] > 1 and m["use_qk_norm"],
                          hf_kind=lambda m: "qwen3_moe", hf=HF, **decoder_spec.spec_parts()))
