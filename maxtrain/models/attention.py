"""GQA self-attention: q/k/v projections (optional biases, optional q/k norms), RoPE, the attention the
plan runs, and the output projection (optional bias). A layer that slides (parts.Window) attends
within the window, with the sliding layers' RoPE; attention sinks, a scale of the family's own and a
soft cap on the scores go to every kernel as an attention.Variant.

Shape suffixes: B batch, L length, D embed, H query heads, N kv heads, G query heads per kv head,
K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.parallel import remat
from maxtrain.models.args import ModelArgs
from maxtrain.models.layers import RMSNorm, bias, dense_weight
from maxtrain.models.rope import rope
from maxtrain.ops.attention import Variant
from maxtrain.parallel.rules import constrain


def projections(module: nn.Module):
    """GQA's q, k, v [D, heads, K] and output [H, K, D] weights, as parameters of `module` (whose args' attention
    part is GQA or a family's extension of it: llama4.py)."""
    a, at = module.args, module.args.attention
    h, n, hd = at.heads, at.kv_heads, at.head_dim
    return (dense_weight(module, "wq", (a.embed, h, hd), ("embed", "heads", "head_dim")),
            dense_weight(module, "wk", (a.embed, n, hd), ("embed", "kv_heads", "head_dim")),
            dense_weight(module, "wv", (a.embed, n, hd), ("embed", "kv_heads", "head_dim")),
            dense_weight(module, "wo", (h, hd, a.embed), ("heads", "head_dim", "embed"), (0, 1)))


class Attention(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, layer=None, cache=None):
        """(output [B,L,D], `cache` with this call's keys and values written; None in training). `layer`:
        this layer's index in the model (an int, or a traced one in a scanned stack), where some layers
        slide and some do not."""
        a, at = self.args, self.args.attention
        h, n, hd = at.heads, at.kv_heads, at.head_dim
        wq_DxHxK, wk_DxNxK, wv_DxNxK, wo_HxKxD = projections(self)

        q = jnp.einsum("bld,dhk->blhk", x_BxLxD, wq_DxHxK)
        k = jnp.einsum("bld,dnk->blnk", x_BxLxD, wk_DxNxK)
        v = jnp.einsum("bld,dnk->blnk", x_BxLxD, wv_DxNxK)
        if at.qkv_bias:
            q = q + bias(self, "bq", (h, hd), ("heads", "head_dim"))
            k = k + bias(self, "bk", (n, hd), ("kv_heads", "head_dim"))
            v = v + bias(self, "bv", (n, hd), ("kv_heads", "head_dim"))
        if at.qk_norm:
            q = RMSNorm(a, hd, name="q_norm")(q)
            k = RMSNorm(a, hd, name="k_norm")(k)
        sinks_H = None
        if at.sinks:  # float32, as the softmax it joins
            sinks_H = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)),
                                 (h,), jnp.float32)
        q, k, v = (checkpoint_name(q, remat.QUERY), checkpoint_name(k, remat.KEY),
                   checkpoint_name(v, remat.VALUE))

        window = at.window

        def attend(slides: bool, q, k, v, cache):
            r = window.rope if slides else a.rope
            q_BxLxHxK = constrain(rope(q, positions_BxL, r), ("batch", "length", "heads", "head_dim"))
            k_BxLxNxK = constrain(rope(k, positions_BxL, r), ("batch", "length", "kv_heads", "head_dim"))
            v_BxLxNxK = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
            variant = Variant(window=window.size if slides else 0, scale=at.scale, softcap=at.softcap)
            if cache is None:
                return a.plan.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, variant,
                                     sinks_H), None
            # decoding: a layer's view of the KV cache (maxtrain.infer.kv_cache) writes and attends
            return cache.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, a.plan.attend,
                                variant, sinks_H)

        if not at.layered:
            ctx_BxLxHxK, cache = attend(window is not None, q, k, v, cache)
        elif isinstance(layer, int):
            ctx_BxLxHxK, cache = attend(window.slides(layer), q, k, v, cache)
        else:  # a scanned stack: each layer's kind from its index, both kinds compiled
            if cache is not None:
                raise ValueError("decoding runs unrolled layers, each knowing its index")
            global_layer = (layer + 1) % window.global_interval == 0
            ctx_BxLxHxK = jax.lax.cond(global_layer, lambda *x: attend(False, *x, None)[0],
                                       lambda *x: attend(True, *x, None)[0], q, k, v)
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, remat.CONTEXT)
        out_BxLxD = jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, wo_HxKxD)
        if at.out_bias:
            out_BxLxD = out_BxLxD + bias(self, "bo", (a.embed,), ("embed",))
        return checkpoint_name(out_BxLxD, remat.OUT), cache
