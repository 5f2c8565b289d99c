"""Multi-head latent attention (DeepSeek-V2/V3): a drop-in for maxtrain.models.attention.Attention.

The queries come through a low-rank bottleneck (q_lora_rank; 0: one full projection); every head's keys
and values come from one compressed latent per position (kv_lora_rank, RMS-normalized) and a rotary key
part that all heads share (qk_rope_head_dim). A head's query and key are its part without RoPE and its
part with it, side by side; its value is narrower or wider (v_head_dim). Training expands the latent to
per-head keys and values and runs the plan's kernel, as GQA does. Decoding keeps only the latent and the
rotary key in the KV cache and attends in the latent space (DeepSeek-V2's weight absorption): the key
up-projection folded into the queries, the value up-projection applied after the softmax, so a cached
position costs kv_lora_rank + qk_rope_head_dim whatever the heads.

Shape suffixes as in maxtrain.models.decoder, and: Q query latent, C key/value latent, P a head's query and
key width without RoPE, R with it (K = P + R), J a head's value width.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.parallel import remat
from maxtrain.models.args import ModelArgs
from maxtrain.models.layers import RMSNorm, dense_weight
from maxtrain.models.rope import rope
from maxtrain.ops.attention import Variant, against_latent_cache
from maxtrain.parallel.rules import constrain

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms keep RMSNorm's default whatever rms_norm_eps says (as HF's)


class MLAttention(nn.Module):
    args: ModelArgs

    @nn.compact
    def __call__(self, x_BxLxD, positions_BxL, segment_ids_BxL, layer=None, cache=None):
        """(output [B,L,D], `cache` with this call's latents written; None in training)."""
        a, at = self.args, self.args.attention
        h, p, r, j, c = at.heads, at.qk_nope_head_dim, at.qk_rope_head_dim, at.v_head_dim, at.kv_lora_rank
        if at.q_lora_rank:
            wq_a_DxQ = dense_weight(self, "wq_a", (a.embed, at.q_lora_rank), ("embed", "q_lora"))
            wq_b_QxHxK = dense_weight(self, "wq_b", (at.q_lora_rank, h, p + r), ("q_lora", "heads", "head_dim"))
            q_latent_BxLxQ = jnp.einsum("bld,dq->blq", x_BxLxD, wq_a_DxQ)
            q_latent_BxLxQ = RMSNorm(a, at.q_lora_rank, LATENT_NORM_EPS, name="q_norm")(q_latent_BxLxQ)
            q_BxLxHxK = jnp.einsum("blq,qhk->blhk", q_latent_BxLxQ, wq_b_QxHxK)
        else:
            wq_DxHxK = dense_weight(self, "wq", (a.embed, h, p + r), ("embed", "heads", "head_dim"))
            q_BxLxHxK = jnp.einsum("bld,dhk->blhk", x_BxLxD, wq_DxHxK)
        # the key/value latent and the shared rotary key, one projection
        wkv_a_DxCR = dense_weight(self, "wkv_a", (a.embed, c + r), ("embed", "kv_lora"))
        wkv_b_CxHxPJ = dense_weight(self, "wkv_b", (c, h, p + j), ("kv_lora", "heads", "head_dim"))
        wo_HxJxD = dense_weight(self, "wo", (h, j, a.embed), ("heads", "head_dim", "embed"), (0, 1))
        kv_BxLxCR = jnp.einsum("bld,dc->blc", x_BxLxD, wkv_a_DxCR)
        latent_BxLxC = RMSNorm(a, c, LATENT_NORM_EPS, name="kv_norm")(kv_BxLxCR[..., :c])
        k_rope_BxLx1xR = rope(kv_BxLxCR[..., None, c:], positions_BxL, a.rope)
        q_nope_BxLxHxP = q_BxLxHxK[..., :p]
        q_rope_BxLxHxR = rope(q_BxLxHxK[..., p:], positions_BxL, a.rope)
        variant = Variant(scale=at.scale)

        if cache is not None:  # decoding: the cache keeps the latents (a prefill writes the prompts')
            cache = cache.write(k_rope_BxLx1xR, latent_BxLxC[:, :, None])
        if cache is not None and not cache.prefill:  # a decode step attends in the latent space
            q_latent_BxLxHxC = jnp.einsum("blhp,chp->blhc", q_nope_BxLxHxP, wkv_b_CxHxPJ[..., :p])
            ctx_BxLxHxC = against_latent_cache(q_latent_BxLxHxC, q_rope_BxLxHxR, cache.values_RxSxK, cache.keys_RxSxK,
                                               cache.mask(x_BxLxD.shape[1]), variant.scale)
            ctx_BxLxHxJ = jnp.einsum("blhc,chj->blhj", ctx_BxLxHxC, wkv_b_CxHxPJ[..., p:])
        else:  # training and a prefill: per-head keys and values, the plan's kernel
            kv_BxLxHxPJ = jnp.einsum("blc,chk->blhk", latent_BxLxC, wkv_b_CxHxPJ)
            k_rope_BxLxHxR = jnp.broadcast_to(k_rope_BxLx1xR, (*k_rope_BxLx1xR.shape[:2], h, r))
            axes = ("batch", "length", "heads", "head_dim")
            q_BxLxHxK = constrain(checkpoint_name(jnp.concatenate([q_nope_BxLxHxP, q_rope_BxLxHxR], axis=-1),
                                                  remat.QUERY), axes)
            k_BxLxHxK = constrain(checkpoint_name(jnp.concatenate([kv_BxLxHxPJ[..., :p], k_rope_BxLxHxR], axis=-1),
                                                  remat.KEY), axes)
            v_BxLxHxJ = constrain(checkpoint_name(kv_BxLxHxPJ[..., p:], remat.VALUE), axes)
            ctx_BxLxHxJ = a.plan.attend(q_BxLxHxK, k_BxLxHxK, v_BxLxHxJ, segment_ids_BxL, positions_BxL, variant)
        ctx_BxLxHxJ = checkpoint_name(ctx_BxLxHxJ, remat.CONTEXT)
        out_BxLxD = jnp.einsum("blhj,hjd->bld", ctx_BxLxHxJ, wo_HxJxD)
        return checkpoint_name(out_BxLxD, remat.OUT), cache
