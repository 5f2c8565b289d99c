"""The decoder's arguments: the model keys a layer reads, in the units it uses, and the execution plan it
runs under (how, not what: kernels, chunks, remat)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from maxtrain.config.keys import padded_vocab
from maxtrain.config.resolve import Resolved
from maxtrain.models import quantization, stacks as stacks_lib
from maxtrain.parallel.plan import Plan


@dataclasses.dataclass(frozen=True)
class ModelArgs:
    vocab: int  # the true vocabulary; the parameters hold padded_vocab(vocab) entries
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    layers: int
    rope_theta: float
    rope_scaling: tuple  # (factor, low_freq_factor, high_freq_factor, original length); factor 1 = none
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
    plan: Plan  # how the layers run: kernels, chunks, remat, the scan's unroll (maxtrain.parallel.plan)

    @classmethod
    def from_config(cls, c) -> "ModelArgs":
        return cls(
            vocab=c.vocab_size, embed=c.base_emb_dim, heads=c.base_num_query_heads,
            kv_heads=c.base_num_kv_heads, head_dim=c.head_dim, mlp=c.base_mlp_dim,
            layers=c.base_num_decoder_layers, rope_theta=c.rope_theta,
            rope_scaling=(c.rope_scaling_factor, c.rope_low_freq_factor, c.rope_high_freq_factor,
                          c.rope_original_max_position_embeddings),
            norm_eps=c.normalization_layer_epsilon, tied_embeddings=c.logits_via_embedding,
            qkv_bias=c.qkv_bias, dtype=jnp.dtype(c.dtype), weight_dtype=jnp.dtype(c.weight_dtype),
            scan_layers=c.scan_layers, logits_dot_in_fp32=c.logits_dot_in_fp32, qk_norm=c.use_qk_norm,
            quantized_mlp="mlp" in quantization.targets(c),
            num_experts=c.num_experts, experts_per_token=c.num_experts_per_tok, moe_mlp=c.moe_mlp_dim,
            shared_experts=c.shared_experts, first_dense_layers=c.first_num_dense_layers,
            capacity_factor=c.capacity_factor, routed_score_func=c.routed_score_func,
            norm_topk_prob=c.norm_topk_prob, routed_bias=c.routed_bias,
            routed_scaling_factor=c.routed_scaling_factor,
            plan=Plan.from_resolved(c) if isinstance(c, Resolved) else Plan.single_device(c))

    @property
    def padded_vocab(self) -> int:
        return padded_vocab(self.vocab)

    def stacks(self) -> list[tuple[str, int, bool]]:
        """(name, layers, is MoE) of each layer stack (maxtrain.models.stacks names them)."""
        return [(s.name, s.count, s.moe) for s in stacks_lib.stacks(self.layers, self.num_experts,
                                                                     self.first_dense_layers)]

