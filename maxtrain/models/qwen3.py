"""Qwen3 (dense): maxtrain's decoder with an RMSNorm over each head's q and k before RoPE, no biases, and
a head_dim of its own (128 whatever hidden_size / heads); the small models tie their embeddings. HF:
Qwen3ForCausalLM, its q/k norms self_attn.q_norm / k_norm [head_dim], the rest named as Llama's. It
narrows the dense family (llama.py): every dense config with q/k norms is Qwen3's."""

from __future__ import annotations

from maxtrain.runtime.errors import ConvertError
from maxtrain.models import decoder_spec, hf
from maxtrain.models.registry import HFMapping, HFType, Keys, ModelSpec, register


def _hf_kind(m: Keys) -> str:
    if m["qkv_bias"]:  # HF's attention_bias biases o_proj too
        raise ConvertError("qkv_bias=true: Qwen3 has no q/k/v biases (its attention_bias also biases o_proj, "
                           "which maxtrain lacks; HF export needs false)")
    return "qwen3"


HF = HFMapping(
    types={"qwen3": HFType("Qwen3ForCausalLM", "Qwen3Config", {"max_position_embeddings": 32768} | hf.COMMON | dict(
        zip(hf.SHAPE, (151936, 4096, 22016, 32, 32, 32))) | {
        "head_dim": 128, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None, "bos_token_id": None, "eos_token_id": None},
        fresh={"attention_bias": False, "use_sliding_window": False, "sliding_window": None})},
    keys=lambda config, kind: {"qkv_bias": False, "use_qk_norm": True, "num_experts": 1},
    config=lambda m, kind, config: {},
    sliding_window=hf.layered_sliding_window,  # as Qwen2's: only where a layer uses it
)

SPEC = register(ModelSpec(name="qwen3", matches=lambda m: m["num_experts"] == 1 and m["use_qk_norm"],
                          hf_kind=_hf_kind, hf=HF, priority=1, **decoder_spec.spec_parts()))
