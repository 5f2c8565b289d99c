"""GQA self-attention: q/k/v projections (optional biases, optional q/k norms), RoPE, the attention the
plan runs, and the output projection.

Shape suffixes: B batch, L length, D embed, H query heads, N kv heads, G query heads per kv head,
K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import remat
from maxtrain.models.args import ModelArgs
from maxtrain.models.layers import RMSNorm, bias, dense_weight, rope
from maxtrain.parallel.rules import constrain


class Attention(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, cache=None):
        """(output [B,L,D], `cache` with this call's keys and values written; None in training)."""
        a = self.args
        wq_DxHxK = dense_weight(self, "wq", (a.embed, a.heads, a.head_dim), ("embed", "heads", "head_dim"))
        wk_DxNxK = dense_weight(self, "wk", (a.embed, a.kv_heads, a.head_dim), ("embed", "kv_heads", "head_dim"))
        wv_DxNxK = dense_weight(self, "wv", (a.embed, a.kv_heads, a.head_dim), ("embed", "kv_heads", "head_dim"))
        wo_HxKxD = dense_weight(self, "wo", (a.heads, a.head_dim, a.embed), ("heads", "head_dim", "embed"), (0, 1))

        q = jnp.einsum("bld,dhk->blhk", x_BxLxD, wq_DxHxK)
        k = jnp.einsum("bld,dnk->blnk", x_BxLxD, wk_DxNxK)
        v = jnp.einsum("bld,dnk->blnk", x_BxLxD, wv_DxNxK)
        if a.qkv_bias:  # Qwen2
            q = q + bias(self, "bq", (a.heads, a.head_dim), ("heads", "head_dim"))
            k = k + bias(self, "bk", (a.kv_heads, a.head_dim), ("kv_heads", "head_dim"))
            v = v + bias(self, "bv", (a.kv_heads, a.head_dim), ("kv_heads", "head_dim"))
        if a.qk_norm:  # Qwen3
            q = RMSNorm(a, a.head_dim, name="q_norm")(q)
            k = RMSNorm(a, a.head_dim, name="k_norm")(k)
        q, k, v = (checkpoint_name(q, remat.QUERY), checkpoint_name(k, remat.KEY),
                   checkpoint_name(v, remat.VALUE))
        q_BxLxHxK = constrain(rope(q, positions_BxL, a.rope_theta, a.rope_scaling),
                              ("batch", "length", "heads", "head_dim"))
        k_BxLxNxK = constrain(rope(k, positions_BxL, a.rope_theta, a.rope_scaling),
                              ("batch", "length", "kv_heads", "head_dim"))
        v_BxLxNxK = constrain(v, ("batch", "length", "kv_heads", "head_dim"))

        if cache is None:
            ctx_BxLxHxK = a.plan.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL)
        else:  # decoding: a layer's view of the KV cache (maxtrain.infer.kv_cache) writes and attends
            ctx_BxLxHxK, cache = cache.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL,
                                              a.plan.attend)
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, remat.CONTEXT)
        return checkpoint_name(jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, wo_HxKxD), remat.OUT), cache

