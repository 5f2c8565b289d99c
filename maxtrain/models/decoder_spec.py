"""What every family here shares: maxtrain's decoder (maxtrain.models.decoder: RMSNorm, RoPE, GQA attention with
optional q/k/v biases and q/k norms, SwiGLU or a mixture of experts) and the facts that follow from its
shape. A family module builds its ModelSpec from these and adds what is its own (which configs are
its, its HF names). The counts are checked against the built modules and transformers in
tests/test_registry.py.
"""

from __future__ import annotations

from typing import Any

from maxtrain.models.args import ModelArgs
from maxtrain.models.decoder import Decoder
from maxtrain.models import stacks as stacks_lib
from maxtrain.models.args import moe_width
from maxtrain.models.registry import Keys

# Norm scales, attention biases and the MoE balancing bias take no weight decay; the balancing bias is
# moved by the train step's rule (moe.update_router_bias), never by the optimizer.
NOT_DECAYED = ("scale", "bq", "bk", "bv", "bo", "sinks", "router_bias")
NOT_TRAINED = ("router_bias",)


def args(c) -> ModelArgs:
    return ModelArgs.from_config(c)


def build(c) -> Decoder:
    return Decoder(ModelArgs.from_config(c))


def _layer_counts(m: Keys) -> tuple[int, int]:
    """(dense layers, MoE layers)."""
    dense = sum(s.count for s in stacks_lib.for_keys(m) if not s.moe)
    return dense, m["base_num_decoder_layers"] - dense


def _mla_params(m: Keys) -> int:
    """Multi-head latent attention's projections and latent norms (maxtrain.models.mla)."""
    d, h, q, c = m["base_emb_dim"], m["base_num_query_heads"], m["q_lora_rank"], m["kv_lora_rank"]
    k, r, j = m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
    queries = d * q + q + q * h * k if q else d * h * k
    return queries + d * (c + r) + c + c * h * (m["qk_nope_head_dim"] + j) + h * j * d


def count_params(m: Keys, active: bool = False) -> int:
    """Parameters of the model (multi-token prediction's depths included), the padding of the vocabulary
    left out; `active`: those a token uses, i.e. of the routed experts only its top-k (the FLOPs count
    these, as MaxText's), and no balancing bias."""
    d, h, kv, hd = m["base_emb_dim"], m["base_num_query_heads"], m["base_num_kv_heads"], m["head_dim"]
    attention = (_mla_params(m) if m["attention_type"] == "mla" else d * hd * (2 * h + 2 * kv)) + 2 * d
    attention += hd * (h + 2 * kv) if m["qkv_bias"] else 0
    attention += 2 * hd if m["use_qk_norm"] else 0
    attention += d * (m["use_post_attn_norm"] + m["use_post_ffw_norm"])  # sandwich norms
    attention += (h if m["attention_sinks"] else 0) + (d if m["attention_out_bias"] else 0)  # gpt-oss
    mlp_bias = (lambda width: 2 * width + d) if m["mlp_bias"] else (lambda width: 0)  # noqa: E731  gate, up, down
    dense_layers, moe_layers = _layer_counts(m)
    moe = 0
    if moe_layers:
        f = moe_width(m)
        routed = m["num_experts_per_tok"] if active else m["num_experts"]
        moe = d * m["num_experts"] + 3 * d * f * (routed + m["shared_experts"])
        moe += m["num_experts"] if m["routed_bias"] and not active else 0
        moe += m["num_experts"] if m["router_logit_bias"] else 0
        moe += routed * mlp_bias(f) + (mlp_bias(m["shared_experts"] * f) if m["shared_experts"] else 0)
    embeddings = m["vocab_size"] * d * (1 if m["logits_via_embedding"] else 2)
    dense_mlp = 3 * d * m["base_mlp_dim"] + mlp_bias(m["base_mlp_dim"])
    # each depth: its two input norms, the [2D, D] projection, a layer like the last, its output norm
    depth = 3 * d + 2 * d * d + attention + (moe if moe_layers else dense_mlp)
    return (dense_layers * (attention + dense_mlp) + moe_layers * (attention + moe) + embeddings + d
            + m["mtp_num_layers"] * depth)


