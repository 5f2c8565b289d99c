"""What every family here shares: maxtrain's decoder (maxtrain.models.decoder: RMSNorm, RoPE, GQA attention with
optional q/k/v biases and q/k norms, SwiGLU or a mixture of experts) and the facts that follow from its
shape: the counts are each part's (maxtrain.models.args.ModelArgs's), summed over the layers. A family module
builds its ModelSpec from these and adds what is its own (which configs are its, its HF names). The counts are
checked against the built modules and transformers in tests/test_registry.py.
"""

from __future__ import annotations

from typing import Any

from maxtrain.models.args import ModelArgs, attention_of
from maxtrain.models.decoder import Decoder
from maxtrain.models import stacks as stacks_lib
from maxtrain.models.parts import GatedMLP, MoE, Norm, Vocabulary
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
    moe = sum(s.moe_layers for s in stacks_lib.for_keys(m))
    return m["base_num_decoder_layers"] - moe, moe


def count_params(m: Keys, active: bool = False) -> int:
    """Parameters of the model (multi-token prediction's depths included), the padding of the vocabulary
    left out; `active`: those a token uses, i.e. of the routed experts only its top-k (the FLOPs count
    these, as MaxText's), and no balancing bias. Each part counts its own."""
    d, attention, mlp, moe = m["base_emb_dim"], attention_of(m), GatedMLP.from_config(m), MoE.from_config(m)
    block = attention.params(d) + Norm.from_config(m).params(d)  # a layer's attention and its norms
    dense_layers, moe_layers = _layer_counts(m)
    experts = moe.params(d, active) if moe_layers else 0
    embeddings = Vocabulary.from_config(m).params(d)
    # each depth: its two input norms, the [2D, D] projection, a layer like the last, its output norm
    depth = 3 * d + 2 * d * d + block + (experts if moe_layers else mlp.params(d))
    return (dense_layers * (block + mlp.params(d)) + moe_layers * (block + experts) + embeddings + d
            + m["mtp_num_layers"] * depth)


def flops_per_token(m: Keys, length: int, causal: bool = True, active: bool = True) -> float:
    """Matmul FLOPs of one token's forward pass in a sequence of `length` (MaxText's formula: 2 x
    multiply-adds of every projection, plus attention scores and context). An MoE layer counts its
    router and the experts a token uses (top-k and shared; with active=False, every expert)."""
    d, attention, mlp, moe = m["base_emb_dim"], attention_of(m), GatedMLP.from_config(m), MoE.from_config(m)
    projections = attention.projection_flops(d)
    layers = m["base_num_decoder_layers"]
    window, every = m["sliding_window_size"], m["global_layer_interval"]
    sliding = 0 if not window else layers - (layers // every if every else 0)
    # QK^T and PV, per token: keys seen per query, on average, by a global layer and by a sliding one
    seen_global = length * (0.5 if causal else 1.0)
    seen_sliding = seen_global if not window or length <= window else (
        window * (length - window / 2) / length if causal else min(length, 2 * window - 1))
    per_key = 2 * attention.heads * (attention.qk_head_dim + attention.v_head_dim)
    attend = per_key * ((layers - sliding) * seen_global + sliding * seen_sliding) / layers
    dense_layers, moe_layers = _layer_counts(m)
    experts = moe.flops(d, active) if moe_layers else 0
    # multi-token prediction: each depth's projection, its layer (global attention) and its logits
    depth = (2 * 2 * d * d + projections + per_key * seen_global + (experts if moe_layers else mlp.flops(d))
             + 2 * d * m["vocab_size"])
    return (dense_layers * (projections + attend + mlp.flops(d)) + moe_layers * (projections + attend + experts)
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
        for sub, moe, layers in s.positions():
            if moe:
                continue
            # pipelined: rooted at the layer in training, the stack's path in generate (which runs it in order)
            prefix = f"(?:{s.name}/)?" if pipelined and s is stacks[-1] else f"{s.name}/{sub}/" if sub else f"{s.name}/"
            dense += [prefix] if c["scan_layers"] else [f"{stacks_lib.unrolled(i)}/" for i in layers]
    shared = [r"([^/]+/)?mlp/shared"] if c["num_experts"] > 1 else []
    paths["mlp"] = "|".join([f"{prefix}mlp" for prefix in dense] + shared)
    return paths


def spec_parts(**extra: Any) -> dict[str, Any]:
    """ModelSpec fields for maxtrain's decoder; a family adds its name, predicate and HF side."""
    return dict(args=args, build=build, stacks=stacks_lib.for_keys, count_params=count_params,
                flops_per_token=flops_per_token, quantization_paths=quantization_paths,
                not_decayed=NOT_DECAYED, not_trained=NOT_TRAINED) | extra
