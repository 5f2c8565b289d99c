"""GQA self-attention: q/k/v projections (optional biases, optional q/k norms), RoPE, the attention the
plan runs, and the output projection (optional bias). A layer that slides (ModelArgs.slides) attends
within the window, with the sliding layers' RoPE; attention sinks, a scale of the family's own and a
soft cap on the scores go to every kernel as an attention.Variant.

Shape suffixes: B batch, L length, D embed, H query heads, N kv heads, G query heads per kv head,
K head dim, F mlp, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.parallel import remat
from maxtrain.models.hf_layout import Tensor, same
from maxtrain.models.layers import RMSNorm, bias, dense_weight
from maxtrain.models.rope import rope
from maxtrain.ops.attention import Variant
from maxtrain.parallel.rules import constrain

if TYPE_CHECKING:
    from maxtrain.models.args import ModelArgs


@dataclasses.dataclass(frozen=True)
class GQA:
    """Grouped-query attention: `heads` query heads sharing `kv_heads` key/value heads of `head_dim`."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # the scores' scale: (query_pre_attn_scalar, or head_dim) ** -0.5
    qkv_bias: bool = False  # Qwen2, gpt-oss
    out_bias: bool = False  # gpt-oss
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sinks: bool = False  # a learned logit per head in the softmax's denominator (gpt-oss)
    softcap: float = 0.0  # scores -> cap x tanh(scores / cap) (Gemma 2); 0 = none

    @classmethod
    def from_config(cls, c) -> "GQA":
        return cls(c["base_num_query_heads"], c["base_num_kv_heads"], c["head_dim"],
                   (c["query_pre_attn_scalar"] or c["head_dim"]) ** -0.5, c["qkv_bias"], c["attention_out_bias"],
                   c["use_qk_norm"], c["attention_sinks"], c["attn_logit_softcapping"])

    @property
    def qk_head_dim(self) -> int:
        return self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.head_dim

    def params(self, embed: int) -> int:
        h, n, k = self.heads, self.kv_heads, self.head_dim
        return (embed * k * (2 * h + 2 * n) + (k * (h + 2 * n) if self.qkv_bias else 0) + (2 * k if self.qk_norm else 0)
                + (h if self.sinks else 0) + (embed if self.out_bias else 0))

    def projection_flops(self, embed: int) -> float:
        """Matmul FLOPs per token of the q/k/v and output projections."""
        return 2 * embed * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def cache_layout(self) -> tuple[int, int, int]:
        """A decoding cache's (rows per sequence, key width, value width): the kv heads."""
        return self.kv_heads, self.head_dim, self.head_dim

    def hf_tensors(self, embed: int) -> list[Tensor]:
        """HF's self_attn projections, and its q/k norms, biases and sinks where the model has them."""
        d, h, n, k = embed, self.heads, self.kv_heads, self.head_dim

        def heads_out(count):  # [count*K, D] <-> [D, count, K]
            return (lambda x: x.T.reshape(d, count, k)), (lambda w: w.reshape(d, count * k).T)

        def bias(count):  # [count*K] <-> [count, K]
            return (lambda x: x.reshape(count, k)), (lambda w: w.reshape(count * k))

        tensors = [
            Tensor(("attention", "wq"), "self_attn.q_proj.weight", (h * k, d), *heads_out(h)),
            Tensor(("attention", "wk"), "self_attn.k_proj.weight", (n * k, d), *heads_out(n)),
            Tensor(("attention", "wv"), "self_attn.v_proj.weight", (n * k, d), *heads_out(n)),
            Tensor(("attention", "wo"), "self_attn.o_proj.weight", (d, h * k),
                   lambda x: x.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T),
        ]
        if self.qk_norm:
            tensors += [Tensor(("attention", "q_norm", "scale"), "self_attn.q_norm.weight", (k,), same, same),
                        Tensor(("attention", "k_norm", "scale"), "self_attn.k_norm.weight", (k,), same, same)]
        if self.qkv_bias:
            tensors += [Tensor(("attention", "bq"), "self_attn.q_proj.bias", (h * k,), *bias(h)),
                        Tensor(("attention", "bk"), "self_attn.k_proj.bias", (n * k,), *bias(n)),
                        Tensor(("attention", "bv"), "self_attn.v_proj.bias", (n * k,), *bias(n))]
        if self.out_bias:
            tensors.append(Tensor(("attention", "bo"), "self_attn.o_proj.bias", (d,), same, same))
        if self.sinks:
            tensors.append(Tensor(("attention", "sinks"), "self_attn.sinks", (h,), same, same))
        return tensors


class Attention(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, layer=None, cache=None):
        """(output [B,L,D], `cache` with this call's keys and values written; None in training). `layer`:
        this layer's index in the model (an int, or a traced one in a scanned stack), where some layers
        slide and some do not."""
        a, at = self.args, self.args.attention
        h, n, hd = at.heads, at.kv_heads, at.head_dim
        wq_DxHxK = dense_weight(self, "wq", (a.embed, h, hd), ("embed", "heads", "head_dim"))
        wk_DxNxK = dense_weight(self, "wk", (a.embed, n, hd), ("embed", "kv_heads", "head_dim"))
        wv_DxNxK = dense_weight(self, "wv", (a.embed, n, hd), ("embed", "kv_heads", "head_dim"))
        wo_HxKxD = dense_weight(self, "wo", (h, hd, a.embed), ("heads", "head_dim", "embed"), (0, 1))

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

        def attend(slides: bool, q, k, v, cache):
            r = a.local_rope if slides else a.rope
            q_BxLxHxK = constrain(rope(q, positions_BxL, r), ("batch", "length", "heads", "head_dim"))
            k_BxLxNxK = constrain(rope(k, positions_BxL, r), ("batch", "length", "kv_heads", "head_dim"))
            v_BxLxNxK = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
            variant = Variant(window=a.window if slides else 0, scale=at.scale, softcap=at.softcap)
            if cache is None:
                return a.plan.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, variant,
                                     sinks_H), None
            # decoding: a layer's view of the KV cache (maxtrain.infer.kv_cache) writes and attends
            return cache.attend(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL, a.plan.attend,
                                variant, sinks_H)

        if not a.patterned:
            ctx_BxLxHxK, cache = attend(a.window > 0, q, k, v, cache)
        elif isinstance(layer, int):
            ctx_BxLxHxK, cache = attend(a.slides(layer), q, k, v, cache)
        else:  # a scanned stack: each layer's kind from its index, both kinds compiled
            if cache is not None:
                raise ValueError("decoding runs unrolled layers, each knowing its index")
            global_layer = (layer + 1) % a.global_interval == 0
            ctx_BxLxHxK = jax.lax.cond(global_layer, lambda *x: attend(False, *x, None)[0],
                                       lambda *x: attend(True, *x, None)[0], q, k, v)
        ctx_BxLxHxK = checkpoint_name(ctx_BxLxHxK, remat.CONTEXT)
        out_BxLxD = jnp.einsum("blhk,hkd->bld", ctx_BxLxHxK, wo_HxKxD)
        if at.out_bias:
            out_BxLxD = out_BxLxD + bias(self, "bo", (a.embed,), ("embed",))
        return checkpoint_name(out_BxLxD, remat.OUT), cache