def flops_per_token(m: Keys, length: int, causal: bool = True, active: bool = True) -> float:
    """Matmul FLOPs of one token's forward pass in a sequence of `length` (MaxText's formula: 2 x
    multiply-adds of every projection, plus attention scores and context). An MoE layer counts its
    router and the experts a token uses (top-k and shared; with active=False, every expert)."""
    d, h, kv, hd = m["base_emb_dim"], m["base_num_query_heads"], m["base_num_kv_heads"], m["head_dim"]
    f = m["base_mlp_dim"]
    projections = 2 * d * hd * (h + 2 * kv) + 2 * d * hd * h
    score_width, value_width = hd, hd  # a head's query/key width and its value width
    if m["attention_type"] == "mla":
        projections = 2 * (_mla_params(m) - m["q_lora_rank"] - m["kv_lora_rank"])  # the norms do no matmul
        score_width, value_width = m["qk_nope_head_dim"] + m["qk_rope_head_dim"], m["v_head_dim"]
    layers = m["base_num_decoder_layers"]
    window, every = m["sliding_window_size"], m["global_layer_interval"]
    sliding = 0 if not window else layers - (layers // every if every else 0)
    # QK^T and PV, per token: keys seen per query, on average, by a global layer and by a sliding one
    seen_global = length * (0.5 if causal else 1.0)
    seen_sliding = seen_global if not window or length <= window else (
        window * (length - window / 2) / length if causal else min(length, 2 * window - 1))
    attention = (2 * h * (score_width + value_width) * ((layers - sliding) * seen_global + sliding * seen_sliding)
                 / layers)
    dense, moe = _layer_counts(m)
    routed = m["num_experts_per_tok"] if active else m["num_experts"]
    experts = 2 * 3 * d * moe_width(m) * (routed + m["shared_experts"]) + 2 * d * m["num_experts"]
    # multi-token prediction: each depth's projection, its layer (global attention) and its logits
    depth = (2 * 2 * d * d + projections + 2 * h * (score_width + value_width) * seen_global
             + (experts if moe else 2 * 3 * d * f) + 2 * d * m["vocab_size"])
    return (dense * (projections + attention + 2 * 3 * d * f) + moe * (projections + attention + experts)
            + 2 * d * m["vocab_size"] + m["mtp_num_layers"] * depth)


def quantization_paths(c) -> dict[str, str]:
    """The module-path regex of each quantization target. An MoE model's routed experts run through
    grouped-matmul kernels Qwix does not intercept: `mlp` there quantizes the leading dense layers' MLPs
    and the shared experts (`<stack>/mlp/shared`). Under a pipeline the last stack's layers run as modules
    of their own (a function of each layer's parameters), whose paths start at the layer: `attention`."""
    paths = {"attention": r"([^/]+/)?attention"}
    stacks = stacks_lib.for_keys(c)
    pipelined = c["ici_pipeline_parallelism"] * c["dcn_pipeline_parallelism"] > 1
    dense: list[str] = []
    for s in stacks:
        if not s.moe:
            # pipelined: rooted at the layer in training, the stack's path in generate (which runs it in order)
            prefix = f"(?:{s.name}/)?" if pipelined and s is stacks[-1] else f"{s.name}/"
            dense += [prefix] if c["scan_layers"] else [f"{stacks_lib.unrolled(i)}/" for i in s.layers]
    shared = [r"([^/]+/)?mlp/shared"] if c["num_experts"] > 1 else []
    paths["mlp"] = "|".join([f"{prefix}mlp" for prefix in dense] + shared)
    return paths


def spec_parts(**extra: Any) -> dict[str, Any]:
    """ModelSpec fields for maxtrain's decoder; a family adds its name, predicate and HF side."""
    return dict(args=args, build=build, stacks=stacks_lib.for_keys, count_params=count_params,
                flops_per_token=flops_per_token, quantization_paths=quantization_paths,
                not_decayed=NOT_DECAYED, not_trained=NOT_TRAINED) | extra
