"""Mixtral: every layer a mixture of experts, softmax over all experts, top-k, renormalised; no q/k
norms. HF: block_sparse_moe.gate [E, D] and block_sparse_moe.experts.<e>.w1 / w3 [F, D] (gate, up),
w2 [D, F] (down); its experts are intermediate_size wide."""

from __future__ import annotations

from maxtrain.runtime.errors import ConvertError
from maxtrain.models.parts import MoE, moe_width
from maxtrain.models import decoder_spec, hf
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register


def _hf_kind(m: Keys) -> str:
    if not m["norm_topk_prob"]:
        raise ConvertError("norm_topk_prob=false: Mixtral always renormalises its top-k weights (Qwen3-MoE, "
                           "which need not, has q/k norms: use_qk_norm=true)")
    return "mixtral"


def _keys(config: dict, kind: str) -> dict:
    return hf.moe_keys(config, kind, "num_local_experts") | {
        "use_qk_norm": False, "base_moe_mlp_dim": -1, "norm_topk_prob": True}


def _config(m: Keys, kind: str, config: dict) -> dict:
    # its experts are intermediate_size wide (the model's base_mlp_dim, if another, shapes nothing)
    return {"num_local_experts": m["num_experts"], "num_experts_per_tok": m["num_experts_per_tok"],
            "router_aux_loss_coef": m["load_balance_loss_weight"], "intermediate_size": moe_width(m)}


HF = HFMapping(
    types={"mixtral": HFType("MixtralForCausalLM", "MixtralConfig", {"max_position_embeddings": 131072} | hf.COMMON | dict(
        zip(hf.SHAPE, (32000, 4096, 14336, 32, 32, 8))) | {
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "head_dim": None, "sliding_window": None,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001,
        "bos_token_id": 1, "eos_token_id": 2}, fresh={"sliding_window": None})},
    keys=_keys,
    config=_config,
    mlp_tensors=lambda m, fused: MoE.from_config(m).hf_tensors(
        m["base_emb_dim"], fused, "block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    windowed=True,
    expresses=("sliding_window_size",),
)

SPEC = register(ModelSpec(name="mixtral", matches=lambda m: m["num_experts"] > 1 and not m["use_qk_norm"],
                          hf_kind=_hf_kind, hf=HF, **decoder_spec.spec_parts()))
