"""The decoder's arguments: the model keys a layer reads, in the units it uses, and the execution plan it
runs under (how, not what: kernels, chunks, remat)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from maxtrain.models import quantization, stacks as stacks_lib
from maxtrain.models.rope import Rope
from maxtrain.parallel.plan import Plan

# The embedding and output matrices hold the vocabulary padded to a multiple of this (Megatron's default
# make_vocab_size_divisible_by), so a tensor axis of up to 128 splits them evenly whatever the true size
# (32001, 50257). A multiple that does not depend on the mesh keeps the checkpoint's shapes the same on
# every mesh: a run resumes on another. The padded entries' logits are masked (loss) or cut (logits).
VOCAB_MULTIPLE = 128


def moe_width(m) -> int:
    """Each expert's SwiGLU width: base_moe_mlp_dim, where -1 means base_mlp_dim."""
    return m["base_mlp_dim"] if m["base_moe_mlp_dim"] == -1 else m["base_moe_mlp_dim"]


def padded_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    vocab: int  # the true vocabulary; the parameters hold padded_vocab(vocab) entries
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    rope: Rope  # every layer's, or the global layers' where some slide
    local_rope: Rope  # sliding layers'
    window: int  # a sliding layer's query sees the keys at distance < window; 0 = no layer slides
    global_interval: int  # with a window, every Nth layer is global; 0 = all slide
    query_scale: float  # attention scores' scale (head_dim ** -0.5 unless the family says)
    sinks: bool  # a learned logit per head in the softmax's denominator (gpt-oss)
    attn_softcap: float  # scores -> cap x tanh(scores / cap); 0 = none
    final_softcap: float  # the same for the logits
    attention_out_bias: bool
    scale_embedding: bool  # embeddings x sqrt(embed) (Gemma)
    norm_plus_one: bool  # RMSNorm scales by (1 + scale) (Gemma)
    post_attn_norm: bool  # sandwich norms (Gemma)
    post_ffw_norm: bool
    mlp_activation: str  # silu | gelu_tanh | clamped_swiglu
    mlp_activation_limit: float
    mlp_bias: bool
    router_logit_bias: bool
    norm_eps: float
    tied_embeddings: bool
    qkv_bias: bool
    dtype: Any
    weight_dtype: Any
    scan_layers: bool
    logits_dot_in_fp32: bool
    qk_norm: bool  # RMSNorm over each head of q and k before RoPE (Qwen3)
    quantized_mlp: bool  # maxtrain.models.quantization quantizes MLPs: their matmuls as jnp.einsum, which Qwix intercepts
    # Mixture of experts (maxtrain.models.moe); num_experts 1 = a dense model
    num_experts: int
    experts_per_token: int
    moe_mlp: int
    shared_experts: int
    first_dense_layers: int
    capacity_factor: float
    routed_score_func: str
    norm_topk_prob: bool
    routed_bias: bool
    routed_scaling_factor: float
    # DeepSeek's multi-head latent attention (maxtrain.models.mla) in place of GQA
    mla: bool
    q_lora_rank: int  # 0 = a full query projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    routing_groups: int  # group-limited routing: the experts' groups, and how many a token picks from; 0 = none
    routing_top_groups: int
    mtp_layers: int  # multi-token prediction depths (maxtrain.models.mtp); 0 = none
    plan: Plan  # how the layers run: kernels, chunks, remat, the scan's unroll (maxtrain.parallel.plan)

    @classmethod
    def from_config(cls, c) -> "ModelArgs":
        return cls(
            vocab=c.vocab_size, embed=c.base_emb_dim, heads=c.base_num_query_heads,
            kv_heads=c.base_num_kv_heads, head_dim=c.head_dim, mlp=c.base_mlp_dim,
            layers=c.base_num_decoder_layers, rope=Rope.from_config(c),
            local_rope=Rope.from_config(c, None if c.local_rope_theta == -1 else c.local_rope_theta),
            window=c.sliding_window_size, global_interval=c.global_layer_interval,
            query_scale=query_scale(c), sinks=c.attention_sinks,
            attn_softcap=c.attn_logit_softcapping, final_softcap=c.final_logit_softcapping,
            attention_out_bias=c.attention_out_bias, scale_embedding=c.scale_embedding,
            norm_plus_one=c.rms_norm_plus_one, post_attn_norm=c.use_post_attn_norm, post_ffw_norm=c.use_post_ffw_norm,
            mlp_activation=c.mlp_activation, mlp_activation_limit=c.mlp_activation_limit, mlp_bias=c.mlp_bias,
            router_logit_bias=c.router_logit_bias,
            norm_eps=c.normalization_layer_epsilon, tied_embeddings=c.logits_via_embedding,
            qkv_bias=c.qkv_bias, dtype=jnp.dtype(compute_dtype(c)), weight_dtype=jnp.dtype(c.weight_dtype),
            scan_layers=c.scan_layers, logits_dot_in_fp32=c.logits_dot_in_fp32, qk_norm=c.use_qk_norm,
            quantized_mlp="mlp" in quantization.targets(c),
            num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok, moe_mlp=c.moe_mlp_dim,
            shared_experts=c.shared_experts, first_dense_layers=c.first_num_dense_layers,
            capacity_factor=c.capacity_factor, routed_score_func=c.routed_score_func,
            norm_topk_prob=c.norm_topk_prob, routed_bias=c.routed_bias,
            routed_scaling_factor=c.routed_scaling_factor,
            mla=c.attention_type == "mla", q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
            routing_groups=max(c.n_routing_groups, 0), routing_top_groups=max(c.topk_routing_group, 0),
            mtp_layers=c.mtp_num_layers,
            plan=Plan.from_resolved(c) if "mesh_shape" in c else Plan.single_device(c))

    @property
    def qk_head_dim(self) -> int:
        """The width of a head's queries and keys (MLA: the part without RoPE and the part with it)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    def slides(self, layer: int) -> bool:
        """Whether layer `layer` (counted over the whole model) attends within the window."""
        return self.window > 0 and (self.global_interval == 0 or (layer + 1) % self.global_interval != 0)

    @property
    def patterned(self) -> bool:
        """Some layers slide and some do not: a scanned stack tells each layer its index."""
        return self.window > 0 and self.global_interval > 0

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.vocab)

    def stacks(self) -> list[tuple[str, int, bool]]:
        """(name, layers, is MoE) of each layer stack (maxtrain.models.stacks names them)."""
        return [(s.name, s.count, s.moe) for s in stacks_lib.stacks(self.layers, self.num_experts,
                                                                     self.first_dense_layers)]



def query_scale(c) -> float:
    """The attention scores' scale: (query_pre_attn_scalar, or the q/k head width) ** -0.5; with MLA under
    yarn with HF's mscale_all_dim, times m(mscale_all_dim) ** 2, as DeepSeek's attention."""
    if c.attention_type != "mla":
        return (c.query_pre_attn_scalar or c.head_dim) ** -0.5
    scale = (c.query_pre_attn_scalar or c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    return scale * Rope.from_config(c).yarn_scale(c.rope_yarn_mscale_all_dim) ** 2 if c.rope_yarn_mscale_all_dim else scale


def compute_dtype(c) -> str:
    """The config's compute dtype; dtype=auto before the devices are known (a loaded config, as unit tests
    build models from): bfloat16, the accelerators' choice (resolve picks the platform's)."""
    return "bfloat16" if c.dtype == "auto" else c.dtype
